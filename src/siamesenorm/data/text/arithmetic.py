"""The ``arithmetic`` corpus: generated problems such as ``123+45=168``, one per line; held-out problems
never appear in training. ``reverse_answer`` writes results reversed (``123+45=861``, arXiv 2307.03381)."""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Iterable
from dataclasses import dataclass

from ...errors import UserError
from .corpus import Corpus

__all__ = ["OPERATIONS", "ArithmeticProblem", "check_arithmetic_options", "load_arithmetic",
           "make_problems"]

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# The problems one corpus may draw, held-out ones included: they are drawn one by one in Python
# and held in memory as text.
MAX_PROBLEMS = 10_000_000


@dataclass(frozen=True)
class ArithmeticProblem:
    """``a op b``: ``prompt`` is ``"a op b="``, ``answer`` the exact result (reversed when ``reverse``)."""

    a: int
    op: str
    b: int
    reverse: bool = False

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        result = str(OPERATIONS[self.op](self.a, self.b))
        return result[::-1] if self.reverse else result

    @property
    def text(self) -> str:
        return f"{self.prompt}{self.answer}\n"


def _check(operations: Iterable[str], min_digits: int, max_digits: int, n_train: int,
           n_heldout: int) -> tuple[str, int]:
    ops = "".join(op for op in OPERATIONS if op in set(operations))
    unknown = set(operations) - set(OPERATIONS)
    if unknown or not ops:
        raise UserError(f"arithmetic operations must be a non-empty subset of '+-*', got {operations!r}")
    if not 1 <= min_digits <= max_digits <= 18:
        raise UserError(f"arithmetic needs 1 <= min_digits <= max_digits <= 18, got "
                          f"{min_digits} and {max_digits}")
    if n_train < 1 or n_heldout < 1:
        raise UserError(f"arithmetic needs n_train >= 1 and n_heldout >= 1, got {n_train} and {n_heldout}")
    if n_train + n_heldout > MAX_PROBLEMS:
        raise UserError(f"arithmetic: n_train + n_heldout = {n_train + n_heldout:,} problems is more than "
                          f"it generates (at most {MAX_PROBLEMS:,}, about 150 MB of text and a minute "
                          "to draw); lower n_train or n_heldout")
    operands = 10**max_digits - (10 ** (min_digits - 1) if min_digits > 1 else 0)
    space = len(ops) * operands**2
    if n_heldout > space // 2:
        raise UserError(f"arithmetic: {n_heldout} held-out problems leave too few for training: only "
                          f"{space} distinct problems exist; use at most {space // 2} or more digits")
    return ops, space


def check_arithmetic_options(*, operations: Iterable[str] = "+-*", min_digits: int = 1,
                             max_digits: int = 3, n_train: int = 20_000, n_heldout: int = 1_000,
                             **_: object) -> None:
    """Refuse, before any problem is drawn, the options :func:`load_arithmetic` would refuse."""
    _check(operations, min_digits, max_digits, n_train, n_heldout)


def make_problems(operations: Iterable[str] = "+-*", min_digits: int = 1, max_digits: int = 3,
                  n_train: int = 20_000, n_heldout: int = 1_000, seed: int = 0,
                  reverse_answer: bool = False,
                  ) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """``(train, heldout)`` problem lists, disjoint; held-out problems are distinct."""
    ops, _ = _check(operations, min_digits, max_digits, n_train, n_heldout)
    rng = random.Random(seed)

    def operand() -> int:
        digits = rng.randint(min_digits, max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def draw() -> ArithmeticProblem:
        op = rng.choice(ops)
        return ArithmeticProblem(operand(), op, operand(), reverse_answer)

    heldout: dict[ArithmeticProblem, None] = {}  # insertion-ordered set
    while len(heldout) < n_heldout:
        heldout[draw()] = None
    train = []
    for _ in range(n_train):
        problem = draw()
        while problem in heldout:
            problem = draw()
        train.append(problem)
    return train, list(heldout)


def load_arithmetic(*, operations: Iterable[str] = "+-*", min_digits: int = 1, max_digits: int = 3,
                    n_train: int = 20_000, n_heldout: int = 1_000, seed: int = 0,
                    reverse_answer: bool = False) -> Corpus:
    """Training text of ``n_train`` problems; the ``n_heldout`` held-out ones are the validation text."""
    ops, space = _check(operations, min_digits, max_digits, n_train, n_heldout)
    train, heldout = make_problems(ops, min_digits, max_digits, n_train, n_heldout, seed,
                                   reverse_answer)
    text = "".join(p.text for p in train)
    val_text = "".join(p.text for p in heldout)
    digest = hashlib.sha256(f"{text}\x00{val_text}".encode()).hexdigest()
    meta = {"operations": ops, "min_digits": min_digits, "max_digits": max_digits, "n_train": n_train,
            "n_heldout": n_heldout, "seed": seed, "reverse_answer": reverse_answer,
            "distinct_problems": space,
            "fingerprint": {"train": n_train, "heldout": n_heldout, "sha256": digest}}
    return Corpus(name="arithmetic", text=text, meta=meta, val_text=val_text, heldout=heldout)
