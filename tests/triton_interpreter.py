"""Tests of siamesenorm's Triton kernels: on CUDA, or under Triton's interpreter on the CPU.

Triton chooses its interpreter when it decorates its functions, its own library's included, so
TRITON_INTERPRET=1 must be set before Triton is first imported. A kernel test module imports Triton
through :func:`import_triton` (which sets it around that import when nothing imported Triton yet),
asks :func:`interpreted` whether the interpreter is on (re-decorating its kernels module if need
be), sets it around each test (the front functions read it when they dispatch) and, where Triton was
imported before without it (collecting the whole suite does that), keeps only the test made by
:func:`fresh_process_test`, which runs the module again in a process that sets it first
(:func:`collect`). Where several modules collect that test, one of them runs them all, first in the
run (:func:`one_fresh_process`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CHILD = "SIAMESENORM_KERNEL_TESTS_CHILD"


@contextlib.contextmanager
def interpret_env() -> Iterator[None]:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def import_triton():
    """Triton (the test module skips without it), with its interpreter where it can still be chosen."""
    with interpret_env() if not CUDA and "triton" not in sys.modules else contextlib.nullcontext():
        return pytest.importorskip("triton")


def interpreted(module: str, kernel: str) -> bool:
    """Whether Triton's own functions were decorated for the interpreter; if so, (re)decorate the
    kernels of ``module`` (``kernel``: one of them). Raises in a fresh process where it is not on."""
    triton = import_triton()
    from triton.runtime.interpreter import InterpretedFunction

    on = isinstance(triton.language.sum, InterpretedFunction)
    if on:
        _patch_language_once_per_launch()
        with interpret_env():
            mod = importlib.import_module(module)
            if not isinstance(getattr(mod, kernel), InterpretedFunction):
                importlib.reload(mod)
    if os.environ.get(CHILD) and not on:
        raise RuntimeError("TRITON_INTERPRET=1 was set, yet Triton did not load its interpreter")
    return on


def _patch_language_once_per_launch() -> None:
    """Triton 3.9's interpreter patches ``triton.language`` (``inspect.getmembers`` over the module
    and its tensor class) at every call of a ``@triton.jit`` function inside a kernel, its own
    ``tl.sum`` included, though the launch patched it already and Triton never undoes these inner
    patches: about 40% of the kernel tests' CPU time. Skip the inner patch where every
    ``triton.language`` module the function sees is patched already (it would set the same
    replacements again); Triton is left as it is where its interpreter is not built this way."""
    from triton.runtime import interpreter as interp

    cls, tl = interp.InterpretedFunction, interp.tl
    needs = ((cls, "rewrite"), (interp, "InterpreterError"), (tl.core, "is_builtin"))
    if getattr(cls, "_patched_once", False) or not all(hasattr(x, name) for x, name in needs):
        return
    call = cls.__call__

    def __call__(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
        if not langs or any(tl.core.is_builtin(lang.load) for lang in langs):
            return call(self, *args, **kwargs)
        try:            # what ``call`` does after its patch
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    cls.__call__, cls._patched_once = __call__, True


KERNEL_MODULES = {"_triton": "_add_norm_fwd", "_triton_sinkhorn": "_sinkhorn_fwd",
                  "_triton_mix": "_mix_write_fwd", "_triton_mix_entry": "_mix_entry_fwd",
                  "_triton_rms_project": "_rms_project_fwd", "_triton_depth_mix": "_depth_mix_fwd"}


def every_kernel_module_interpreted() -> bool:
    """:func:`interpreted` for each of siamesenorm's kernel modules (a test file using them all)."""
    return all(interpreted(f"siamesenorm.kernels.{m}", kernel) for m, kernel in KERNEL_MODULES.items())


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """TRITON_INTERPRET=1 around each test without CUDA (import it into a kernel test module); and
    each test ends with every op on: a first-use check that failed would send the rest of the
    process down the PyTorch path, whose tests would prove nothing about the kernels (a test that
    breaks a kernel on purpose turns it back on itself)."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    from siamesenorm.kernels import guard
    off = {name: op.off_reason for name, op in guard.kernel_ops().items() if not op.on}
    for name in off:
        guard.kernel_ops()[name].reset()
    assert not off, f"kernels turned off: {off}"


def without_first_use_checks(monkeypatch) -> None:
    """No first-use checks in this test (which counts the kernels' launches)."""
    from siamesenorm.kernels import guard
    monkeypatch.setattr(guard.KernelOp, "check", lambda *args: None)


FRESH = "test_in_fresh_process"


def fresh_process_test(path: str) -> Callable[..., None]:
    def test_in_fresh_process(request):
        """This file (and the other kernel test files collected, see :func:`one_fresh_process`) in
        one process that sets TRITON_INTERPRET=1 before anything imports Triton."""
        paths = getattr(request.node, "kernel_files", [path])
        env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
        # -n 0: one process; the suite's other workers keep the other cores busy meanwhile.
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                              *paths], env=env, capture_output=True, text=True, timeout=600)
        failed = [line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        assert run.returncode == 0, "\n".join([*failed, run.stdout[-6000:], run.stderr[-2000:]])
    return test_in_fresh_process


def one_fresh_process(items: list[pytest.Item]) -> None:
    """Of the tests made by :func:`fresh_process_test` keep one, the first of the run, that runs the
    files of all of them: one interpreter start-up and collection for every kernel test file, and the
    longest test of the suite starts at once, not last on a worker (tests/conftest.py calls this)."""
    fresh = [item for item in items if item.name == FRESH]
    if fresh:
        fresh[0].kernel_files = [str(item.path) for item in fresh]
        items[:] = [fresh[0], *(item for item in items if item.name != FRESH)]


def collect(namespace: dict, in_process: bool) -> None:
    """Keep the tests that can run here: the module's own, or the one that reruns it."""
    for name in [n for n in namespace if n.startswith("test_")]:
        if (name == FRESH) == in_process:
            del namespace[name]


# ---- an mHC language model for the kernels' model-level tests -----------------------------------------
def mhc_lm(norm: str = "rmsnorm", **options) -> torch.nn.Module:
    """A 2-layer mHC language model (width 16) on :data:`DEVICE` with the scheme's ``options``,
    its scheme's parameters moved far from their near-identity init (so the per-token maps vary)."""
    from siamesenorm.models import LanguageModel, LMConfig

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, scheme="mhc",
                   scheme_options=options, norm=norm)
    model = LanguageModel(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("scheme."):
                p.add_(0.3 * torch.randn_like(p))
    return model


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor, path: str) -> list[torch.Tensor]:
    """The loss on tokens ``x`` and the parameters' gradients, on the ``"lean"`` path (with the
    kernels where they run) or the ``"reference"`` path (no kernels), or ``"compiled"`` (one graph,
    ``aot_eager``)."""
    from siamesenorm.compute import use_path

    step = model
    if path == "compiled":
        torch._dynamo.reset()
        step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with use_path("reference" if path == "reference" else "kernels"):
        loss = step(x[:, :-1], x[:, 1:]).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return [loss, *(g for g in grads if g is not None)]


def compiles_to_one_call_each(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor], ops: list,
                              params: list[torch.Tensor] = ()) -> None:
    """``f(*inputs)`` (a scalar) compiled as one graph (``aot_eager``) equals eager in value and in
    the gradients of ``inputs`` and ``params``, and its graphs call each op of ``ops`` once."""
    graphs = []

    def backend(gm, example):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example)

    wrt = [*inputs, *params]
    want = f(*inputs)
    want_grads = torch.autograd.grad(want, wrt)
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(*inputs)
    got_grads = torch.autograd.grad(got, wrt)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
    calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    for op in ops:
        assert sum(t in (op, op.default) for t in calls) == 1, op
