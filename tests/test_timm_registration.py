"""Our ViTs in timm's own scripts, tested without timm (it does not import beside this torch): a
stand-in for timm's registry and for the part of its train.py that creates the model, run as
docs/vision.md says: ``train.py --device-modules siamesenorm.models.timm_models`` and
``python -m siamesenorm.models.timm_models train.py ...``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import siamesenorm as sn
from siamesenorm.models import timm_models

# timm 1.0's registry as its scripts use it (timm/models/_registry.py, _factory.py): a name is
# registered once (timm warns on a second), create_model drops None keywords and passes the
# pretrained_cfg ones to the entry point.
STAND_IN_TIMM = '''
import fnmatch, sys

_entrypoints = {}


def register_model(fn):
    assert fn.__name__ not in _entrypoints, f"registered twice: {fn.__name__}"
    sys.modules[fn.__module__]               # timm looks the module up
    _entrypoints[fn.__name__] = fn
    return fn


def list_models(pattern="*"):
    return sorted(fnmatch.filter(_entrypoints, pattern))


def create_model(model_name, pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None,
                 checkpoint_path=None, cache_dir=None, scriptable=None, exportable=None, no_jit=None,
                 **kwargs):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if model_name not in _entrypoints:
        raise RuntimeError("Unknown model (%s)" % model_name)
    return _entrypoints[model_name](pretrained=pretrained, pretrained_cfg=pretrained_cfg,
                                    pretrained_cfg_overlay=pretrained_cfg_overlay, cache_dir=cache_dir,
                                    **kwargs)
'''

# timm 1.0's train.py up to its model: --device-modules imported after parsing, then create_model
# with train.py's keywords and defaults.
STAND_IN_TRAIN = '''
import argparse, importlib, sys

import torch
from timm.models import create_model, list_models

parser = argparse.ArgumentParser()
parser.add_argument("data", nargs="?")
parser.add_argument("--model", default="resnet50")
parser.add_argument("--num-classes", type=int, default=None)
parser.add_argument("--drop", type=float, default=0.0)
parser.add_argument("--drop-path", type=float, default=None)
parser.add_argument("--device-modules", default=None, type=str, nargs="+")
args = parser.parse_args()
if args.device_modules:
    for module in args.device_modules:
        importlib.import_module(module)
model = create_model(args.model, pretrained=False, in_chans=3, num_classes=args.num_classes,
                     drop_rate=args.drop, drop_path_rate=args.drop_path, drop_block_rate=None,
                     global_pool=None, bn_momentum=None, bn_eps=None, scriptable=False, checkpoint_path=None)
logits = model(torch.zeros(1, 3, 224, 224))
print(__name__, sys.argv[1:], model.config.scheme, model.config.dim, model.config.drop_path,
      tuple(logits.shape), len(list_models("vit_*_patch16_224")))
'''


@pytest.fixture
def timm_scripts(tmp_path):
    (tmp_path / "timm" / "models").mkdir(parents=True)
    (tmp_path / "timm" / "__init__.py").write_text("from .models import create_model, list_models\n")
    (tmp_path / "timm" / "models" / "__init__.py").write_text(textwrap.dedent(STAND_IN_TIMM))
    (tmp_path / "train.py").write_text(textwrap.dedent(STAND_IN_TRAIN))
    return tmp_path


def _run(folder: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_train_py_gets_the_models_through_device_modules(timm_scripts):
    out = _run(timm_scripts, "train.py", "data", "--device-modules", "siamesenorm.models.timm_models",
               "--model", "vit_siamese_tiny_patch16_224", "--num-classes", "10", "--drop-path", "0.05")
    assert out == f"__main__ ['data', '--device-modules', 'siamesenorm.models.timm_models', '--model', " \
                  f"'vit_siamese_tiny_patch16_224', '--num-classes', '10', '--drop-path', '0.05'] " \
                  f"siamese 192 0.05 (1, 10) {3 * len(sn.list_schemes())}"


def test_any_timm_script_runs_under_the_module(timm_scripts):
    out = _run(timm_scripts, "-m", "siamesenorm.models.timm_models", "train.py", "--model",
               "vit_pre_tiny_patch16_224", "--num-classes", "5")
    assert out == f"__main__ ['--model', 'vit_pre_tiny_patch16_224', '--num-classes', '5'] pre 192 0.1 " \
                  f"(1, 5) {3 * len(sn.list_schemes())}"


def test_without_the_import_timm_does_not_know_the_names(timm_scripts):
    env = {**os.environ, "PYTHONPATH": str(timm_scripts), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py", "--model", "vit_pre_tiny_patch16_224"],
                          cwd=timm_scripts, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Unknown model (vit_pre_tiny_patch16_224)" in done.stderr


@pytest.mark.parametrize("argv, registered, says", [
    ([], ["x"], "usage: python -m siamesenorm.models.timm_models SCRIPT [ARGS...] runs timm's SCRIPT"),
    (["--help"], ["x"], "usage: python -m siamesenorm.models.timm_models"),
    (["train.py"], [], "error: timm does not import here ("),
    (["no/such/train.py"], ["x"], "error: no/such/train.py: no such file; give the path of timm's train.py"),
])
def test_the_runner_refuses_in_one_line(argv, registered, says, monkeypatch, capsys):
    monkeypatch.setattr(timm_models, "REGISTERED", registered)
    assert timm_models.run_timm_script(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err
