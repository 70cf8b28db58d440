"""`train` and `compare` on a loaded machine: auto threads against OMP_NUM_THREADS=1 and against the
thread count used before (issue 51). Not a test: it prints wall times and their ratios.

The benchmark starts its own CPU hogs (busy-loop processes) for the loaded phase and stops them
before the idle phase. Within a phase the variants run interleaved, round after round, so the
machine's drift falls on all of them alike; each figure is the median over the rounds. The 1-minute
load average is printed as each command starts: other work on the machine counts too.

    python benchmarks/threads.py                        # 2 hogs, 3 rounds, loaded then idle
    python benchmarks/threads.py --hogs 4 --rounds 5 --train-steps 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
# (name, extra arguments, OMP_NUM_THREADS or None): auto is this version's choice; "before" gives
# every command the cores as threads, the count it used before (one run at a time for compare's
# small grids, with torch's default of one thread per core)
VARIANTS = (("auto", (), None), ("omp1", (), "1"), ("before", ("--threads", str(os.cpu_count() or 1)), None))


def command(kind: str, out: Path, args: argparse.Namespace) -> list[str]:
    if kind == "train":
        return ["train", "tiny", f"train.steps={args.train_steps}", "--out", str(out)]
    return ["compare", "tiny", "--schemes", "pre,post,siamese", "--lrs", "1e-3,1e-2",
            f"train.steps={args.compare_steps}", "--out", str(out)]


def run_once(kind: str, variant: tuple, folder: Path, args: argparse.Namespace) -> tuple[float, float, str]:
    """One command: its wall time, the load average as it started, and the line that says its threads."""
    name, extra, omp = variant
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = folder / f"{kind}-{name}"
    load = os.getloadavg()[0]
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "siamesenorm", *command(kind, out, args), *extra],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0:
        raise SystemExit(f"{kind} {name} failed: {res.stderr.strip().splitlines()[-1:]}")
    said = next((x for x in (res.stderr + res.stdout).splitlines() if x.startswith("[train] threads:")
                 or (x.startswith("compare: ") and " thread" in x)), "")
    return wall, load, said


def phase(label: str, args: argparse.Namespace, folder: Path) -> dict:
    times: dict = {}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]   # rotated each round
        for kind in ("train", "compare"):
            for variant in order:
                wall, load, said = run_once(kind, variant, folder, args)
                times.setdefault((kind, variant[0]), []).append((wall, load, said))
                print(f"  {label} round {r + 1}: {kind:<7} {variant[0]:<6} {wall:6.1f} s  load {load:4.1f}  "
                      f"{said}", flush=True)
    return times


def report(label: str, times: dict) -> None:
    print(f"\n{label}: median wall time over the rounds, and its ratio to omp1's and to before's")
    for kind in ("train", "compare"):
        median = {name: statistics.median(w for w, _, _ in times[(kind, name)]) for name, _, _ in VARIANTS}
        for name, _, _ in VARIANTS:
            loads = [load for _, load, _ in times[(kind, name)]]
            print(f"  {kind:<7} {name:<6} {median[name]:6.1f} s  x{median[name] / median['omp1']:5.2f} omp1  "
                  f"x{median[name] / median['before']:5.2f} before  (load at start "
                  f"{min(loads):.1f}-{max(loads):.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hogs", type=int, default=2, help="busy-loop processes of the loaded phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--compare-steps", type=int, default=30)
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds for the 1-minute load average to follow the hogs (and their end)")
    p.add_argument("--skip-idle", action="store_true")
    args = p.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):     # the hogs stop however this ends
        signal.signal(sig, signal.default_int_handler)
    folder = Path(tempfile.mkdtemp(prefix="siamesenorm-threads-"))
    print(f"{os.cpu_count()} cores; load average now {os.getloadavg()[0]:.1f}; {args.hogs} hogs")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        time.sleep(args.settle)
        loaded = phase("loaded", args, folder)
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.wait()
    report(f"with {args.hogs} hogs", loaded)
    if not args.skip_idle:
        time.sleep(args.settle)
        idle = phase("no hogs", args, folder)
        report("no hogs", idle)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
