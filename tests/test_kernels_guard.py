"""A kernel never ends a run nor changes a result (siamesenorm.kernels.guard): each fused op checks
its kernels against the PyTorch path on first use, and a kernel that cannot launch (driver,
compile, ptxas, resources) or computes a wrong value or gradient turns its op off with one line,
the run going on by the PyTorch path. The failures are simulated on the launchers, under Triton's
interpreter on the CPU (tests/triton_interpreter.py).
"""

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from triton_interpreter import (
    CUDA,
    DEVICE,
    collect,
    every_kernel_module_interpreted,
    fresh_process_test,
    import_triton,
    interpreter,  # noqa: F401  (the autouse fixture)
)

triton = import_triton()

from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

from siamesenorm import kernels  # noqa: E402
from siamesenorm.kernels import availability, guard  # noqa: E402

IN_PROCESS = CUDA or every_kernel_module_interpreted()
test_in_fresh_process = fresh_process_test(__file__)


def rand(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE).requires_grad_()


# Each op: its kernel module and launchers, and a call of its front function on fresh inputs
# (inputs needing gradients, then a function of them giving the outputs).
def _add_norm(gen):
    h, z, w = rand(gen, 3, 5, 40), rand(gen, 3, 5, 40), rand(gen, 40)
    return [h, z, w], lambda: kernels.add_norm(h, z, w)


def _update_entry(gen):
    x, y, o, w = rand(gen, 2, 7, 40), rand(gen, 2, 7, 40), rand(gen, 2, 7, 40), rand(gen, 40)
    return [x, y, o, w], lambda: kernels.siamese_update_entry(x, y, o, 0.5, x_weight=w, y_weight=w,
                                                              in_weight=w)


def _sinkhorn(gen):
    logits = rand(gen, 6, 4, 4)
    return [logits], lambda: [kernels.sinkhorn(logits, 10)]


def _mix_write(gen):
    res, h, post, out = rand(gen, 2, 3, 4, 4), rand(gen, 2, 3, 4, 24), rand(gen, 2, 3, 4), rand(gen, 2, 3, 24)
    return [res, h, post, out], lambda: [kernels.mix_write(res, h, post, out)]


def _mix_entry(gen):
    h, pre, w = rand(gen, 2, 3, 4, 24), rand(gen, 2, 3, 4), rand(gen, 24)
    return [h, pre, w], lambda: [kernels.mix_entry(h, pre, w)]


def _rms_project(gen):
    x, w = rand(gen, 6, 40), rand(gen, 40, 12)
    return [x, w], lambda: [kernels.rms_project(x, w, 1e-6)]


def _depth_mix(gen):
    v, u, w = [rand(gen, 2, 5, 24) for _ in range(3)], rand(gen, 24), rand(gen, 24)
    return [*v, u, w], lambda: [kernels.fused_depth_mix(tuple(v), u, w, kind="rmsnorm")]


OPS = {   # op: (module, forward launcher, backward launcher, call)
    "add_norm": ("_triton", "add_norm_forward", "add_norm_backward", _add_norm),
    "update_entry": ("_triton", "entry_forward", "entry_backward", _update_entry),
    "sinkhorn": ("_triton_sinkhorn", "sinkhorn_forward", "sinkhorn_backward", _sinkhorn),
    "mix_write": ("_triton_mix", "mix_write_forward", "mix_write_backward", _mix_write),
    "mix_entry": ("_triton_mix_entry", "mix_entry_forward", "mix_entry_backward", _mix_entry),
    "rms_project": ("_triton_rms_project", "rms_project_forward", "rms_project_backward", _rms_project),
    "depth_mix": ("_triton_depth_mix", "depth_mix_forward", "depth_mix_backward", _depth_mix),
}
FAILURES = {   # what a user's node can raise at a launch
    "driver": lambda: RuntimeError("0 active drivers ([]). There should only be one."),
    "ptxas": lambda: PTXASError("ptxas fatal   : (C7600) Register allocation failed with register count 255"),
    "resources": lambda: OutOfResources(262144, 232448, "shared memory"),
    "instruction": lambda: RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered"),
    "import": lambda: ImportError("libcuda.so.1: cannot open shared object file"),
}


def outputs_and_grads(op: str) -> list[torch.Tensor]:
    """The op's outputs and the gradients of its inputs under a fixed upstream gradient."""
    gen = torch.Generator().manual_seed(3)
    inputs, call = OPS[op][3](gen)
    outputs = [t for t in call() if t is not None]
    loss = sum((t.float() * torch.linspace(-1, 1, t.numel(), device=t.device).view(t.shape)).sum()
               for t in outputs)
    return [t.detach() for t in outputs] + list(torch.autograd.grad(loss, inputs))


def plain(op: str, monkeypatch) -> list[torch.Tensor]:
    """The same through the PyTorch path (kernels switched off)."""
    with monkeypatch.context() as m:
        m.setenv("SIAMESENORM_PATH", "lean")
        return outputs_and_grads(op)


def assert_equal_results(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def ops():
    """The ops' guards, every one on again (and unchecked) after the test."""
    everything = guard.kernel_ops()
    for op in everything.values():
        op.reset()
    yield everything
    for op in everything.values():
        op.reset()


def patch_launcher(monkeypatch, op: str, which: int, wrap) -> list[int]:
    """Replace the op's forward (``which`` 1) or backward (2) launcher by ``wrap(real)``; returns a
    list that counts the launcher's calls."""
    module = importlib.import_module(f"siamesenorm.kernels.{OPS[op][0]}")
    real, calls = getattr(module, OPS[op][which]), []

    def launcher(*args, **kwargs):
        calls.append(1)
        return wrap(real)(*args, **kwargs)
    monkeypatch.setattr(module, OPS[op][which], launcher)
    return calls


def raising(error):
    def wrap(real):
        def launch(*args, **kwargs):
            raise error()
        return launch
    return wrap


def wrong(real):
    """The launcher's result with its first non-empty tensor scaled by 1.5: a kernel that runs and
    is wrong."""
    def launch(*args, **kwargs):
        out = real(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out * 1.5
        kind, out = type(out), list(out)
        i = next(k for k, t in enumerate(out) if t.numel())
        out[i] = out[i] * 1.5
        return kind(out)
    return launch


def one_notice(err: str, op: str, reason: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    version = re.escape(availability.triton_version())
    assert re.fullmatch(rf"siamesenorm: the {op} kernel is off for this run \(Triton {version}, torch "
                        rf"{re.escape(torch.__version__)}\): .*{reason}.*; running the PyTorch path instead "
                        rf"\(SIAMESENORM_PATH=lean silences this\)", lines[0]), lines[0]


# ---- a launch that raises -----------------------------------------------------------------------------
@pytest.mark.parametrize("op, failure", [(op, list(FAILURES)[i % len(FAILURES)]) for i, op in enumerate(OPS)]
                         + [("add_norm", f) for f in FAILURES if f != "driver"])
def test_a_kernel_that_cannot_launch_turns_its_op_off_with_one_line(op, failure, ops, monkeypatch, capsys):
    """The first use checks the kernel, which raises: the op is off for the process, said in one
    line (the op, Triton's and torch's versions, the reason, how to silence it), and this call and
    the next give the PyTorch path's values and gradients; the kernel is not tried again."""
    want = plain(op, monkeypatch)
    calls = patch_launcher(monkeypatch, op, 1, raising(FAILURES[failure]))
    got = outputs_and_grads(op)
    tried = len(calls)
    reason = f"its first-use check failed: {type(FAILURES[failure]()).__name__}"
    one_notice(capsys.readouterr().err, op, reason)
    assert_equal_results(got, want)
    assert not ops[op].on and all(other.on for name, other in ops.items() if name != op)
    assert_equal_results(outputs_and_grads(op), want)
    assert capsys.readouterr().err == ""                # said once
    assert len(calls) == tried                          # and not tried again


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("which", [1, 2], ids=["forward", "backward"])
def test_a_kernel_that_computes_a_wrong_value_is_caught_by_its_check(op, which, ops, monkeypatch, capsys):
    """A kernel that runs and is wrong, forward or backward, fails the first-use check: the op is
    off and the results are the PyTorch path's, never the wrong ones."""
    want = plain(op, monkeypatch)
    patch_launcher(monkeypatch, op, which, wrong)
    got = outputs_and_grads(op)
    one_notice(capsys.readouterr().err, op, "KernelMismatch: " + ("output" if which == 1 else "gradient"))
    assert_equal_results(got, want)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("which", [1, 2], ids=["forward", "backward"])
def test_a_launch_that_fails_after_the_check_falls_back_at_once(op, which, ops, monkeypatch, capsys):
    """A launch that raises only after the check passed (a later launch, of more rows): forward
    or backward, that call computes the PyTorch path (backward: the reference forward
    differentiated in the op) and the op goes off."""
    want = plain(op, monkeypatch)

    def later_ones_fail(real):
        def launch(*args, **kwargs):
            if len(calls) > 1:                  # the first is the check's
                raise OutOfResources(262144, 232448, "shared memory")
            return real(*args, **kwargs)
        return launch
    calls = patch_launcher(monkeypatch, op, which, later_ones_fail)
    got = outputs_and_grads(op)
    one_notice(capsys.readouterr().err, op, "a launch failed: OutOfResources")
    assert_equal_results(got, want)


def test_inside_a_compiled_graph_the_op_falls_back_where_it_runs(ops, monkeypatch, capsys):
    """The choice is made where the op runs, so a graph compiled with the kernel (one graph, no
    break) gives the PyTorch path's values and gradients when its kernel fails at run time."""
    want = plain("update_entry", monkeypatch)
    patch_launcher(monkeypatch, "update_entry", 1, raising(FAILURES["ptxas"]))
    gen = torch.Generator().manual_seed(3)
    inputs, call = _update_entry(gen)
    torch._dynamo.reset()
    outputs = torch.compile(lambda *a: call(), backend="aot_eager", fullgraph=True)(*inputs)
    loss = sum((t.float() * torch.linspace(-1, 1, t.numel(), device=t.device).view(t.shape)).sum()
               for t in outputs if t is not None)
    got = [t.detach() for t in outputs if t is not None] + list(torch.autograd.grad(loss, inputs))
    assert_equal_results(got, want)
    one_notice(capsys.readouterr().err, "update_entry", "PTXASError")


def test_out_of_memory_is_raised_not_hidden(ops, monkeypatch):
    """Out of memory is the user's to see (the PyTorch path would need the memory too); the op
    stays on."""
    out_of_memory = raising(lambda: torch.OutOfMemoryError("CUDA out of memory"))
    patch_launcher(monkeypatch, "add_norm", 1, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        outputs_and_grads("add_norm")
    assert ops["add_norm"].on


def test_the_check_costs_one_small_launch_each_way_once_per_configuration(ops, monkeypatch):
    """A new configuration's first call launches the kernels once each way on 4 rows for the
    check, then the call's own launch; a second call, or the same configuration with more rows,
    checks nothing again."""
    forward = patch_launcher(monkeypatch, "add_norm", 1, lambda real: real)
    backward = patch_launcher(monkeypatch, "add_norm", 2, lambda real: real)
    h = torch.randn(6, 40, device=DEVICE)
    kernels.add_norm(h, h, torch.ones(40, device=DEVICE))
    assert (len(forward), len(backward)) == (2, 1)
    kernels.add_norm(h[:5], h[:5], torch.ones(40, device=DEVICE))
    assert (len(forward), len(backward)) == (3, 1)
    kernels.add_norm(h[:, :33], h[:, :33], None)       # another width, no weight: checked once more
    assert (len(forward), len(backward)) == (5, 2)


def test_self_check_reports_every_op_and_keeps_their_state(ops, monkeypatch):
    """``self_check`` runs every op's check on the device for each dtype and reports it, a broken
    kernel as failed with its reason, without turning anything off."""
    patch_launcher(monkeypatch, "sinkhorn", 1, wrong)
    report = kernels.self_check(DEVICE, (torch.float32, torch.bfloat16))
    assert sorted({r.op for r in report}) == sorted(OPS)
    assert len(report) == 2 * len(OPS)
    for r in report:
        assert r.ok == (r.op != "sinkhorn"), r
        assert (r.reason == "") == r.ok and r.seconds > 0
        if r.ok:
            assert 0 <= r.max_error <= (1e-3 if r.dtype == torch.float32 else 5e-2)
        else:
            assert r.reason.startswith("KernelMismatch: output 0 differs")
    assert all(op.on for op in ops.values())


def test_turned_off_and_switched_off_say_nothing(ops, monkeypatch, capsys):
    """With SIAMESENORM_PATH=lean nothing is said when an op goes off."""
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    ops["mix_entry"].turn_off("a test")
    assert capsys.readouterr().err == "" and not ops["mix_entry"].on


# ---- the Triton versions the kernels are tested with -----------------------------------------------------
def test_triton_versions_in_the_supported_range():
    low, high = availability.TRITON_RANGE
    assert low <= (3, 6) and high >= (3, 9)
    for version in ("3.6.0", "3.7.1", "3.9.0", "3.9.0+git1234abcd"):
        assert availability.triton_supported(version), version
    for version in ("3.5.1", "3.0.0", "2.3.1", "3.10.0", "4.0.0", "", "nightly"):
        assert not availability.triton_supported(version), version
    assert availability.triton_supported()            # what CI runs the kernel tests with


def test_a_triton_outside_the_range_takes_the_pytorch_path_said_once():
    """An installed Triton outside the range runs no kernel, and says why once, naming the range."""
    code = textwrap.dedent("""
        import torch
        from siamesenorm.kernels import add_norm, availability, kernels_available
        availability._VERSION = "3.2.0"
        x = torch.randn(3, 8)
        assert not kernels_available(x)
        for _ in range(2):
            add_norm(x, x)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    low, high = availability.TRITON_RANGE
    assert run.stderr.splitlines() == [
        f"siamesenorm: fused Triton kernels are tested with Triton {low[0]}.{low[1]} to {high[0]}.{high[1]}, "
        "not 3.2.0; running the PyTorch path"]


collect(globals(), IN_PROCESS)
