"""Values checked up front, and data that cannot be read as it claims to be: each is refused with
one stderr line naming the value, key or file, exit status 2 and no traceback, before anything is
written (the output folder is not created, or is left as it was)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from siamesenorm.cli import main
from siamesenorm.config import read_preset
from siamesenorm.data import load_corpus, read_token_file, write_shard
from siamesenorm.data.text.textfiles import read_utf8
from siamesenorm.errors import ConfigError

TINY = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "train.checkpoint_every=2",
        "data.max_bytes=40000"]
IMAGES = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "train.checkpoint_every=2",
          "model.n_layers=1", "model.dim=16"]
SEED_MAX = 2**63 - 1


def refused(capsys, argv: list[str], *fragments: str) -> str:
    """Run the command in this process; assert a one-line refusal holding every fragment."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"siamesenorm {argv[0]}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes: equal snapshots, untouched folder."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Finished two-step runs of each task: a language model, a ViT and a DiT."""
    root = tmp_path_factory.mktemp("runs")
    commands = {"lm": ["tiny", *TINY], "vit": ["vit-digits", *IMAGES],
                "dit": ["dit-digits", *IMAGES, "diffusion.eval_samples=8", "diffusion.sample_steps=2"]}
    for name, args in commands.items():
        assert main(["train", *args, "--out", str(root / name)]) == 0
    return {name: root / name for name in commands}


# ---- 1. train.betas -------------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    ("[0.9,1.0]", "train.betas[1] must be in [0, 1), got 1.0"),
    ("[1.5,0.95]", "train.betas[0] must be in [0, 1), got 1.5"),
    ("[-0.1,0.95]", "train.betas[0] must be in [0, 1), got -0.1"),
    ("[0.9,-1e-9]", "train.betas[1] must be in [0, 1)"),
    ("[0.9]", "train.betas must be a list of 2 values, got [0.9]"),
    ("[0.9,0.95,0.99]", "train.betas must be a list of 2 values"),
    ("0.9", "train.betas must be a list of 2 values, got 0.9"),
    ("[0.9,abc]", "train.betas[1] must be a number, got 'abc'"),
    ("[true,0.95]", "train.betas[0] must be a number, got True"),
    ("[.nan,0.95]", "train.betas[0] must be finite"),
])
def test_betas_outside_zero_one_or_malformed_are_refused(tmp_path, capsys, value, fragment):
    out = tmp_path / "run"
    refused(capsys, ["train", "tiny", *TINY, f"train.betas={value}", "--out", str(out)], fragment)
    assert not out.exists()


def test_betas_at_the_edges_of_zero_one_are_accepted(capsys):
    assert main(["train", "tiny", "train.betas=[0,0.999999]", "--dry-run"]) == 0


# ---- 2. seeds -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-1", str(SEED_MAX + 1), str(2**64)])
def test_a_seed_outside_0_to_2_63_is_refused(tmp_path, capsys, value):
    out = tmp_path / "run"
    refused(capsys, ["train", "tiny", *TINY, f"seed={value}", "--out", str(out)],
            f"seed must be an integer from 0 to 2**63-1 ({SEED_MAX}), got {value}")
    assert not out.exists()
    refused(capsys, ["compare", "tiny", *TINY, "--schemes", "pre", "--seeds", f"0,{value}",
                     "--out", str(out)], "--seeds must be an integer from 0 to 2**63-1", value)
    assert not out.exists()
    refused(capsys, ["train", "vit-digits", *IMAGES, f"data.split_seed={value}", "--out", str(out)],
            "data.split_seed must be an integer", value)
    assert not out.exists()


def test_the_largest_seed_is_accepted(capsys):
    assert main(["train", "tiny", f"seed={SEED_MAX}", "--dry-run"]) == 0


def test_a_compare_section_seed_out_of_range_is_refused_naming_the_section(tmp_path, capsys):
    preset = tmp_path / "grid.yaml"
    preset.write_text("compare:\n  seeds: [0, -5]\n")
    out = tmp_path / "exp"
    refused(capsys, ["compare", str(preset), *TINY, "--schemes", "pre", "--out", str(out)],
            "compare.seeds must be an integer", "-5")
    assert not out.exists()


# ---- 3. generate --temperature (and --seed) -------------------------------------------------------
@pytest.mark.parametrize("flag, value, fragment", [
    ("--temperature", "nan", "--temperature must be a finite number, got nan"),
    ("--temperature", "inf", "--temperature must be a finite number, got inf"),
    ("--temperature", "-inf", "--temperature must be a finite number, got -inf"),
    ("--temperature", "-0.5", "--temperature must not be negative, got -0.5"),
    ("--seed", "-1", "--seed must be an integer from 0 to 2**63-1"),
    ("--seed", str(2**64), "--seed must be an integer from 0 to 2**63-1"),
])
def test_generate_refuses_a_temperature_or_seed_it_cannot_sample_with(runs, capsys, flag, value, fragment):
    before = snapshot(runs["lm"])
    refused(capsys, ["generate", str(runs["lm"]), "--prompt", "x", "--max-new-tokens", "3",
                     f"{flag}={value}"], fragment)
    assert snapshot(runs["lm"]) == before


# ---- 4. and 5. compare --lrs and --seeds ---------------------------------------------------------
@pytest.mark.parametrize("lrs", ["inf", "nan", "-1e-3", "0", "1e-3,inf"])
def test_compare_refuses_a_learning_rate_train_lr_refuses(tmp_path, capsys, lrs):
    out = tmp_path / "exp"
    bad = lrs.split(",")[-1]
    refused(capsys, ["compare", "tiny", *TINY, "--schemes", "pre", f"--lrs={lrs}", "--out", str(out)],
            "--lrs: each learning rate must be a positive finite number",
            f"got {float(bad)}")
    assert not out.exists()
    refused(capsys, ["train", "tiny", *TINY, f"train.lr={bad}", "--out", str(out)], "train.lr must be")
    assert not out.exists()


@pytest.mark.parametrize("flag, value, fragment", [
    ("--lrs", "1e-3,2e-3,1e-3", "--lrs names a learning rate twice: 0.001, 0.002, 0.001"),
    ("--lrs", "1e-3,0.001", "--lrs names a learning rate twice: 0.001, 0.001"),
    ("--lrs", "0.001,0.0010000001", "--lrs names a learning rate twice"),   # one run name, lr0.001
    ("--seeds", "0,1,0", "--seeds names a seed twice: 0, 1, 0"),
    ("--schemes", "pre,post,pre", "--schemes names a scheme twice: pre, post, pre"),
])
def test_compare_refuses_a_value_given_twice(tmp_path, capsys, flag, value, fragment):
    out = tmp_path / "exp"
    args = ["compare", "tiny", *TINY, f"{flag}={value}", "--out", str(out)]
    if flag != "--schemes":
        args += ["--schemes", "pre"]
    refused(capsys, args, fragment)
    assert not out.exists()


def test_a_compare_section_repeating_a_learning_rate_is_refused_naming_the_section(tmp_path, capsys):
    preset = tmp_path / "grid.yaml"
    preset.write_text("compare:\n  lrs: [1.0e-3, 1.0e-3]\n")
    out = tmp_path / "exp"
    refused(capsys, ["compare", str(preset), *TINY, "--schemes", "pre", "--out", str(out)],
            "compare.lrs names a learning rate twice")
    assert not out.exists()


# ---- 6. an empty output path ---------------------------------------------------------------------
@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_by_every_command_that_writes(runs, tmp_path, monkeypatch, capsys, out):
    monkeypatch.chdir(tmp_path)          # an empty --out would have meant this folder
    for argv in (["train", "tiny", *TINY, "--out", out],
                 ["compare", "tiny", *TINY, "--schemes", "pre", "--out", out],
                 ["analyze", str(runs["lm"]), "--out", out],
                 ["export", str(runs["lm"]), "--out", out]):
        refused(capsys, argv, f"--out is empty ({out!r})")
    for argv in (["generate", out, "--prompt", "x"], ["analyze", out],
                 ["export", out, "--out", "w.safetensors"]):
        refused(capsys, argv, f"RUN_DIR is empty ({out!r})")
    assert list(tmp_path.iterdir()) == []


# ---- 7. files that are not UTF-8 -----------------------------------------------------------------
def test_a_preset_that_is_not_utf8_is_refused_naming_it(tmp_path, capsys):
    preset = tmp_path / "latin1.yaml"
    preset.write_bytes("# réglages\ntrain:\n  steps: 2\n".encode("latin-1"))
    out = tmp_path / "run"
    refused(capsys, ["train", str(preset), "--out", str(out)],
            f"cannot read {preset}: it is not UTF-8 text (byte 0xe9 at offset 3)")
    assert not out.exists()


def test_a_preset_with_a_byte_order_mark_is_read(tmp_path):
    preset = tmp_path / "bom.yaml"
    preset.write_bytes(b"\xef\xbb\xbftrain:\n  steps: 2\n")
    assert read_preset(str(preset)) == {"train": {"steps": 2}}
    preset.write_bytes(b"\xef\xbb\xbftrain: \xff\n")
    with pytest.raises(ConfigError, match=r"\(byte 0xff at offset 10\)"):
        read_preset(str(preset))


def test_resuming_a_run_whose_config_is_not_utf8_is_refused_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny", *TINY, "--out", str(run)]) == 0
    config = run / "config.yaml"
    config.write_bytes(config.read_bytes().replace(b"model:", b"mod\xffel:", 1))
    before = snapshot(run)
    refused(capsys, ["train", "--resume", "--out", str(run)], f"cannot read {config}: it is not UTF-8")
    assert snapshot(run) == before


# ---- 8. a key given twice ------------------------------------------------------------------------
@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  lr: 1.0e-3\n  steps: 2\n  lr: 2.0e-3\n", "train.lr", "lines 2 and 4"),
    ("train:\n  steps: 2\ntrain:\n  lr: 2.0e-3\n", "train", "lines 1 and 3"),
    ("model:\n  scheme: siamese\n  scheme_options:\n    depth_scale: true\n    depth_scale: false\n",
     "model.scheme_options.depth_scale", "lines 4 and 5"),
    ("compare:\n  variants:\n    a: {scheme: pre, overrides: {train.lr: 1, train.lr: 2}}\n",
     "compare.variants.a.overrides.train.lr", "line 3"),
    ("compare:\n  lrs: [{a: 1, a: 2}]\n", "compare.lrs[0].a", "line 2"),
])
def test_a_preset_giving_a_key_twice_is_refused_naming_the_key(tmp_path, capsys, text, key, lines):
    preset = tmp_path / "dup.yaml"
    preset.write_text(text)
    out = tmp_path / "run"
    for command in ("train", "compare"):
        refused(capsys, [command, str(preset), *TINY, "--out", str(out)],
                f"preset {preset} gives the key {key} twice ({lines}); keep one")
        assert not out.exists()


def test_a_merge_key_may_be_overridden_beside_it(tmp_path):
    preset = tmp_path / "merge.yaml"
    preset.write_text("base: &b {steps: 2, lr: 1.0e-3}\ntrain:\n  <<: *b\n  lr: 2.0e-3\n")
    assert read_preset(str(preset))["train"] == {"steps": 2, "lr": 2.0e-3}


@pytest.mark.parametrize("overrides, fragment", [
    (["train.lr=1e-3", "train.lr=2e-3"],
     "train.lr is given twice on the command line (train.lr=1e-3, train.lr=2e-3); give it once"),
    (["seed=1", "model.dim=16", "seed=1"], "seed is given twice on the command line (seed=1, seed=1)"),
    (["model.scheme=siamese", "model.scheme_options={depth_scale: true, depth_scale: false}"],
     "gives the key model.scheme_options.depth_scale twice"),
    # through a mapping: which one wins was the last one, silently
    (["model={dim: 64}", "model.dim=32"],
     "model.dim is given twice on the command line (model={dim: 64}, model.dim=32); give it once"),
    (["train.lr=2e-3", "train={lr: 1e-3, steps: 2}"], "train.lr is given twice on the command line"),
    (["model.scheme=siamese", "model.scheme_options={form: post_pre}",
      "model.scheme_options.form=hybrid_pre"],
     "model.scheme_options.form is given twice on the command line"),
])
def test_an_override_given_twice_is_refused_naming_the_key(tmp_path, capsys, overrides, fragment):
    out = tmp_path / "run"
    for command in ("train", "compare"):
        refused(capsys, [command, "tiny", *TINY, *overrides, "--out", str(out)], fragment)
        assert not out.exists()


# ---- 9. what a preset path names ------------------------------------------------------------------
def test_a_preset_larger_than_any_real_one_is_refused_before_it_is_parsed(tmp_path, capsys):
    """A 38.9 MB preset of 2,000,000 keys took 987 s and 3.7 GB to refuse; now one line at once."""
    from siamesenorm.config import MAX_PRESET_BYTES

    big = tmp_path / "big.yaml"
    line = "k{}: 1\n"
    with big.open("w") as file:
        file.write("model:\n  n_layers: 2\n")
        for i in range(MAX_PRESET_BYTES // len(line.format(0)) + 1):
            file.write(line.format(i))
    out = tmp_path / "run"
    for command in ("train", "compare"):
        refused(capsys, [command, str(big), "--out", str(out)], f"preset {big} is 1.", "a preset is a few KB")
    assert not out.exists()


def test_a_preset_file_without_the_yaml_suffix_is_loaded(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine").write_text("model:\n  n_layers: 3\n")
    (tmp_path / "mine.conf").write_text("model:\n  n_layers: 5\n")
    monkeypatch.chdir(tmp_path)
    assert read_preset("mine") == {"model": {"n_layers": 3}}
    assert read_preset(str(tmp_path / "mine")) == {"model": {"n_layers": 3}}
    assert read_preset("mine.conf") == {"model": {"n_layers": 5}}
    capsys.readouterr()
    assert main(["train", "mine", "--dry-run"]) == 0
    assert "3 layers x" in capsys.readouterr().out
    assert read_preset("tiny")["model"]["dim"] == 32          # a packaged name is still the package's


def test_a_folder_named_like_a_preset_is_refused_as_a_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "x.yaml").mkdir()
    (tmp_path / "plain").mkdir()
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    for name in ("x.yaml", str(tmp_path / "x.yaml"), "plain"):
        refused(capsys, ["train", name, "--out", str(out)],
                f"preset {name} is a folder, not a preset file")
    assert not out.exists()


def test_a_preset_that_is_a_fifo_is_refused_without_reading_it(tmp_path, capsys):
    fifo = tmp_path / "preset.yaml"
    os.mkfifo(fifo)
    refused(capsys, ["train", str(fifo), "--out", str(tmp_path / "run")],
            f"preset {fifo} is not a regular file")
    assert not (tmp_path / "run").exists()


# ---- 10. generate on an image run -----------------------------------------------------------------
@pytest.mark.parametrize("task, kind", [("vit", "a ViT image-classification run (task: vit)"),
                                        ("dit", "a DiT image-diffusion run (task: dit)")])
def test_generate_on_an_image_run_says_what_the_run_is(runs, capsys, task, kind):
    before = snapshot(runs[task])
    refused(capsys, ["generate", str(runs[task]), "--prompt", "x"],
            f"{runs[task]} is {kind}", "generate", "for language-model runs (task: lm)")
    assert snapshot(runs[task]) == before


# ---- 11. data ---------------------------------------------------------------------------------------
def test_a_corpus_path_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)                      # reading it would wait for a writer forever
    out = tmp_path / "run"
    for path, kind in (("/dev/zero", "a character device"), (str(fifo), "a FIFO")):
        refused(capsys, ["train", "tiny", *TINY, f"data.corpus={path}", "--out", str(out)],
                f"corpus path {path} is {kind}, not a regular file")
        refused(capsys, ["train", "tiny", *TINY, f"data.corpus_options.val={path}",
                         f"data.corpus={Path(__file__)}", "--out", str(out)], f"corpus path {path} is")
    folder = tmp_path / "only-special"
    folder.mkdir()
    os.mkfifo(folder / "pipe")
    (folder / "sub").mkdir()
    refused(capsys, ["train", "tiny", *TINY, f"data.corpus={folder}", "--out", str(out)],
            f"corpus folder {folder} is empty")
    assert not out.exists()


def test_a_text_corpus_is_read_no_further_than_max_bytes(tmp_path):
    big = tmp_path / "big.txt"
    with big.open("wb") as f:            # 16 GiB, sparse: text, then what reads as zeros; read
                                         # whole, it would not fit in memory
        f.write(("héllo wörld\n" * 2000).encode("utf-8"))
        f.truncate(1 << 34)
    corpus = load_corpus(str(big), max_bytes=10_001)
    assert len(corpus.text.encode("utf-8")) in (10_000, 10_001)     # cut at a whole character
    assert corpus.text == ("héllo wörld\n" * 2000).encode("utf-8")[:10_001].decode("utf-8", "ignore")
    assert corpus.meta["truncated"] is True
    text, more = read_utf8(big, 5)
    assert (text, more) == ("héll", True)
    assert read_utf8(big, 30_000)[0] is None       # past the text, the zeros are NUL bytes: not text


def test_an_image_over_pillows_bound_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    Image = pytest.importorskip("PIL.Image")
    root = tmp_path / "images"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / label / f"{i}.png")
    Image.new("RGB", (24, 24)).save(root / "b" / "huge.png")          # 576 pixels
    out = tmp_path / "run"
    args = ["train", "vit-digits", *IMAGES, f"data.dataset={root}", "data.dataset_options.image_size=8",
            "--out", str(out)]
    for bound in (200, 400):          # Pillow raises above twice its bound, and warns below that
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", bound)
        refused(capsys, args, f"image {root / 'b' / 'huge.png'} is too large to read safely",
                "576 pixels")
        assert not out.exists()


def test_a_bin_file_whose_header_lost_its_magic_gets_a_warning(tmp_path, capsys):
    tokens = np.arange(1, 301, dtype=np.uint16)
    shard = tmp_path / "shard.bin"
    write_shard(shard, tokens)
    damaged = tmp_path / "damaged.bin"
    data = bytearray(shard.read_bytes())
    data[:4] = (12345).to_bytes(4, "little")
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    read, fmt = read_token_file(damaged)
    err = capsys.readouterr().err
    assert fmt == "nanogpt" and len(read) == len(data) // 2      # read as headerless, as before
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: token file {damaged} lacks the shard magic")
    assert "12345, 1, 300" in lines[0]
    # a shard with its magic, and a headerless file of real tokens, are read without a word
    for path, array in ((shard, tokens), (tmp_path / "plain.bin", np.arange(600, dtype=np.uint16) % 251 + 1)):
        if path.name == "plain.bin":
            array.tofile(path)
        assert np.array_equal(read_token_file(path)[0], array)
    assert capsys.readouterr().err == ""
