"""What a language-model run measures at each evaluation besides the validation loss: the expert
load and router entropy of a mixture of experts, and held-out arithmetic answered exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..data import evaluate_arithmetic, lm_answer_fn
from ..parallel import all_mean, current_world
from ..train import Evaluation


class RouterStats:
    """Within the ``with`` block, the expert load and router entropy of every forward of a model's
    mixture-of-experts layers (``model.moe_layers()``, :class:`~siamesenorm.nn.moe.MoE`).
    :meth:`figures` averages them over the forwards and the ranks."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = list(model.moe_layers())
        self.seen: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        self.hooks: list = []

    def __enter__(self) -> RouterStats:
        for i, layer in enumerate(self.layers):
            self.hooks.append(layer.register_forward_hook(
                lambda module, args, out, i=i: self.seen[i].append((module.load, module.entropy))))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def figures(self, device: torch.device) -> dict[str, Any]:
        """``expert_load`` (per layer, each expert's share of the token-expert assignments),
        ``expert_load_max`` (the largest share; 1 / n_experts when balanced) and
        ``router_entropy`` (nats, mean over layers)."""
        if not self.layers or not all(self.seen):
            return {}
        loads = [torch.stack([load for load, _ in seen]).float().mean(0) for seen in self.seen]
        entropy = torch.stack([torch.stack([e for _, e in seen]).float().mean()
                               for seen in self.seen]).mean()
        flat = all_mean(current_world(), torch.cat([*loads, entropy.reshape(1)]).to(device)).tolist()
        out, start = [], 0
        for load in loads:
            out.append(flat[start:start + load.numel()])
            start += load.numel()
        return {"expert_load": out, "expert_load_max": max(max(layer) for layer in out),
                "router_entropy": flat[-1]}


class LMEvaluation(Evaluation):
    """Router statistics of an MoE model's validation forwards; with ``data.corpus=arithmetic``,
    ``arith_acc`` on ``data.eval_problems`` held-out problems."""

    def __init__(self, problems: list, tokenizer: Any, device: torch.device) -> None:
        self.problems, self.tokenizer, self.device = problems, tokenizer, device
        self.routers: RouterStats | None = None
        self.longest = max((len(tokenizer.encode(p.answer)) for p in problems), default=0) + 1

    @classmethod
    def for_run(cls, cfg: Any, data: Any, run_dir: Path, device: torch.device) -> LMEvaluation:
        return cls(data.corpus.heldout[:cfg.data.eval_problems], data.tokenizer, device)

    def validating(self, model: nn.Module) -> RouterStats:
        self.routers = RouterStats(model)
        return self.routers

    def __call__(self, model: nn.Module, step: int) -> dict[str, Any]:
        figures = self.routers.figures(self.device) if self.routers is not None else {}
        if self.problems:
            score = evaluate_arithmetic(lm_answer_fn(model, self.tokenizer, self.longest), self.problems)
            figures["arith_acc"] = score["accuracy"]
        return figures
