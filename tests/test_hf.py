"""``siamesenorm.hf``: our language model as a transformers model. References are our own model
(``LanguageModel``: forward, ``generate``) and the Hugging Face conventions written out here
(labels shifted by one, left padding, hidden states per block)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import siamesenorm.hf as H  # noqa: E402
from siamesenorm import list_schemes  # noqa: E402
from siamesenorm.models import LanguageModel  # noqa: E402

V = 61


def config(scheme="pre", **kw) -> H.SiameseNormConfig:
    values = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, max_seq_len=48, scheme=scheme)
    values.update(kw)
    return H.SiameseNormConfig(**values)


def model(scheme="pre", seed=0, **kw) -> H.SiameseNormForCausalLM:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(scheme, **kw)).eval()


def ids(b=2, t=9, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_auto_classes_know_the_model_type():
    cfg = config("siamese", scheme_options={"form": "hybrid_pre"})
    values = {k: v for k, v in cfg.to_dict().items() if k != "model_type"}
    again = transformers.AutoConfig.for_model("siamesenorm", **values)
    assert type(again) is H.SiameseNormConfig and again.to_lm_config() == cfg.to_lm_config()
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    assert isinstance(m, H.SiameseNormForCausalLM) and isinstance(m.model, LanguageModel)
    assert m.model.config == cfg.to_lm_config()
    assert m.model.scheme.form == "hybrid_pre"
    assert isinstance(transformers.AutoModel.from_config(cfg), H.SiameseNormForCausalLM)
    # Hugging Face's usual names read ours
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.max_position_embeddings) == (32, 2, 4, 48)


def test_the_config_refuses_what_lmconfig_refuses():
    with pytest.raises(ValueError, match="norm"):
        config(norm="batchnorm")
    with pytest.raises(ValueError, match="no-such-scheme"):
        transformers.AutoModelForCausalLM.from_config(config("no-such-scheme"))
    with pytest.raises(ValueError, match="top_k"):
        config(moe={"every": 1, "n_experts": 2, "top_k": 3})


@pytest.mark.parametrize("scheme", list_schemes())
def test_logits_equal_ours_after_a_save_and_load(scheme, tmp_path):
    m = model(scheme)
    x = ids()
    ours = m.model(x).logits
    assert torch.equal(m(x).logits, ours)
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is H.SiameseNormForCausalLM
    assert loaded.config.to_lm_config() == m.config.to_lm_config()
    torch.testing.assert_close(loaded(x).logits, ours, rtol=0, atol=1e-6)


def test_an_moe_model_round_trips(tmp_path):
    m = model("siamese", moe={"every": 1, "n_experts": 4, "top_k": 2})
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.moe_layers() and loaded.config.moe["n_experts"] == 4
    torch.testing.assert_close(loaded(ids()).logits, m.model(ids()).logits, rtol=0, atol=1e-6)


def test_labels_give_the_shifted_cross_entropy():
    m = model("siamese")
    x = ids()
    labels = x.clone()
    labels[0, :3] = -100
    out = m(x, labels=labels)
    logits = m.model(x).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("scheme", ["pre", "siamese", "hyper", "resi_dual"])
def test_left_padding_computes_each_sequence_as_if_alone(scheme):
    m = model(scheme)
    a, b = ids(1, 8, seed=2), ids(1, 5, seed=3)
    batch = torch.cat([a, F.pad(b, (3, 0), value=0)])
    mask = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    out = m(batch, attention_mask=mask).logits
    torch.testing.assert_close(out[0], m.model(a).logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1, 3:], m.model(b).logits[0], rtol=0, atol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("scheme", ["pre", "post", "siamese", "mhc"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_equals_ours(scheme, use_cache):
    m = model(scheme)
    prompt = ids(2, 5)
    theirs = m.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=use_cache)
    ours = m.model.generate(prompt, 12, greedy=True, use_cache=use_cache)
    assert torch.equal(theirs, ours)


def test_generate_reads_the_cache_one_token_at_a_time():
    m = model("siamese")
    calls = []
    m.model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append((args[0].shape[1], kw["pos"])), with_kwargs=True)
    m.generate(ids(1, 4), max_new_tokens=4, do_sample=False)
    assert calls == [(4, 0), (1, 4), (1, 5), (1, 6)]


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_batched_generate_with_left_padding_equals_ours_per_prompt(scheme):
    m = model(scheme)
    prompts = [ids(1, 7, seed=4), ids(1, 3, seed=5), ids(1, 5, seed=6)]
    width = max(p.shape[1] for p in prompts)
    batch = torch.cat([F.pad(p, (width - p.shape[1], 0), value=0) for p in prompts])
    mask = torch.cat([F.pad(torch.ones_like(p), (width - p.shape[1], 0)) for p in prompts])
    out = m.generate(batch, attention_mask=mask, max_new_tokens=10, do_sample=False,
                     pad_token_id=0)
    for row, p in zip(out, prompts):
        ours = m.model.generate(p, 10, greedy=True)[0]
        assert torch.equal(row[width - p.shape[1]:], ours)


def test_hidden_states_are_per_block_and_end_at_the_head_input():
    m = model("siamese", n_layers=3)
    x = ids()
    out = m(x, output_hidden_states=True)
    assert len(out.hidden_states) == len(out.streams) == 4
    assert all(set(s) == {"x", "y"} for s in out.streams)
    assert all(h.shape == (2, 9, 32) for h in out.hidden_states)
    # the last is what the head reads (tied: the embedding matrix)
    torch.testing.assert_close(out.hidden_states[-1] @ m.model.embed.weight.T, out.logits)
    # each intermediate one is the merge LN(LN(X) + LN(Y)) of that boundary's streams
    scheme = m.model.scheme
    for h, s in zip(out.hidden_states, out.streams):
        torch.testing.assert_close(h, scheme.exit((s["x"], s["y"])))
    # the embedding boundary: X = Y = the embedding
    emb = m.model.embed(x)
    torch.testing.assert_close(out.streams[0]["y"], emb)


def test_a_one_stream_scheme_gives_its_raw_stream():
    m = model("pre")
    x = ids()
    out = m(x, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[0], m.model.embed(x))
    assert not torch.allclose(out.hidden_states[1], m.model.scheme.exit(out.hidden_states[1]))
    assert all(set(s) == {"h"} for s in out.streams)


def test_activation_checkpointing_gives_the_same_gradients():
    def grads(m):
        m.train()
        m(ids(), labels=ids()).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    plain = grads(model("siamese"))
    m = model("siamese")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)       # renamed in transformers 5
        m.gradient_checkpointing_enable()
    assert m.gradient_checkpointing
    assert "step" in vars(m.model.scheme)                    # our checkpointed step is installed
    checked = grads(m)
    for name in plain:
        torch.testing.assert_close(checked[name], plain[name], rtol=1e-5, atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m.gradient_checkpointing_disable()
    assert "step" not in vars(m.model.scheme)


@pytest.mark.parametrize("tie", [True, False])
def test_resize_token_embeddings_keeps_the_old_rows(tie):
    m = model("siamese", tie_embeddings=tie)
    x = ids()
    before = m(x).logits
    m.resize_token_embeddings(V + 7)
    assert m.config.vocab_size == m.model.config.vocab_size == V + 7
    after = m(x).logits
    assert after.shape[-1] == V + 7
    torch.testing.assert_close(after[..., :V], before)
    if not tie:
        assert m.model.lm_head.weight.shape == (V + 7, 32)


def test_inputs_embeds_and_4d_masks_are_refused_with_a_reason():
    m = model()
    with pytest.raises(ValueError, match="input_ids, not inputs_embeds"):
        m(inputs_embeds=torch.zeros(1, 3, 32))
    with pytest.raises(ValueError, match="2-D attention_mask"):
        m(ids(1, 3), attention_mask=torch.ones(1, 1, 3, 3))
    with pytest.raises(ValueError, match="attention_mask covers 2 positions"):
        m(ids(1, 3), attention_mask=torch.ones(1, 2))


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_trainer_trains_a_tiny_model(scheme, tmp_path):
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    text = torch.arange(V).repeat(40)                         # a sequence easy to learn
    rows = [{"input_ids": text[i:i + 24], "labels": text[i:i + 24]} for i in range(0, 600, 7)]
    m = model(scheme).train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=30,
        learning_rate=3e-3, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=m, args=args, train_dataset=rows)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 4
    assert losses[-1] < 0.8 * losses[0]


def test_the_config_reports_the_head_size_a_static_cache_needs():
    """transformers sizes a static KV cache by ``config.head_dim``: a head size of its own counts."""
    from siamesenorm.hf import SiameseNormConfig

    assert SiameseNormConfig(dim=64, n_heads=4, head_size=32).head_dim == 32
    assert SiameseNormConfig(dim=64, n_heads=4).head_dim == 16
