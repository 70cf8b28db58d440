"""Data: tokenizers, corpora (stdlib, arithmetic, text, .bin tokens, HF), splits and batches."""

from __future__ import annotations

import operator
import os
import platform
import re
import sys
import types

import numpy as np
import pytest
import torch

from siamesenorm.data import (
    BatchSampler,
    ByteTokenizer,
    Corpus,
    build_tokenizer,
    evaluate_arithmetic,
    lm_answer_fn,
    load_corpus,
    load_tokenizer,
    make_problems,
    read_token_file,
    split_text,
    split_tokens,
    train_val_tokens,
    validation_batches,
    write_shard,
)
from siamesenorm.data.text import pystdlib as pystdlib_module
from siamesenorm.data.text.pystdlib import EXCLUDED_DIRS, stdlib_files
from siamesenorm.data.text.tokenfiles import SHARD_MAGIC
from siamesenorm.errors import ConfigError

MIXED_TEXT = "def f(x):\n    return x + 1  # naïve café, 日本語, emoji 🙂\n\tλ = 'π'\n"


# ---- tokenizers ----------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_any_text_and_replaces_bad_bytes(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(MIXED_TEXT)
    assert tok.vocab_size == 256 and ids == list(MIXED_TEXT.encode("utf-8")) and max(ids) > 127
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.decode(torch.tensor(ids)) == MIXED_TEXT and tok.decode(np.array(ids)) == MIXED_TEXT
    assert tok.encode_array(MIXED_TEXT).tolist() == ids
    assert tok.decode([104, 0xFF, 105]) == "h\ufffdi"  # invalid UTF-8 byte
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # id outside the byte range
    assert isinstance(load_tokenizer(tok.save(tmp_path / "tok")), ByteTokenizer)


def test_bpe_round_trips_saves_and_loads(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from siamesenorm.data.text import tokenizers as tokenizers_module

    corpus = load_corpus("pystdlib", max_bytes=150_000)
    tok = build_tokenizer("bpe", corpus, vocab_size=400)
    assert 256 < tok.vocab_size <= 400
    ids = tok.encode(corpus.text[:5000])
    assert len(ids) < 5000 * 0.8  # merges were learnt: fewer tokens than bytes
    assert tok.decode(tok.encode(MIXED_TEXT)) == MIXED_TEXT  # unseen non-ASCII text round-trips
    again = build_tokenizer("bpe", corpus, vocab_size=400)
    assert again.encode(corpus.text[:5000]) == ids  # training is deterministic
    loaded = load_tokenizer(tok.save(tmp_path / "bpe"))
    assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
    assert loaded.encode(corpus.text[:5000]) == ids and loaded.decode(ids) == corpus.text[:5000]
    # encode_array encodes pieces of a long text in parallel; the cut points must not change ids.
    monkeypatch.setattr(tokenizers_module, "_PIECE_CHARS", 40)
    assert tok.encode_array(corpus.text[:20000]).tolist() == tok.encode(corpus.text[:20000])


def test_bpe_learns_from_the_training_split_only():
    pytest.importorskip("tokenizers")
    # The last tenth of the text (the validation split) is the only place "zq" occurs.
    text = "ab cd ef gh\n" * 900 + "zqzq zqzq\n" * 120
    train, val = split_text(text, 0.1)
    assert "zq" not in train and val.count("zq") == 480
    tok = build_tokenizer("bpe", Corpus(name="t", text=text), vocab_size=300, val_fraction=0.1)
    assert len(tok.encode("ab cd")) < 5                    # merges of the training text were learnt
    assert len(tok.encode("zqzq")) == 4                     # none of the validation text's
    x, y = train_val_tokens(Corpus(name="t", text=text), tok, 0.1)
    assert tok.decode(x) == train and tok.decode(y) == val


def test_text_split_cuts_at_a_character_boundary_and_matches_the_byte_split():
    text = "é" * 15  # 30 bytes: the byte split (at byte 27) would cut inside a character
    train, val = split_text(text, 0.1)
    assert train + val == text and val == "éé"
    ascii_text = "x" * 37 + "y" * 3
    corpus = Corpus(name="t", text=ascii_text)
    tokens = np.frombuffer(ascii_text.encode(), dtype=np.uint8)
    for got, want in zip(train_val_tokens(corpus, ByteTokenizer(), 0.1), split_tokens(tokens, 0.1)):
        assert np.array_equal(got, want)
    with pytest.raises(ConfigError, match="cannot split"):
        split_text("é", 0.5)


def test_bpe_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    corpus = Corpus(name="t", text="some text")
    with pytest.raises(ConfigError, match=r"pip install tokenizers.*siamesenorm\[bpe\]"):
        build_tokenizer("bpe", corpus, vocab_size=300)


def test_bad_tokenizer_requests_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer_kind.json is missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_kind.json").write_text('{"kind": "wordpiece"}')
    with pytest.raises(ConfigError, match="unknown tokenizer kind 'wordpiece'"):
        load_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="unknown tokenizer 'chars'"):
        build_tokenizer("chars", Corpus(name="t", text="x"))
    with pytest.raises(ConfigError, match="already tokens"):
        build_tokenizer("bytes", Corpus(name="t", tokens=np.arange(5)))


# ---- pystdlib ------------------------------------------------------------------------------------

def test_pystdlib_is_deterministic_and_respects_max_bytes():
    a = load_corpus("pystdlib", max_bytes=120_000)
    b = load_corpus("pystdlib", max_bytes=120_000)
    fp = a.meta["fingerprint"]
    assert fp == b.meta["fingerprint"] and a.text == b.text
    assert fp["bytes"] == len(a.text.encode("utf-8")) == 120_000  # the stdlib is far larger
    assert fp["python"] == platform.python_version() and re.fullmatch(r"[0-9a-f]{64}", fp["sha256"])
    smaller = load_corpus("pystdlib", max_bytes=50_000)
    assert a.text.startswith(smaller.text) and smaller.meta["fingerprint"]["sha256"] != fp["sha256"]


def test_pystdlib_file_list_leaves_out_tests_and_site_packages():
    files = stdlib_files()
    root = pystdlib_module.sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any(set(r.split("/")[:-1]) & EXCLUDED_DIRS for r in rel)
    assert not any(r.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for r in rel)


def test_pystdlib_selection_on_a_fake_stdlib(tmp_path, monkeypatch):
    for rel, content in {"a.py": "A = 1\n", "pkg/b.py": "B = 'é'\n", "zz.py": "Z = 'ü'\n",
                         "notes.txt": "not python\n", "test/test_a.py": "T = 1\n",
                         "pkg/tests/t.py": "T = 2\n", "idlelib/idle_test/x.py": "T = 3\n",
                         "lib2to3/tests/y.py": "T = 4\n", "site-packages/pip/p.py": "P = 1\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content, encoding="utf-8")
    (tmp_path / "latin.py").write_bytes(b"X = '\xe9'\n")  # Latin-1, not UTF-8
    monkeypatch.setattr(pystdlib_module.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus = load_corpus("pystdlib")
    assert corpus.text == "A = 1\n\n\nB = 'é'\n\n\nZ = 'ü'\n"
    assert corpus.meta["fingerprint"]["files"] == 3 and corpus.meta["skipped_files"] == 1
    cut = load_corpus("pystdlib", max_bytes=len(b"A = 1\n\n\nB = '") + 1)  # inside 'é'
    assert cut.text == "A = 1\n\n\nB = '" and cut.meta["truncated"]


# ---- arithmetic ----------------------------------------------------------------------------------

_LINE = re.compile(r"(\d+)([+\-*])(\d+)=(-?\d+)")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _parse(text: str) -> list[tuple[int, str, int, int]]:
    lines = text.splitlines()
    matches = [_LINE.fullmatch(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches) if not m][:3]
    return [(int(m[1]), m[2], int(m[3]), int(m[4])) for m in matches]


def test_arithmetic_problems_are_correct_and_held_out_never_trained_on():
    corpus = load_corpus("arithmetic", n_train=3000, n_heldout=300, seed=3, min_digits=2, max_digits=3)
    train, held = _parse(corpus.text), _parse(corpus.val_text)
    assert len(train) == 3000 and len(held) == 300 == len(set(held))
    for a, op, b, result in train + held:
        assert _OPS[op](a, b) == result and 10 <= a <= 999 and 10 <= b <= 999
    assert {op for _, op, _, _ in train} == {"+", "-", "*"}
    assert any(r < 0 for _, op, _, r in train if op == "-")  # negative results appear, e.g. 97-213=-116
    assert not {(a, op, b) for a, op, b, _ in held} & {(a, op, b) for a, op, b, _ in train}
    assert [p.text for p in corpus.heldout] == corpus.val_text.splitlines(keepends=True)
    assert load_corpus("arithmetic", n_train=3000, n_heldout=300, seed=3, min_digits=2,
                       max_digits=3).text == corpus.text
    assert load_corpus("arithmetic", n_train=3000, n_heldout=300, seed=4).text != corpus.text


def test_arithmetic_options_and_refusals():
    train, held = make_problems("+", 1, 1, n_train=500, n_heldout=40, seed=0)  # 100 distinct problems
    assert {p.op for p in train + held} == {"+"} and not set(train) & set(held)
    with pytest.raises(ConfigError, match="at most 50"):
        load_corpus("arithmetic", operations="+", min_digits=1, max_digits=1, n_heldout=60)
    with pytest.raises(ConfigError, match="subset of"):
        load_corpus("arithmetic", operations="+/")
    with pytest.raises(ConfigError, match="min_digits"):
        load_corpus("arithmetic", min_digits=3, max_digits=2)


def test_evaluate_arithmetic_scores_exact_matches():
    _, problems = make_problems(n_train=1, n_heldout=40, seed=1)
    truth = {p.prompt: p.answer for p in problems}

    def perfect(prompts):
        return [f" {truth[p]}\n12+3=15\n" for p in prompts]  # only the first line counts

    def wrong(prompts):
        return [truth[p] + "0" for p in prompts]

    def half(prompts):
        return [truth[p] if i % 4 else "nope" for i, p in enumerate(prompts)]

    assert evaluate_arithmetic(perfect, problems)["accuracy"] == 1.0
    assert evaluate_arithmetic(wrong, problems)["correct"] == 0
    result = evaluate_arithmetic(half, problems)
    assert result["correct"] == 30 and result["total"] == 40 and result["accuracy"] == 0.75
    assert set(result["by_op"]) <= {"+", "-", "*"}


class _OracleModel(torch.nn.Module):
    """Greedy 'generation' that appends the true answer (as bytes) and pads with newlines."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[int, int]] = []

    def generate(self, ids, max_new_tokens, *, greedy=False):
        assert greedy
        self.calls.append(tuple(ids.shape))
        rows = []
        for row in ids.tolist():
            text = bytes(row).decode()
            assert text.startswith("\n")       # a problem follows a newline, as in training
            a, op, b = _LINE.fullmatch(text[1:] + "0").groups()[:3]
            answer = list(f"{_OPS[op](int(a), int(b))}\n".encode()) + [10] * max_new_tokens
            rows.append(row + answer[:max_new_tokens])
        return torch.tensor(rows)


def test_lm_answer_fn_batches_by_length_and_keeps_the_prompt_order():
    _, problems = make_problems(n_train=1, n_heldout=60, seed=2)
    model = _OracleModel()
    result = evaluate_arithmetic(lm_answer_fn(model, ByteTokenizer(), max_new_tokens=8, batch_size=4),
                                 problems)
    assert result["accuracy"] == 1.0
    assert all(b <= 4 for b, _ in model.calls) and len({t for _, t in model.calls}) > 1
    assert sum(b for b, _ in model.calls) == 60


def test_reversed_answers_are_written_and_scored_reversed():
    train, heldout = make_problems("+-", 1, 3, n_train=50, n_heldout=40, seed=3, reverse_answer=True)
    for p in train + heldout:
        result = str(p.a + p.b if p.op == "+" else p.a - p.b)
        assert p.answer == result[::-1] and p.text == f"{p.a}{p.op}{p.b}={result[::-1]}\n"
    corpus = load_corpus("arithmetic", operations="+-", n_train=50, n_heldout=40, seed=3,
                         reverse_answer=True)
    assert corpus.meta["reverse_answer"] is True
    assert corpus.text == "".join(p.text for p in train)
    # the same problems as without reversal, only their answers written the other way round
    plain = make_problems("+-", 1, 3, n_train=50, n_heldout=40, seed=3)[1]
    assert [(p.a, p.op, p.b) for p in plain] == [(p.a, p.op, p.b) for p in heldout]
    by_hand = {p.prompt: str(p.a + p.b if p.op == "+" else p.a - p.b)[::-1] for p in heldout}
    right = evaluate_arithmetic(lambda ps: [by_hand[q] + "\n" for q in ps], heldout)
    wrong = evaluate_arithmetic(lambda ps: [by_hand[q][::-1] + "\n" for q in ps], heldout)
    assert right["accuracy"] == 1.0
    assert wrong["accuracy"] == sum(a == a[::-1] for a in by_hand.values()) / len(heldout)


def test_lm_answer_fn_batched_equals_one_prompt_at_a_time_on_a_real_model():
    from siamesenorm.models.lm import LanguageModel, LMConfig

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=32,
                                   init_std=0.5))
    prompts = [p.prompt for p in make_problems(n_train=1, n_heldout=24, seed=5)[1]]
    batched = lm_answer_fn(model, ByteTokenizer(), 5, batch_size=8)(prompts)
    single = [lm_answer_fn(model, ByteTokenizer(), 5)([p])[0] for p in prompts]
    assert batched == single and len(set(batched)) > 1


# ---- token files ---------------------------------------------------------------------------------

def _nanogpt(path, tokens):
    np.asarray(tokens, dtype=np.uint16).tofile(path)


def test_bin_readers_both_formats_single_file_and_shard_folder(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50257, size=n).astype(np.uint16) for n in (1000, 700, 300)]
    _nanogpt(tmp_path / "plain.bin", parts[0])
    tokens, fmt = read_token_file(tmp_path / "plain.bin")
    assert fmt == "nanogpt" and np.array_equal(tokens, parts[0])
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "s_000002.bin", parts[2])
    write_shard(shards / "s_000000.bin", parts[0])
    _nanogpt(shards / "s_000001.bin", parts[1])  # a folder may mix the two formats
    (shards / "README.txt").write_text("ignored: the folder holds .bin shards")
    tokens, fmt = read_token_file(shards / "s_000000.bin")
    assert fmt == "modded-nanogpt" and np.array_equal(tokens, parts[0])
    corpus = load_corpus(str(shards))
    assert corpus.is_tokenized and corpus.text is None
    assert np.array_equal(corpus.tokens, np.concatenate(parts))  # sorted shard order
    assert corpus.meta["max_token"] == int(np.concatenate(parts).max())
    assert corpus.meta["formats"] == ["modded-nanogpt", "nanogpt"]
    globbed = load_corpus(str(shards / "s_00000[01].bin"))
    assert np.array_equal(globbed.tokens, np.concatenate(parts[:2]))
    with_val = load_corpus(str(tmp_path / "plain.bin"), val=str(shards / "s_000002.bin"))
    train, val = train_val_tokens(with_val)
    assert np.array_equal(train, parts[0]) and np.array_equal(val, parts[2])


def test_malformed_bin_files_are_refused_naming_the_file(tmp_path):
    good = np.arange(100, dtype=np.uint16)
    write_shard(tmp_path / "v2.bin", good)
    header = np.fromfile(tmp_path / "v2.bin", dtype=np.int32, count=256)
    header[1] = 2
    (tmp_path / "v2.bin").write_bytes(header.tobytes() + good.tobytes())
    header[1], header[2] = 1, 101
    (tmp_path / "count.bin").write_bytes(header.tobytes() + good.tobytes())
    (tmp_path / "odd.bin").write_bytes(good.tobytes() + b"\x01")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "short.bin").write_bytes(np.array([SHARD_MAGIC, 1], dtype=np.int32).tobytes())
    cases = {"v2.bin": "version 2", "count.bin": "header says 101 tokens", "odd.bin": "odd size",
             "empty.bin": "is empty", "short.bin": "shorter than"}
    for name, problem in cases.items():
        with pytest.raises(ConfigError, match=re.escape(name) + ".*" + problem):
            load_corpus(str(tmp_path / name))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_shard(folder / "a.bin", good)
    (folder / "b.bin").write_bytes(good.tobytes() + b"\x01")
    with pytest.raises(ConfigError, match=r"b\.bin.*odd size"):
        load_corpus(str(folder))


# ---- text files ----------------------------------------------------------------------------------

def test_text_file_and_folder_corpora(tmp_path):
    (tmp_path / "one.txt").write_text(MIXED_TEXT, encoding="utf-8")
    corpus = load_corpus(str(tmp_path / "one.txt"))
    assert corpus.text == MIXED_TEXT and corpus.meta["fingerprint"]["files"] == 1
    folder = tmp_path / "docs"
    files = {"b.md": "bee\n", "a/z.py": "zed\n", "a/c.txt": "sea\n", ".git/x": "hidden\n"}
    for rel, content in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(content)
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # not UTF-8
    (folder / "a/ids.dat").write_bytes(b"a\x00b\x00")  # valid UTF-8, but NUL bytes: binary
    corpus = load_corpus(str(folder))
    assert corpus.text == "sea\n\n\nzed\n\n\nbee\n"  # a/c.txt, a/z.py, b.md; no .git, no binary
    assert corpus.meta["skipped_files"] == 2
    assert load_corpus(str(folder), max_bytes=8).text == "sea\n\n\nze"
    assert load_corpus(str(tmp_path / "one.txt"), val=str(folder / "b.md")).val_text == "bee\n"


def test_text_corpus_errors_are_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match=r"empty\.txt is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match="folder .*nothing is empty"):
        load_corpus(str(tmp_path / "nothing"))
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"blob is not UTF-8 text"):
        load_corpus(str(tmp_path / "binary"))
    with pytest.raises(ConfigError, match="matches no file"):
        load_corpus(str(tmp_path / "*.nothing"))
    with pytest.raises(ConfigError, match="has no option 'max_bytes'"):
        load_corpus("arithmetic", max_bytes=10)


# ---- Hugging Face datasets -----------------------------------------------------------------------

def test_hf_corpus_without_datasets_says_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match="pip install datasets"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1")


def test_hf_corpus_loads_offline_and_turns_failures_into_config_errors(monkeypatch):
    seen = []

    def load_dataset(name, config, split):
        seen.append((name, config, split, os.environ.get("HF_HUB_OFFLINE")))
        if name == "broken":
            raise FileNotFoundError("Couldn't find a dataset script\nlong traceback text")
        return [{"text": f"{split} row {i}"} for i in range(3)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    corpus = load_corpus("hf:org/tiny:cfg", val_split="validation")
    assert corpus.text == "train row 0\n\ntrain row 1\n\ntrain row 2"
    assert corpus.val_text.startswith("validation row 0")
    assert seen[0] == ("org/tiny", "cfg", "train", "1") and "HF_HUB_OFFLINE" not in os.environ
    with pytest.raises(ConfigError, match="cannot load dataset 'broken'.*Couldn't find") as info:
        load_corpus("hf:broken")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no field 'content'"):
        load_corpus("hf:org/tiny", text_field="content")


# ---- splits and batches --------------------------------------------------------------------------

def test_split_is_deterministic_and_uses_held_out_text_when_there_is_one():
    tokens = np.arange(1000)
    train, val = split_tokens(tokens, 0.1)
    assert np.array_equal(train, tokens[:900]) and np.array_equal(val, tokens[900:])
    assert all(np.array_equal(a, b) for a, b in zip(split_tokens(tokens, 0.1), (train, val)))
    with pytest.raises(ConfigError, match="val_fraction"):
        split_tokens(tokens, 1.0)
    corpus = load_corpus("arithmetic", n_train=50, n_heldout=10)
    train, val = train_val_tokens(corpus, ByteTokenizer(), val_fraction=0.5)
    assert bytes(val.tolist()).decode() == corpus.val_text and bytes(train.tolist()).decode() == corpus.text


def test_same_seed_same_batches_whatever_else_draws_random_numbers():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    a = BatchSampler(tokens, 4, 16, seed=7)
    b = BatchSampler(torch.from_numpy(tokens.astype(np.int64)), 4, 16, seed=7)
    for _ in range(5):
        xa, ya = a.next_batch()
        torch.rand(10)  # the global generator is not the sampler's
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.dtype == torch.int64 and xa.shape == (4, 16) and torch.equal(xa[:, 1:], ya[:, :-1])
    starts = [int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(tokens, 16)
                                 .__eq__(row.numpy()).all(1))[0]) for row in xa]
    assert all(np.array_equal(tokens[s + 1:s + 17], y.numpy()) for s, y in zip(starts, ya))
    assert not torch.equal(BatchSampler(tokens, 4, 16, seed=8).next_batch()[0],
                           BatchSampler(tokens, 4, 16, seed=7).next_batch()[0])
    with pytest.raises(ConfigError, match="needs at least 17"):
        BatchSampler(tokens[:16], 4, 16)


def test_resumed_sampler_continues_with_the_uninterrupted_batches(tmp_path):
    tokens = np.arange(10_000) % 251
    straight = BatchSampler(tokens, 3, 8, seed=1)
    expected = [straight.next_batch() for _ in range(10)]
    first = BatchSampler(tokens, 3, 8, seed=1)
    for _ in range(4):
        first.next_batch()
    torch.save(first.state_dict(), tmp_path / "sampler.pt")
    resumed = BatchSampler(tokens, 3, 8, seed=999)  # the state, not the seed, decides
    resumed.load_state_dict(torch.load(tmp_path / "sampler.pt", weights_only=True))
    assert resumed.batches_drawn == 4
    for x, y in expected[4:]:
        rx, ry = next(resumed)
        assert torch.equal(rx, x) and torch.equal(ry, y)
    with pytest.raises(ConfigError, match="n_tokens"):
        BatchSampler(tokens[:5000], 3, 8).load_state_dict(first.state_dict())


def test_validation_batches_are_fixed_and_non_overlapping():
    tokens = np.arange(2000)
    first = validation_batches(tokens, 4, 10, n_batches=5)
    second = validation_batches(tokens, 4, 10, n_batches=5)
    assert len(first) == 5 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                   for a, b in zip(first, second))
    starts = torch.cat([x[:, 0] for x, _ in first]).tolist()
    assert starts == sorted(starts) and all(s % 10 == 0 for s in starts)
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:])) and starts[-1] > 1500  # spread out
    assert all(torch.equal(y, x + 1) for x, y in first)
    assert len(validation_batches(tokens[:101], 4, 10, n_batches=5)) == 2  # only 10 windows fit
    with pytest.raises(ConfigError, match="needs at least 41"):
        validation_batches(tokens[:30], 4, 10, n_batches=1)
