"""A stock OLMo-core model's weights in the scheme model of its own placement and back
(``load_olmo_core_state``, ``olmo_core_state_dict``): in float64 both compute the same logits after
either move; a scheme with no OLMo-core counterpart, or a state of another block type, is refused
in one line; docs/olmo-core.md's recipe runs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("olmo_core")

from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType  # noqa: E402
from olmo_core.nn.transformer.config import TransformerBlockType as Block  # noqa: E402

from helpers import run_docs_section  # noqa: E402
from siamesenorm.errors import UserError  # noqa: E402
from siamesenorm.olmo_core import (  # noqa: E402
    OWN_OPTIONS,
    OWN_SCHEME,
    from_transformer_config,
    load_olmo_core_state,
    map_from_olmo_core,
    map_to_olmo_core,
    olmo_core_state_dict,
)
from test_olmo_core_users import CONFIGS, SEQ, VOCAB, _exact_norms, _portable, olmo2_like  # noqa: E402


def _layernorm_peri() -> object:
    """Peri-LN blocks with LayerNorms (a weight and a bias each)."""
    norm = LayerNormConfig(name=LayerNormType.default, eps=1e-5, bias=True)
    user = olmo2_like(Block.peri_norm)
    return replace(user, block=replace(user.block, layer_norm=norm),
                   lm_head=replace(user.lm_head, layer_norm=norm))


MAKERS = {name: make for name, (make, _) in CONFIGS.items()} | {"peri_norm-layernorm": _layernorm_peri}


def _pair(name: str):
    """OLMo-core's own model of the config and the scheme model of its own placement, float64, on
    different random weights."""
    user = _exact_norms(MAKERS[name]())
    scheme = from_transformer_config(user, OWN_SCHEME[user.block.name], OWN_OPTIONS.get(user.block.name))
    torch.manual_seed(0)
    theirs = user.build(init_device="cpu").double()
    ours = scheme.build(init_device="cpu").double()
    with torch.no_grad():
        for model in (theirs, ours):          # norms off their ones and zeros: a swap would show
            for key, p in model.named_parameters():
                if "norm" in key:
                    p.add_(0.1 * torch.randn_like(p))
        # default_scaled's OLMo-core constant, exact in float64 (OLMo-core builds it in float32)
        for b, block in theirs.blocks.items():
            if hasattr(block, "ln_scale"):
                block.ln_scale.fill_(1 / math.sqrt(int(b) + 1))
    _portable(theirs)
    _portable(ours)
    return user, theirs.eval(), ours.eval()


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    assert got.dtype == torch.float64
    return bool((got - want).abs().max() <= 1e-12 * want.abs().max())


@pytest.mark.parametrize("name", MAKERS)
def test_stock_weights_load_into_the_scheme_model_and_back(name):
    _, theirs, ours = _pair(name)
    assert not _close(_logits(ours), _logits(theirs))           # different weights so far
    load_olmo_core_state(ours, theirs.state_dict())
    assert _close(_logits(ours), _logits(theirs)), name
    # back: the scheme model's weights, moved on, into OLMo-core's model
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert not _close(_logits(theirs), _logits(ours))
    theirs.load_state_dict(olmo_core_state_dict(ours))
    assert _close(_logits(theirs), _logits(ours)), name
    state = ours.state_dict()
    again = map_from_olmo_core(map_to_olmo_core(state, ours.scheme), ours.scheme)
    assert again.keys() == state.keys() and all(again[k] is state[k] for k in state)


def test_the_placement_matters_where_the_keys_are_alike():
    """OLMo2's reordered_norm and Llama's default blocks have the same keys: loaded into "pre",
    OLMo2's weights compute another function; the tolerance above can tell them apart."""
    user, theirs, _ = _pair("olmo2-reordered")
    pre = from_transformer_config(user, "pre").build(init_device="cpu").double().eval()
    load_olmo_core_state(pre, theirs.state_dict())
    assert (_logits(pre) - _logits(theirs)).abs().max() > 1e-3


def _refused(call, says: str) -> None:
    with pytest.raises(UserError) as error:
        call()
    message = str(error.value)
    assert says in message and "\n" not in message, message


@pytest.mark.parametrize("scheme, options, says", [
    ("siamese", None, "scheme 'siamese' is no stock OLMo-core block's placement; those are pre (default, "
                      "moe); peri_ln (peri_norm); lns (default_scaled); peri_ln input_norm=False (reordered"),
    ("hybridnorm", None, "scheme 'hybridnorm' is no stock OLMo-core block's placement"),
    ("pre", {"branch_affine": False}, "scheme 'pre' with branch_affine=False is no stock OLMo-core block's"),
    ("peri_ln", {"embed_norm": True}, "with embed_norm=True is no stock"),
])
def test_a_scheme_without_an_olmo_core_counterpart_is_refused_both_ways(scheme, options, says):
    user = olmo2_like()
    model = from_transformer_config(user, scheme, options).build(init_device="meta")
    _refused(lambda: olmo_core_state_dict(model), says)
    _refused(lambda: load_olmo_core_state(model, user.build(init_device="meta").state_dict()), says)


def test_a_state_of_another_block_type_or_size_is_refused():
    def build(make, scheme=None, options=None):
        user = make()
        return from_transformer_config(user, scheme or OWN_SCHEME[user.block.name],
                                       options or OWN_OPTIONS.get(user.block.name)).build(init_device="cpu")

    peri = olmo2_like(Block.peri_norm).build(init_device="cpu").state_dict()
    scaled = olmo2_like(Block.default_scaled).build(init_device="cpu")
    default = olmo2_like().build(init_device="cpu").state_dict()
    _refused(lambda: load_olmo_core_state(build(olmo2_like), peri),
             "blocks.0.post_attention_norm.weight: scheme 'pre' has no post_attention_norm")
    _refused(lambda: load_olmo_core_state(build(olmo2_like), scaled.state_dict()),
             "blocks.0.ln_scale: the state is a default_scaled model's; load it into scheme 'lns'")
    _refused(lambda: load_olmo_core_state(build(olmo2_like, "lns"), default),
             "the state has no blocks.*.ln_scale")
    with torch.no_grad():
        scaled.blocks["1"].ln_scale.fill_(0.0)          # OLMo-core 3.0.0's init_weights can leave it so
    _refused(lambda: load_olmo_core_state(build(olmo2_like, "lns"), scaled.state_dict()),
             "blocks.1.ln_scale is 0, not 1/sqrt(2) = 0.707107")
    without_head_norm = {k: v for k, v in default.items() if not k.startswith("lm_head.norm")}
    _refused(lambda: load_olmo_core_state(build(olmo2_like), without_head_norm),
             "(1 keys missing, 0 extra): it lacks lm_head.norm.weight")
    wider = replace(olmo2_like(), n_layers=3).build(init_device="cpu").state_dict()
    _refused(lambda: load_olmo_core_state(build(olmo2_like), wider), "extra): it has blocks.2.")
    bigger_vocab = build(lambda: replace(olmo2_like(), vocab_size=2 * VOCAB))
    _refused(lambda: load_olmo_core_state(bigger_vocab, default),
             "embeddings.weight has shape (64, 32) in the state, (128, 32) in the model")
    _refused(lambda: olmo_core_state_dict(olmo2_like().build(init_device="meta")),
             "model must be a scheme model (from_transformer_config(...).build()), got Transformer")


def test_the_docs_recipe_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_docs_section("olmo-core.md", "A stock OLMo-core model's weights")


def test_a_block_override_of_another_placement_is_refused():
    """One block placing its norms otherwise than the rest would be computed in the scheme's one
    placement, silently unlike the stock model: refused."""
    user = olmo2_like(Block.default)
    other = replace(user.block, name=Block.reordered_norm)
    with pytest.raises(UserError, match=r"block_overrides\[1\]\.name=reordered_norm places its norms unlike"):
        from_transformer_config(replace(user, block_overrides={1: other}), "pre")
    assert from_transformer_config(replace(user, block_overrides={1: user.block}), "siamese") is not None
