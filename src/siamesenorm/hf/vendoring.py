"""The modelling file of a model folder, ``modeling_siamesenorm.py``: the package's modules the model
needs, vendored as strings, then the classes ``auto_map`` names (docs/own_model.md)."""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import sys
from pathlib import Path

from .. import __version__

__all__ = ["NOT_VENDORED", "VENDOR_ALLOWED", "family_modeling_source", "modeling_source",
           "vendored_modules"]

# The third-party packages a vendored module may import at top level: torch, and what transformers
# itself depends on. Anything else must be imported where it is used.
VENDOR_ALLOWED = frozenset({"torch", "numpy", "yaml", "safetensors", "transformers"})
# Not vendored: the Triton kernels (the exported model runs the PyTorch path; its modules import
# them under ``try``; vendored, they would register our custom ops a second time in a process that
# has siamesenorm too), and this module (a vendored module imports it only where it generates the
# code, which a folder's copy never does).
NOT_VENDORED = (("kernels",), ("hf", "vendoring"))


# ---- the modelling file ------------------------------------------------------------------------
def vendored_modules(root: str = "hf.modeling") -> dict[str, str]:
    """The package files ``root`` needs (path -> source): the closure of its relative imports, but for
    :data:`NOT_VENDORED`. A top-level import outside :data:`VENDOR_ALLOWED` is a ``RuntimeError``."""
    package = Path(__file__).resolve().parents[1]
    files: dict[str, str] = {}
    todo = [tuple(root.split("."))]
    while todo:
        parts = todo.pop()
        if any(parts[:len(skip)] == skip for skip in NOT_VENDORED):
            continue
        for k in range(len(parts) + 1):            # the module and every package above it
            path = _module_file(package, parts[:k])
            if path is None or path in files:
                continue
            if path in _STAND_INS:
                files[path] = _STAND_INS[path]
                continue
            is_pkg = path.endswith("__init__.py")
            source = (package / path).read_text(encoding="utf-8")
            files[path] = source
            todo += _relative_imports(source, parts[:k] if is_pkg else parts[:k - 1], package)
            _check_third_party(path, source)
    return dict(sorted(files.items()))


# Modules vendored as these texts in place of their own.
_STAND_INS = {"hf/__init__.py": '"""siamesenorm.hf as exported: the modelling code alone, registered '
                                'with no Auto class."""\n'}


def _module_file(package: Path, parts: tuple[str, ...]) -> str | None:
    base = "/".join(parts)
    for candidate in (f"{base}/__init__.py" if base else "__init__.py", f"{base}.py"):
        if (package / candidate).is_file():
            return candidate
    return None


def _relative_imports(source: str, pkg: tuple[str, ...], package: Path) -> list[tuple[str, ...]]:
    """The modules (as parts) that the relative imports of ``source`` name, from the package ``pkg``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)] + (tuple(node.module.split(".")) if node.module else ())
            found.append(base)
            found += [base + (a.name,) for a in node.names if _module_file(package, base + (a.name,))]
    return found


def _check_third_party(path: str, source: str) -> None:
    for node in ast.parse(source).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in VENDOR_ALLOWED:
                raise RuntimeError(f"{path} imports {name} at top level: the exported modelling code "
                                   f"may import only the standard library and {sorted(VENDOR_ALLOWED)}")


def modeling_source(date: datetime.date | None = None, *, root: str = "hf.modeling",
                    tail: str | None = None, classes: tuple[str, str] | None = None,
                    made_by: str = "`siamesenorm export --format hf`") -> str:
    """The text of ``modeling_siamesenorm.py``, dated ``date``: the modules ``root`` needs, then
    ``tail`` (default: our model's classes), whose ``classes`` the header names."""
    if tail is None:
        classes = ("SiameseNormConfig", "SiameseNormForCausalLM")
        defined = "siamesenorm/hf/modeling.py defines the two classes"
    else:
        defined = f"siamesenorm/{root.replace('.', '/')}.py builds the two classes"
    files = vendored_modules(root)
    blob = json.dumps(files, sort_keys=True).encode("utf-8")
    package = "_siamesenorm_export_" + hashlib.sha256(blob).hexdigest()[:12]
    sources = "\n".join(f"_SOURCES[{path!r}] = {_literal(source)}\n" for path, source in files.items())
    listing = "\n".join(f"    siamesenorm/{path}" for path in files)
    text = _MODELING_TEMPLATE.format(version=__version__, date=(date or datetime.date.today()).isoformat(),
                                     n=len(files), listing=listing, package=package, sources=sources,
                                     made_by=made_by, classes=" and ".join(classes), defined=defined)
    return text if tail is None else text[:text.index(_OWN_TAIL)] + tail


def _literal(source: str) -> str:
    """``source`` as a string literal, each line behind a ``|`` (transformers scans a remote file's
    import lines); ``_source`` in the generated file undoes it."""
    text = "\n|" + source.replace("\n", "\n|")
    quotes = "'" * 3
    if quotes not in text and not text.endswith(("\\", "'")) and "\r" not in text:
        return "r" + quotes + text + quotes
    return repr(text)


# The generated file. ``{...}`` are filled by :func:`modeling_source`; ``{{`` and ``}}`` are braces.
_MODELING_TEMPLATE = '''\
"""Generated by {made_by} (siamesenorm {version}, {date}). Do not edit.

The modelling code of this model folder, for transformers' trust_remote_code=True: config.json's
auto_map names {classes}, defined at the end of this file.

It contains the source of the {n} modules of the siamesenorm package that the model needs (listed
below; {defined}), as they are, in _SOURCES (path ->
source) below, so that what trust_remote_code runs can be read here; each of their lines starts with
a "|", which _source() removes (transformers reads a remote file's import lines, and would take
theirs for this file's own). Importing this file installs an
importer that serves those modules from memory as the package {package} (a private name: an
installed siamesenorm is never touched).
Besides the standard library they need torch and transformers (and numpy, PyYAML and safetensors,
which transformers brings). Tracebacks name the vendored files as modeling_siamesenorm.py/<path>.

Modules:
{listing}
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import torch  # noqa: F401  (checked by transformers before this file runs)
import transformers  # noqa: F401

_PACKAGE = "{package}"
_SOURCES = {{}}

# ---- the vendored modules, path -> source (the code of siamesenorm {version}) ----
{sources}
# ---- end of the vendored modules ----


class _VendoredPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the modules of one package from a dict ``path -> source`` in memory."""

    def __init__(self, package, files):
        self.package, self.files = package, files

    def _path(self, fullname):
        if fullname == self.package:
            return "__init__.py"
        if not fullname.startswith(self.package + "."):
            return None
        base = fullname[len(self.package) + 1:].replace(".", "/")
        for path in (base + "/__init__.py", base + ".py"):
            if path in self.files:
                return path
        return None

    def find_spec(self, fullname, path=None, target=None):
        found = self._path(fullname)
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self._origin(found),
                                               is_package=found.endswith("__init__.py"))

    def _origin(self, path):
        return __file__ + "/" + path

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        path = self._path(module.__name__)
        module.__file__ = self._origin(path)
        code = compile(self.files[path], module.__file__, "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_source(self, fullname):
        path = self._path(fullname)
        return None if path is None else self.files[path]


def _install():
    """The package's importer, installed once per process (this file may be executed again)."""
    for finder in sys.meta_path:
        if isinstance(getattr(finder, "package", None), str) and finder.package == _PACKAGE:
            return
    files = {{path: _source(text) for path, text in _SOURCES.items()}}
    sys.meta_path.insert(0, _VendoredPackage(_PACKAGE, files))


def _source(text):
    """A vendored module's source from its entry in _SOURCES (a newline, then each line behind "|")."""
    return text[2:].replace("\\n|", "\\n")


_install()
# ---- the classes ----
_modeling = importlib.import_module(_PACKAGE + ".hf.modeling")


class SiameseNormConfig(_modeling.SiameseNormConfig):
    """The configuration of a siamesenorm language model (siamesenorm.hf.SiameseNormConfig)."""

    model_type = _modeling.MODEL_TYPE

    def __init__(self, **kwargs):       # its own __init__: transformers keeps it (not a dataclass's)
        super().__init__(**kwargs)


class SiameseNormForCausalLM(_modeling.SiameseNormForCausalLM):
    """A siamesenorm language model, any scheme (siamesenorm.hf.SiameseNormForCausalLM)."""

    config_class = SiameseNormConfig
'''


# Where the generated file's class definitions start (a family run's file replaces them).
_OWN_TAIL = '_modeling = importlib.import_module(_PACKAGE + ".hf.modeling")'

def family_modeling_source(family: str, model_class: str, config_class: str,
                           date: datetime.date | None = None) -> str:
    """The ``modeling_siamesenorm.py`` of an adapted ``family``, with the adapted model's class names."""
    tail = _FAMILY_TAIL.format(family=family, name=model_class, config=config_class)
    return modeling_source(date, root="hf.adapted", tail=tail, classes=(config_class, model_class),
                           made_by="siamesenorm.hf, saving a model adapted to a residual scheme")


# The classes of an adapted model's file: the family's scheme configuration and adapted causal LM
# (siamesenorm.hf.adapt), which builds the scheme that config.json's "siamesenorm" entry names.
# Defined here, so that transformers saves this file with a model it loaded from it.
_FAMILY_TAIL = '''_adapted = importlib.import_module(_PACKAGE + ".hf.adapted")
_standalone = importlib.import_module(_PACKAGE + ".hf.standalone")


class {config}(_standalone.scheme_config_class("{family}")):
    """transformers' {family} configuration under the model type siamesenorm_{family}: its
    "siamesenorm" entry names the residual scheme."""


class {name}(_adapted.adapted_class("{family}")):
    """transformers' {family} causal LM with the residual scheme config.json's "siamesenorm"
    entry names (siamesenorm.hf.adapt)."""

    config_class = {config}
    _modeling_file = __file__       # save_pretrained copies this file
'''
