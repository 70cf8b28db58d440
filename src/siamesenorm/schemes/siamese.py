"""SiameseNorm: two residual streams that share every sublayer (arXiv 2602.08064, ICML 2026)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.fused import stream_entry, stream_update
from .base import Branch, Flag, OneOf, Option, ResidualScheme, SchemeRequirements, register_scheme
from .fusion import UpdateThenEntry, fuses

FORMS = ("post_pre", "hybrid_pre")
MERGES = ("normed_sum", "sum")
TOPOLOGIES = ("siamese", "single", "resi_dual")


@register_scheme
@fuses(UpdateThenEntry(entry="entry_norms", scale="scale", exit="exit_norms"))
class SiameseNorm(ResidualScheme):
    r"""SiameseNorm (Li et al., ICML 2026, arXiv 2602.08064).

    Two streams start from the embedding, ``X = Y = h``: X Post-Norm-like (bounded), Y Pre-Norm-like
    (a clean identity path); every sublayer reads and writes both. ``c_b = sqrt(2 (b + 1))`` for block
    ``b`` (1 without ``depth_scale``). ``form="post_pre"`` (official DeiT and DiT code), sublayer ``i``::

        X = LN^X_i(X);  O = F_i(LN^in_i(X + LN^Y_i(Y)));  X = X + O / c_b;  Y = Y + O

    ``form="hybrid_pre"`` (official OLMo code, a HybridNorm X stream), block ``b``::

        A = Attn_qkvnorm(X * gamma_b + LN^Y_{2b}(Y));   X = X + A / c_b ; Y = Y + A
        Xn = LN^X_b(X); M = FFN(LN^in_b(Xn + LN^Y_{2b+1}(Y)));  X = Xn + M / c_b ; Y = Y + M

    Exit: ``merge="normed_sum"``: ``LN(LN_a(X) + LN_b(Y))`` (official code; ``final_norm=False``
    drops the outer ``LN``: the DiT merge); ``merge="sum"``: Algorithm 1's ``X_N + LN(Y_N)``, i.e.
    ``LN_a(X) + LN_b(Y)``. Table 3's ablations: ``input_norm``, ``depth_scale``, ``topology``
    (``"single"``: X alone; ``"resi_dual"``: Y never feeds a sublayer). docs/schemes.md.
    """

    name = "siamese"
    role_norm_names = ("pre_norm", "final_norm")  # LN^Y: the norm of the Pre-Norm stream Y
    summary = "X = LN(X); O = F(LN(X + LN(Y))); X += O/c; Y += O; out = LN(LN(X) + LN(Y))"
    paper = "Li et al., ICML 2026, arXiv 2602.08064"
    options = {"form": Option("post_pre", OneOf(FORMS)),
               "input_norm": Option(True, Flag(), attr="use_input_norm"),
               "depth_scale": Option(True, Flag()),
               "merge": Option("normed_sum", OneOf(MERGES)),
               "topology": Option("siamese", OneOf(TOPOLOGIES))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        hybrid = self.form == "hybrid_pre"
        two_streams = self.topology != "single"

        # LN^X: one per sublayer (post_pre) or one per block before the FFN (hybrid_pre).
        self.post_norm = self.make_norms(n_layers if hybrid else self.n_sublayers)
        # LN^Y: the Y stream's contribution to each sublayer's input.
        self.pre_norm = self.make_norms(self.n_sublayers) if self.topology == "siamese" else None
        # LN^in: every sublayer (post_pre) or the FFN only (hybrid_pre; attention has QKV-norm).
        n_in = n_layers if hybrid else self.n_sublayers
        self.input_norm = self.make_branch_norms(n_in) if self.use_input_norm else None
        self.x_gain = nn.ParameterList(
            nn.Parameter(torch.empty(dim, **self._factory)) for _ in range(n_layers)
        ) if hybrid else None
        self.merge_norm_x = self.make_norm()
        self.merge_norm_y = self.make_norm() if two_streams else None
        self.final_norm = self.make_final_norm() if two_streams and self.merge == "normed_sum" \
            else None
        if hybrid:
            self.requires = SchemeRequirements(qkv_norm_blocks=frozenset(range(n_layers)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.x_gain is not None:
            for gain in self.x_gain:
                nn.init.ones_(gain)

    def scale(self, i: int) -> float:
        """``c_b``: the divisor of the update written into X at sublayer ``i``."""
        return math.sqrt(2 * (self.block_of(i) + 1)) if self.depth_scale else 1.0

    # ----------------------------------------------------------------------------------------
    def enter(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        return h, (None if self.topology == "single" else h)

    def entry_norms(self, i: int) -> dict[str, nn.Module | Tensor | None]:
        """The norms of sublayer ``i``'s entry, as :func:`~siamesenorm.nn.fused.stream_entry` takes them."""
        y_norm = None if self.pre_norm is None else self.pre_norm[i]
        if self.form == "hybrid_pre" and self.is_attention(i):
            return {"x_gain": self.x_gain[self.block_of(i)], "y_norm": y_norm}
        k = i if self.form == "post_pre" else self.block_of(i)
        return {"x_norm": self.post_norm[k], "y_norm": y_norm,
                "in_norm": None if self.input_norm is None else self.input_norm[k]}

    def exit_norms(self) -> dict[str, nn.Module | None]:
        return {"x_norm": self.merge_norm_x, "y_norm": self.merge_norm_y, "in_norm": self.final_norm}

    def step(self, state: tuple, i: int, branch: Branch) -> tuple:
        x, y = state
        # X = LN^X(X); u = LN^in(X + LN^Y(Y))   (hybrid_pre's attention: u = X * gamma_b + LN^Y(Y))
        x, u = stream_entry(x, y, **self.entry_norms(i))
        # X += O / c_b; Y += O
        return stream_update(x, y, branch(u), self.scale(i))

    def exit(self, state: tuple) -> Tensor:
        x, y = state
        if y is None:
            return self.merge_norm_x(x)
        # LN(LN_a(X) + LN_b(Y)), or LN_a(X) + LN_b(Y) without the outer norm
        return stream_entry(x, y, **self.exit_norms())[1]

    def streams(self, state: tuple) -> dict[str, Tensor]:
        x, y = state
        return {"x": x} if y is None else {"x": x, "y": y}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, form={self.form}, topology={self.topology}, "
                f"input_norm={self.input_norm is not None}, depth_scale={self.depth_scale}, "
                f"merge={self.merge}")
