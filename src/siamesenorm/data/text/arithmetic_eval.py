"""Exact-match accuracy on arithmetic problems, and the answer function of a language model."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from .arithmetic import ArithmeticProblem
from .tokenizers import Tokenizer

__all__ = ["AnswerFn", "evaluate_arithmetic", "lm_answer_fn"]

AnswerFn = Callable[[list[str]], list[str]]


def evaluate_arithmetic(answer_fn: AnswerFn, problems: Sequence[ArithmeticProblem]) -> dict:
    """Score ``answer_fn`` (called once, prompts -> completions) on ``problems``: a completion is right when
    its first line, stripped, is the answer. Returns ``accuracy``, ``correct``, ``total`` and ``by_op``."""
    if not problems:
        raise ValueError("evaluate_arithmetic needs at least one problem")
    completions = list(answer_fn([p.prompt for p in problems]))
    if len(completions) != len(problems):
        raise ValueError(f"answer_fn returned {len(completions)} completions for {len(problems)} prompts")
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for problem, completion in zip(problems, completions):
        ok = completion.split("\n", 1)[0].strip() == problem.answer
        hits[problem.op][0] += ok
        hits[problem.op][1] += 1
    correct = sum(h[0] for h in hits.values())
    return {"accuracy": correct / len(problems), "correct": correct, "total": len(problems),
            "by_op": {op: c / n for op, (c, n) in sorted(hits.items())}}


def lm_answer_fn(model: torch.nn.Module, tokenizer: Tokenizer, max_new_tokens: int,
                 batch_size: int = 64, context: str = "\n") -> AnswerFn:
    """An answer function completing each prompt greedily with ``model.generate``. Each prompt follows
    ``context``, as a problem follows a newline in the training text; prompts of equal token length are
    batched without padding."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"lm_answer_fn needs max_new_tokens >= 1 and batch_size >= 1, "
                         f"got {max_new_tokens} and {batch_size}")

    def answer(prompts: list[str]) -> list[str]:
        device = next(model.parameters()).device
        encoded = [tokenizer.encode(context + p) for p in prompts]
        by_length: dict[int, list[int]] = defaultdict(list)
        for index, ids in enumerate(encoded):
            by_length[len(ids)].append(index)
        out = [""] * len(prompts)
        for length, indices in sorted(by_length.items()):
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long, device=device)
                new = model.generate(ids, max_new_tokens, greedy=True)[:, length:].tolist()
                for i, row in zip(chunk, new):
                    out[i] = tokenizer.decode(row)
        return out

    return answer
