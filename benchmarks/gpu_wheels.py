"""Wheels for a lent GPU machine that has no network: what ``benchmarks/gpu.py`` needs and its image lacks.

Run here (a machine that reaches PyPI), from the repository root, with the project's venv::

    .venv/bin/python benchmarks/gpu_wheels.py          # -> .whl/ (git-ignored), then carry .whl

It downloads, for CPython 3.12 on manylinux x86_64 (the GPU image's Python), the wheel of
``ai2-olmo-core`` at the version this venv has, and of every package in the requirement closure of
it and of siamesenorm's own dependencies that the GPU image does not already have (``ON_IMAGE``).
The closure is read from each wheel's METADATA ``Requires-Dist``, with the markers evaluated for
Linux x86_64 and Python 3.12 (``extra == ...`` lines never apply). One version per package: the one
this venv has where it fits every requirement on it, else the newest that does. Wheels in ``.whl``
that still fit are kept (a rerun downloads nothing), and the rest are removed, since two versions of
one package stop ``pip install .whl/*.whl``. It ends by checking the folder from its files alone
(every requirement met by a wheel there or left to the image) and prints the total size, which
travels with the working tree (64 MiB in all).

``benchmarks/gpu_session.sh`` installs the folder on the GPU machine.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
LIMIT = 64 * MiB                    # what travels to the device machine, working tree included

# The GPU image's Python packages ('cuda' image, nvidia-h200), as listed in
# /work/.library/device/KINDS.md ("Python packages already there"), read from a machine on
# 2026-11-17; this list was copied from it on 2026-11-29.
IMAGE_READ = "2026-11-17"
ON_IMAGE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# Versions seen there (KINDS.md's 'pip list, as a session saw it', 2026-11): requirements on these
# are checked; on the image's other packages they are only listed.
IMAGE_VERSIONS = {canonicalize_name(k): v for k, v in {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
    "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
    "onnx": "1.23.1", "jax": "0.11.2", "torchmetrics": "1.9.0", "pytorch-lightning": "2.6.6",
}.items()}

# Markers are evaluated for the image's interpreter: CPython 3.12.3 on Linux x86_64.
TARGET = {"implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
          "platform_machine": "x86_64", "platform_python_implementation": "CPython",
          "platform_release": "", "platform_system": "Linux", "platform_version": "",
          "python_full_version": "3.12.3", "python_version": "3.12", "sys_platform": "linux"}
# glibc 2.28 is known to be there (the image's torch wheels need it): wheels for it are tried first,
# then those for up to 2.39 (Ubuntu 24.04's, whose Python 3.12.3 the image has; not checked there)
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(28, 16, -1)]
             + ["manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
                "manylinux_2_5_x86_64", "manylinux1_x86_64"])
NEWER_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 28, -1)]


def pip_target(platforms: list[str]) -> list[str]:
    return ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for p in platforms for a in ("--platform", p)]]


@dataclass(frozen=True)
class Dist:
    """One wheel: its project, version and ``Requires-Dist`` lines."""
    name: str                       # canonical
    version: str
    requires: tuple[str, ...]
    path: Path | None = None


@dataclass
class Wanted:
    """What the closure asks of one project: the specifiers together, who asks, which extras."""
    spec: SpecifierSet = field(default_factory=SpecifierSet)
    by: set[str] = field(default_factory=set)
    extras: set[str] = field(default_factory=set)


# ---- the closure (pure: the fetch function is given) ------------------------------------------------
def applies(req: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether ``req`` is needed on the target: its marker holds for Linux x86_64, Python 3.12, and
    no extra (or one of ``extras``, those the requirer was asked for with)."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": extra}) for extra in ("", *extras))


def fits(version: str, spec: SpecifierSet) -> bool:
    return spec.contains(Version(version), prereleases=True)


def wanted(roots: list[Requirement], chosen: dict[str, Dist]) -> dict[str, Wanted]:
    """Every project reachable from ``roots`` through the chosen dists' requirements (an image
    package is reached but not followed), with what is asked of it."""
    out: dict[str, Wanted] = {}
    queue = [("(root)", r, ()) for r in roots]
    expanded: dict[str, frozenset[str]] = {}
    while queue:
        by, req, by_extras = queue.pop(0)
        if not applies(req, by_extras):
            continue
        name = canonicalize_name(req.name)
        w = out.setdefault(name, Wanted())
        w.spec &= req.specifier
        w.by.add(by)
        w.extras |= set(req.extras)
        dist = chosen.get(name)
        if name in ON_IMAGE or dist is None or expanded.get(name) == frozenset(w.extras):
            continue
        expanded[name] = frozenset(w.extras)
        queue += [(name, Requirement(line), tuple(w.extras)) for line in dist.requires]
    return out


Fetch = Callable[[str, SpecifierSet, "str | None"], Dist]


def closure(roots: list[Requirement], fetch: Fetch, prefer: Callable[[str], str | None] = lambda name: None
            ) -> tuple[dict[str, Dist], dict[str, Wanted]]:
    """The dists to carry (name -> Dist) and what is asked of every project reached, the image's too.

    ``fetch(name, spec, pin)`` returns the wheel of ``name`` at ``pin`` (when given) or at the newest
    version in ``spec``. ``prefer(name)`` is the version to pin where it fits (this venv's). Run to a
    fixed point: a project is fetched again when a requirement found later rules its version out, or
    when one that kept its preferred version out has gone."""
    chosen: dict[str, Dist] = {}

    def pin(name: str, spec: SpecifierSet) -> str | None:
        version = prefer(name)
        return version if version is not None and fits(version, spec) else None

    for _ in range(50):
        asked = wanted(roots, chosen)
        todo = [n for n, w in asked.items() if n not in ON_IMAGE and (
            n not in chosen or not fits(chosen[n].version, w.spec)
            or pin(n, w.spec) not in (None, chosen[n].version))]
        if not todo:
            carried = {n: d for n, d in chosen.items() if n in asked}
            return carried, asked
        for name in todo:
            chosen[name] = fetch(name, asked[name].spec, pin(name, asked[name].spec))
    raise RuntimeError("the requirement closure did not settle in 50 rounds")


def problems(carried: dict[str, Dist], asked: dict[str, Wanted]) -> list[str]:
    """What would keep the carried wheels from installing or importing on the image: a requirement
    no carried version meets, a known image version a requirement rules out, two wheels of one project."""
    out = []
    for name, w in sorted(asked.items()):
        if name in carried:
            if not fits(carried[name].version, w.spec):
                out.append(f"{name} {carried[name].version} does not meet {w.spec} "
                           f"(asked by {', '.join(sorted(w.by))})")
        elif name in ON_IMAGE:
            have = IMAGE_VERSIONS.get(name)
            if have is not None and not fits(have, w.spec):
                out.append(f"the image's {name} {have} does not meet {w.spec} "
                           f"(asked by {', '.join(sorted(w.by))})")
        else:
            out.append(f"{name} is neither carried nor on the image (asked by {', '.join(sorted(w.by))})")
    return out


# ---- wheels on disk ---------------------------------------------------------------------------------
def read_wheel(path: Path) -> Dist:
    """A wheel's name, version and ``Requires-Dist`` lines, from its METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            raise ValueError(f"{path.name}: no single .dist-info/METADATA")
        msg = email.parser.HeaderParser().parsestr(z.read(meta[0]).decode("utf-8"))
    requires = tuple(msg.get_all("Requires-Dist") or ())
    return Dist(canonicalize_name(msg["Name"]), msg["Version"], requires, path)


def wheels_in(folder: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.whl")):
        out.setdefault(canonicalize_name(parse_wheel_filename(path.name)[0]), []).append(path)
    return out


def folder_problems(folder: Path, roots: list[Requirement]) -> list[str]:
    """The folder checked from its files alone: one wheel per project, and ``roots``' closure met
    by its wheels and the image."""
    found = wheels_in(folder)
    out = [f"{name}: {len(paths)} wheels ({', '.join(p.name for p in paths)})"
           for name, paths in found.items() if len(paths) > 1]
    dists = {name: read_wheel(paths[0]) for name, paths in found.items()}
    asked = wanted(roots, dists)
    out += problems({n: d for n, d in dists.items() if n in asked}, asked)
    out += [f"{name}: carried but needed by nothing" for name in dists if name not in asked]
    return out


def image_report(folder: Path, version: Callable[[str], str | None]) -> list[str]:
    """On the GPU machine: what the folder's wheels ask of the image's packages, beside the
    versions there (``version(name)``), one line each; a line starting ``MISMATCH`` where one is
    missing or out of range (the import may still work: pip does not check with ``--no-deps``)."""
    dists = {name: read_wheel(paths[0]) for name, paths in wheels_in(folder).items()}
    asked = wanted([Requirement(f"{n}=={d.version}") for n, d in dists.items()], dists)
    out = []
    for name, w in sorted(asked.items()):
        if name in dists:
            continue
        have = version(name)
        ok = have is not None and fits(have, w.spec)
        out.append(f"{'' if ok else 'MISMATCH '}{name} {have or '(not installed)'}: asked {w.spec or 'any'} "
                   f"by {', '.join(sorted(w.by))}")
    return out


class Downloader:
    """``fetch`` for :func:`closure`: a wheel already in ``dest`` that fits, else ``pip download``."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.downloaded: list[str] = []

    def __call__(self, name: str, spec: SpecifierSet, pin: str | None) -> Dist:
        for path in wheels_in(self.dest).get(name, []):
            version = str(parse_wheel_filename(path.name)[1])
            if (version == pin) if pin else fits(version, spec):
                return read_wheel(path)
        with tempfile.TemporaryDirectory() as tmp:
            target = f"{name}=={pin}" if pin else f"{name}{spec}"
            for platforms in (PLATFORMS, NEWER_PLATFORMS + PLATFORMS):
                cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_target(platforms),
                       "-d", tmp, target]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                got = list(Path(tmp).glob("*.whl"))
                if proc.returncode == 0 and len(got) == 1:
                    break
            if proc.returncode or len(got) != 1:
                tail = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise SystemExit(f"gpu_wheels: pip download {target} failed: {tail}\n"
                                 f"  (a project with no wheel for manylinux x86_64 and Python 3.12 "
                                 f"cannot travel this way)")
            for old in wheels_in(self.dest).get(name, []):
                old.unlink()
            path = self.dest / got[0].name
            shutil.move(str(got[0]), path)
        self.downloaded.append(path.name)
        return read_wheel(path)


def project_roots(pyproject: Path, olmo_core: str) -> list[Requirement]:
    """siamesenorm's dependencies and its ``kernels`` extra (what gpu.py imports), and ai2-olmo-core
    at ``olmo_core`` (the OLMo-core cases)."""
    import tomllib  # Python 3.11+, as this venv

    project = tomllib.loads(pyproject.read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["kernels"]
    return [Requirement(line) for line in lines] + [Requirement(f"ai2-olmo-core=={olmo_core}")]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_wheels.py", description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the folder (default: .whl)")
    p.add_argument("--olmo-core", default=installed("ai2-olmo-core"),
                   help="ai2-olmo-core's version (default: this venv's)")
    p.add_argument("--image-report", action="store_true",
                   help="on the GPU machine: print what the folder's wheels ask of the packages there")
    args = p.parse_args(argv)
    if args.image_report:
        for line in image_report(args.dest, installed):
            print(line)
        return 0
    if not args.olmo_core:
        print("gpu_wheels: ai2-olmo-core is not installed here: run with the project's venv "
              "or pass --olmo-core VERSION", file=sys.stderr)
        return 2
    args.dest.mkdir(exist_ok=True)
    roots = project_roots(ROOT / "pyproject.toml", args.olmo_core)
    fetch = Downloader(args.dest)
    carried, asked = closure(roots, fetch, prefer=installed)
    for name, paths in wheels_in(args.dest).items():
        for path in paths:
            if name not in carried or path != carried[name].path:
                path.unlink()                   # another version, or no longer needed
    print(f"wheels for CPython 3.12, manylinux x86_64, in {args.dest} "
          f"(the image's packages as read on {IMAGE_READ} are left out):")
    total = 0
    for name, dist in sorted(carried.items()):
        size = dist.path.stat().st_size
        total += size
        print(f"  {dist.path.name:70s} {size / MiB:7.2f} MiB  <- {', '.join(sorted(asked[name].by))}")
    image = sorted(n for n in asked if n in ON_IMAGE)
    print(f"left to the image ({len(image)}): " + ", ".join(
        f"{n}{asked[n].spec or ''}" + (f" (has {IMAGE_VERSIONS[n]})" if n in IMAGE_VERSIONS else "")
        for n in image))
    kept = len(carried) - len(fetch.downloaded)
    print(f"downloaded now: {len(fetch.downloaded)}; kept from before: {kept}")
    found = folder_problems(args.dest, roots)
    for line in found:
        print(f"PROBLEM: {line}", file=sys.stderr)
    print(f"{len(carried)} wheels, {total / MiB:.1f} MiB in all (the working tree and carried folders "
          f"travel within {LIMIT // MiB} MiB)")
    if total > LIMIT // 2:
        print("PROBLEM: over half of what may travel", file=sys.stderr)
        return 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
