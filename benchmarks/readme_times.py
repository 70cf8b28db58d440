"""The wall time of every command whose duration the README states, measured here, one after the
other, each into a fresh temporary folder; with the machine's load average before and after, since
other work on the machine stretches every figure (several-fold on a busy 2-core machine).

    python benchmarks/readme_times.py                  # every command (about half an hour)
    python benchmarks/readme_times.py --only tiny,default
    python benchmarks/readme_times.py --tests          # also the README's test command

Print the table in the README's words: ``--markdown``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (the command, as the README shows it, with {out} for its output folder; what it states)
COMMANDS = {
    "tiny": ("siamesenorm train tiny model.scheme=siamese train.lr=2e-3 --out {out}", "seconds"),
    "small": ("siamesenorm train small model.scheme=siamese --out {out}", "about 2 min"),
    "compare-tiny": ("siamesenorm compare tiny --schemes pre,post,siamese --lrs 1e-3,1e-2 "
                     "train.steps=300 --out {out}", "about half a minute"),
    "default": ("siamesenorm compare --out {out}", "about 5 minutes"),
    "vit-digits": ("siamesenorm compare vit-digits --out {out}", "~1 min"),
    "dit-digits": ("siamesenorm compare dit-digits --out {out}", "~1.5 min"),
    "qwen3-tiny": ("siamesenorm compare qwen3-tiny --out {out}", "about a minute"),
    "moe-tiny": ("siamesenorm compare moe-tiny --out {out}", "about a minute"),
}
TESTS = ("python -m pytest -q", "the test command")


def _load() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(COMMANDS), help="comma-separated names of COMMANDS")
    p.add_argument("--tests", action="store_true", help="also time the README's test command")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(COMMANDS))
    if unknown:
        p.error(f"unknown name(s) {', '.join(unknown)}; choose from {', '.join(COMMANDS)}")
    todo = [(n, *COMMANDS[n]) for n in names] + ([("tests", *TESTS)] if args.tests else [])
    rows = []
    print(f"{os.cpu_count()} CPUs; load average at the start {_load()}", file=sys.stderr)
    for name, command, stated in todo:
        with tempfile.TemporaryDirectory(prefix="readme-times-") as folder:
            argv = shlex.split(command.format(out=Path(folder) / "out"))
            cwd = Path(__file__).resolve().parents[1] if name == "tests" else folder
            before = _load()
            start = time.perf_counter()
            done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            took = time.perf_counter() - start
        rows.append((name, command.replace(" --out {out}", ""), stated, took, done.returncode,
                     before, _load()))
        print(f"{name}: {_duration(took)} (exit {done.returncode}; load {before} -> {_load()})",
              file=sys.stderr)
    if args.markdown:
        print("| command | the README said | measured | load average before -> after |")
        print("|---|---|---|---|")
        for _, command, stated, took, code, before, after in rows:
            failed = "" if code == 0 else f" (exit {code})"
            print(f"| `{command}` | {stated} | {_duration(took)}{failed} | {before} -> {after} |")
    else:
        for name, _, stated, took, code, _, _ in rows:
            print(f"{name:<12} {_duration(took):>9}   (README: {stated}; exit {code})")


if __name__ == "__main__":
    main()
