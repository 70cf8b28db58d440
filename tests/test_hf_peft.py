"""An adapted Hugging Face model under PEFT's LoRA and transformers' ``Trainer``.

LoRA targets the family's own module names under every scheme; a per-head QKV-norm applies to the
LoRA-adapted projection's output (norm((W + BA) x)), merged or not; ``modules_to_save`` trains and
saves the scheme's norms; ``Trainer`` weight-decays the matrices and nothing of the scheme; folders
and run checkpoints of the earlier layout load.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("siamesenorm.hf.adapt needs transformers 5", allow_module_level=True)

import siamesenorm.hf as H  # noqa: E402
from siamesenorm import list_schemes  # noqa: E402

V = 97
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _quiet_and_few_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(before)


def config(family: str = "llama", **kw):
    """2 layers, width 64, 4 heads of 16; Llama has no QK-norm of its own (hybrid_pre norms q, k
    and v), Qwen3 has one (v only)."""
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    cfg = cls(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, head_dim=16, pad_token_id=0, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def adapted(scheme: str = "siamese", family: str = "llama", seed: int = 0, **options):
    torch.manual_seed(seed)
    a = H.adapt(config(family), scheme, **options)
    with torch.no_grad():        # every scheme and head norm its own value
        for name, p in a.named_parameters():
            if "residual_norm" in name or "head_norm" in name:
                p.normal_(1.0, 0.3)
    return a.eval()


def ids(b: int = 2, t: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


def lora(model, **kw):
    kw = {"target_modules": PROJECTIONS, "r": 4, "lora_alpha": 8, "init_lora_weights": False} | kw
    torch.manual_seed(5)
    return peft.get_peft_model(model, peft.LoraConfig(**kw))


SCHEMES = [(s, {}) for s in list_schemes()] + [("siamese", {"form": "hybrid_pre"})]


@pytest.mark.parametrize("scheme, options", SCHEMES,
                         ids=[s + ("-" + "-".join(o.values()) if o else "") for s, o in SCHEMES])
def test_lora_targets_the_familys_module_names_under_every_scheme(scheme, options):
    a = adapted(scheme, **options)
    x = ids()
    with torch.no_grad():
        before = a(x).logits
    m = lora(a).train()
    wrapped = {n.rsplit(".", 1)[-1] for n, mod in m.named_modules() if hasattr(mod, "lora_A")}
    assert wrapped == set(PROJECTIONS)
    loss = m(x, labels=x).loss
    loss.backward()
    trained = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in m.named_parameters()
               if p.requires_grad and "lora_B" in n)
    with torch.no_grad():            # B != 0: the adapters change the output
        assert (m(x).logits - before).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_qkv_norm_applies_to_the_lora_adapted_projection_merged_or_not(family):
    a = adapted("siamese", family, form="hybrid_pre")
    reference = copy.deepcopy(a)
    m = lora(a, target_modules=["q_proj", "k_proj", "v_proj"])
    x = ids()
    with torch.no_grad():
        out = m(x).logits
    # the reference: W + scale * B A written into the plain model's projections by hand
    with torch.no_grad():
        for name, module in m.named_modules():
            if hasattr(module, "lora_A"):
                ref = reference.get_submodule(name.removeprefix("base_model.model."))
                delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
                ref.weight += module.scaling["default"] * delta
        want = reference(x).logits
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # norm(W x) + B A x would be another function: the adapters sit inside the norm
    merged = m.merge_and_unload()
    assert all(type(getattr(merged.model.stack.sublayers[0], p)) is torch.nn.Linear
               for p in ("q_proj", "k_proj", "v_proj"))
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, want, atol=1e-5, rtol=1e-5)


def test_lora_compiles_and_generates_the_same_with_and_without_the_cache():
    m = lora(adapted("siamese", form="hybrid_pre"), target_modules=["v_proj", "q_proj"])
    x = ids()
    attn = m.base_model.model.model.stack.sublayers[0]         # LoRA inside a per-head norm
    h = torch.randn(2, 7, 64)
    rope = m.base_model.model.model.rotary_emb(h, torch.arange(7)[None])
    with torch.no_grad():
        eager = attn(h, position_embeddings=rope, attention_mask=None)[0]
        compiled = torch.compile(attn, backend="aot_eager")(
            h, position_embeddings=rope, attention_mask=None)[0]
        kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        cached, uncached = m.generate(input_ids=x, **kw), m.generate(input_ids=x, use_cache=False, **kw)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(cached, uncached) and cached.shape == (2, 12)


def test_modules_to_save_trains_the_schemes_norms_and_saves_them_in_the_adapter(tmp_path):
    a = adapted("siamese", "qwen3", form="hybrid_pre")
    m = lora(a, target_modules=["q_proj", "v_proj"], modules_to_save=["residual_norm", "v_head_norm"])
    m.train()
    x = ids()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    m(x, labels=x).loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    for part in ("merge_norm_x", "x_gain", "input_norm", "v_head_norm"):
        names = [n for n in grads if part in n]
        assert names and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in names), part
    opt.step()
    m.eval()
    with torch.no_grad():
        trained = m(x).logits
    m.save_pretrained(tmp_path)
    saved = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tmp_path / "adapter_model.safetensors"))
    assert any("residual_norm.merge_norm_x" in k for k in saved)
    assert any("v_head_norm" in k for k in saved) and any("lora_A" in k for k in saved)
    base = adapted("siamese", "qwen3", form="hybrid_pre")        # the same base, untrained
    with torch.no_grad():
        assert (base(x).logits - trained).abs().max() > 1e-3
        loaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
        torch.testing.assert_close(loaded(x).logits, trained, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme, options", [("siamese", {"form": "hybrid_pre"}), ("hyper", {}),
                                             ("pre", {})])
def test_trainer_weight_decays_the_matrices_and_nothing_of_the_scheme(tmp_path, scheme, options):
    a = adapted(scheme, **options)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          weight_decay=0.1)
    trainer = transformers.Trainer(model=a, args=args)
    decayed = set(trainer.get_decay_parameter_names(a))
    matrices = {n for n, p in a.named_parameters() if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))}
    assert decayed == matrices | {"model.embed_tokens.weight", "lm_head.weight"} - {""}
    scheme_params = [n for n, _ in a.named_parameters() if n.startswith("model.stack.residual_norm.")]
    assert scheme_params and not decayed & set(scheme_params)
    trainer.create_optimizer()
    groups = {g["weight_decay"]: {id(p) for p in g["params"]} for g in trainer.optimizer.param_groups}
    assert {id(p) for n, p in a.named_parameters() if n in decayed} == groups[0.1]


def _old_names(state: dict) -> dict:
    """The earlier layout: the scheme at ``stack.scheme``, a QKV-norm wrapping its projection."""
    out = {}
    for key, value in state.items():
        key = key.replace(".residual_norm.", ".scheme.")
        for k in "qkv":
            key = key.replace(f"{k}_proj.weight", f"{k}_proj.proj.weight")
            key = key.replace(f"{k}_head_norm.", f"{k}_proj.norm.")
        out[key] = value
    return out


def test_a_folder_of_the_earlier_layout_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    a = adapted("siamese", form="hybrid_pre")
    a.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    old = _old_names(load_file(str(file)))
    assert "model.stack.scheme.merge_norm_x.weight" in old and \
        "model.stack.sublayers.0.v_proj.norm.weight" in old
    save_file(old, str(file), metadata={"format": "pt"})
    # a folder's vendored code, loaded with remote code, registers the class name with the renamings
    # its own model holds (none of the QKV-norm's): ours must not take that as already done
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    register_checkpoint_conversion_mapping(type(a).__name__, [], overwrite=True)
    b = H.adapt_from_pretrained(tmp_path).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(b(x).logits, a(x).logits, atol=0, rtol=0)
    b.save_pretrained(tmp_path / "again")                      # saved with today's names
    keys = load_file(str(tmp_path / "again" / "model.safetensors")).keys()
    assert "model.stack.residual_norm.merge_norm_x.weight" in keys and not any(".scheme." in k for k in keys)


def test_a_family_run_checkpoint_of_the_earlier_layout_loads(tmp_path):
    from safetensors.torch import save_file

    from siamesenorm.hf.family_lm import FamilyLM
    from siamesenorm.tasks import load_config
    from siamesenorm.train.checkpoint.load import read_model

    cfg = load_config("tiny", ["model.family=llama", "model.scheme=siamese",
                               "model.scheme_options={form: hybrid_pre}"]).model
    torch.manual_seed(0)
    ours = FamilyLM(cfg).eval()
    with torch.no_grad():
        for p in ours.scheme.parameters():
            p.normal_(1.0, 0.3)
    state = {k: v.clone() for k, v in ours.state_dict().items()
             if k != "hf.lm_head.weight" or not cfg.tie_embeddings}
    save_file(_old_names(state), str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    fresh = FamilyLM(cfg).eval()
    fresh.load_state_dict(read_model(tmp_path / "model.safetensors", fresh), strict=True)
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).logits, ours(x).logits, atol=0, rtol=0)
    # and torch's own load_state_dict, for code that loads a state dict itself
    torch.manual_seed(2)
    again = FamilyLM(cfg).eval()
    again.load_state_dict(_old_names(ours.state_dict()), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ours(x).logits, atol=0, rtol=0)
