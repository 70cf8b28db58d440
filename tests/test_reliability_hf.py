"""Issue 48 (reliability, round 5), the Hugging Face integration, found by a careless or hostile
user. References: the file system before and after (nothing outside the target touched), the
in-memory model's logits and buffers (a reloaded model computes exactly what was saved), and the
bounds our own configuration has (:mod:`siamesenorm.models.config_checks`).

1. ``siamesenorm.hf.save(model, folder, force=True)`` and ``export --format hf --force`` deleted
   whatever folder they were given (the current one, its parent, a repository, home, ``/``).
2. A model with a buffer that no state dict holds (mHC-lite's permutation matrices) computed NaN
   after any ``from_pretrained``: transformers leaves such buffers empty.
3. ``adapt_from_pretrained`` of a folder with a huge size ran for minutes, and one of an unknown
   model type let transformers ask on stdin whether to run the folder's code.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils", reason="adapt needs transformers 5")

import siamesenorm.hf as H  # noqa: E402
from helpers import cli_in_process  # noqa: E402
from siamesenorm import list_schemes  # noqa: E402
from siamesenorm.errors import UserError  # noqa: E402
from siamesenorm.hf import export as hx  # noqa: E402
from siamesenorm.hf import folder as hfolder  # noqa: E402
from siamesenorm.hf import loading as hload  # noqa: E402
from siamesenorm.hf import vendoring as hv  # noqa: E402
from siamesenorm.models.config_checks import MAX_LAYERS  # noqa: E402
from siamesenorm.schemes import get_scheme_class  # noqa: E402
from siamesenorm.schemes.base import Flag, OneOf, build_scheme  # noqa: E402
from siamesenorm.tasks.finished import load_trained  # noqa: E402
from test_hf import config as own_config  # noqa: E402
from test_hf_adapt import family_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

X = torch.tensor([[1, 2, 3, 40, 50, 60, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]])


def listing(root: Path) -> dict[str, str]:
    """Everything under ``root``, links not followed: relative path -> its kind and content."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = "link -> " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes().hex()
    return out


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    text = str(error.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text


@pytest.fixture(scope="module")
def model():
    """A tiny adapted Llama (the fastest to save)."""
    torch.manual_seed(0)
    return H.adapt(family_config("llama"), "pre").eval()


@pytest.fixture(autouse=True)
def _quick_code(monkeypatch):
    """The generated modelling code made once per process (the same text for every folder)."""
    monkeypatch.setattr(hv, "family_modeling_source", functools.cache(_FAMILY_SOURCE))
    monkeypatch.setattr(hx, "modeling_source", _own_source)


_FAMILY_SOURCE = hv.family_modeling_source
_own_source = functools.cache(hv.modeling_source)


# ---- 1. the folder save and export --force replace -----------------------------------------------
def _touched(*args, **kwargs):
    raise AssertionError(f"a refused folder was touched: {args}")


def _nothing_touched(monkeypatch) -> None:
    """Fail the test on any call that makes, moves or deletes a file or folder (for the targets
    a test may not touch even by mistake: ``/``, home)."""
    for name in ("rename", "replace", "mkdir", "makedirs", "rmdir", "unlink", "remove"):
        monkeypatch.setattr(os, name, _touched)
    monkeypatch.setattr(shutil, "rmtree", _touched)
    monkeypatch.setattr(shutil, "move", _touched)
    monkeypatch.setattr(tempfile, "mkdtemp", _touched)


def test_save_refuses_the_current_folder_and_every_folder_holding_it(model, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "train.py").write_text("print('my script')\n")
    (project / "outputs" / "sub").mkdir(parents=True)
    (project / "outputs" / "sub" / "result.txt").write_text("42\n")
    monkeypatch.chdir(project / "outputs")
    before = listing(tmp_path)
    for target in (".", "..", "sub/..", str(project), str(project / "outputs"), str(tmp_path),
                   Path("."), project / "outputs" / "sub" / ".." / ".."):
        with pytest.raises(UserError) as error:
            H.save(model, target, force=True)
        one_line(error, "holds the current folder", "choose another folder")
        assert listing(tmp_path) == before, target
    # and a folder beside it that holds the user's files, with or without force
    for force in (False, True):
        with pytest.raises(UserError) as error:
            H.save(model, project / "outputs" / "sub", force=force)
        one_line(error, "holds files siamesenorm did not write (result.txt)", "force=True")
    assert listing(tmp_path) == before


def test_save_refuses_home_the_root_and_a_mount_point_before_touching_anything(model, tmp_path,
                                                                               monkeypatch):
    home = tmp_path / "users" / "me"
    home.mkdir(parents=True)
    (home / "notes.txt").write_text("mine\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert Path.home() == home
    (tmp_path / "mnt").mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == tmp_path / "mnt" or real_ismount(p))

    _nothing_touched(monkeypatch)
    monkeypatch.setattr(model, "save_pretrained", _touched)
    cases = [(home, "holds your home folder"), (tmp_path / "users", "holds your home folder"),
             ("/", "is the root folder"), (Path("/"), "is the root folder"),
             (tmp_path / "mnt", "is a mount point")]
    for target, fragment in cases:
        for force in (True, False):
            with pytest.raises(UserError) as error:
                H.save(model, target, force=force)
            one_line(error, fragment, f"folder {target}")
    monkeypatch.undo()
    assert (home / "notes.txt").read_text() == "mine\n"


def test_force_replaces_only_a_folder_siamesenorm_wrote(model, tmp_path):
    out = tmp_path / "model"
    assert H.save(model, out) == out
    marker = json.loads((out / hfolder.MARKER).read_text())
    assert marker["written_by"].endswith("(siamesenorm.hf.save)")
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {hfolder.MARKER}
    with pytest.raises(UserError) as error:             # ours, but not empty: force replaces it
        H.save(model, out)
    one_line(error, "is a folder that is not empty; add force=True to replace it")
    H.save(model, out, force=True)
    for planted in ("notes.txt", ".git/", "sub/"):      # a file, a repository, a folder of the user's
        path = out / planted.rstrip("/")
        path.mkdir() if planted.endswith("/") else path.write_text("mine\n")
        before = listing(tmp_path)
        with pytest.raises(UserError) as error:
            H.save(model, out, force=True)
        one_line(error, f"holds files siamesenorm did not write ({planted})", "force=True replaces only")
        assert listing(tmp_path) == before
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    victim = tmp_path / "victim.txt"                    # a link inside: not ours, never followed
    victim.write_text("precious\n")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(victim)
    with pytest.raises(UserError, match=r"did not write \(config.json\)"):
        H.save(model, out, force=True)
    (out / hfolder.MARKER).write_text("{not json")        # a damaged record is no record
    (out / "config.json").unlink()
    with pytest.raises(UserError, match="did not write"):
        H.save(model, out, force=True)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "victim.txt"]


def test_a_link_to_a_folder_is_followed_and_stays_a_link(model, tmp_path):
    real = tmp_path / "store" / "model"
    H.save(model, real)
    link = tmp_path / "model"
    link.symlink_to(real)
    H.save(model, link, force=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "config.json").is_file() and not (real / "config.json").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "store"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["model"]      # no .model.old-* left
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError) as error:
        H.save(model, dangling)
    one_line(error, "is a link to", "which does not exist")
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_planted_temporary_name_is_neither_followed_nor_in_the_way(model, tmp_path):
    """The names a save of this process once used (``.NAME.tmp-PID``, ``.NAME.old-PID``): a link
    planted there made a save end in ``FileExistsError`` and left ``.NAME.old-PID`` behind."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious\n")
    out = tmp_path / "model"
    planted = [tmp_path / f".model.{kind}-{os.getpid()}" for kind in ("tmp", "old")]
    for path in planted:
        path.symlink_to(victim)
    before = listing(victim)
    H.save(model, out)
    H.save(model, out, force=True)
    assert listing(victim) == before
    assert all(p.is_symlink() and os.readlink(p) == str(victim) for p in planted)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", "victim",
                                                                 *(p.name for p in planted)])


def test_save_refuses_arguments_of_the_wrong_kind(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="folder must be a path"):
        H.save(model, 123)
    with pytest.raises(TypeError, match="force must be True or False"):
        H.save(model, tmp_path / "m", force="yes")
    for empty in ("", "  "):
        with pytest.raises(UserError) as error:
            H.save(model, empty)
        one_line(error, "folder is empty")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def lite_run(tmp_path_factory) -> Path:
    """The issue's run: ``train tiny model.scheme=mhc model.scheme_options.mixing=lite``."""
    run = tmp_path_factory.mktemp("lite") / "r"
    res = cli_in_process("train", "tiny", "model.scheme=mhc", "model.scheme_options.mixing=lite",
                         "train.steps=2", "train.eval_every=2", "data.max_bytes=20000", "--out", str(run))
    assert res.returncode == 0, res.stderr
    return run


def test_export_force_refuses_what_save_refuses(lite_run, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / "work" / "paper.tex").write_text("mine\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(home))
    before = listing(tmp_path)
    with monkeypatch.context() as patched:
        _nothing_touched(patched)
        for out, fragment in ((home, "holds your home folder"), (home / "work", "did not write (paper.tex)"),
                              ("/", "--out / "), (tmp_path, "holds the current folder"),
                              (tmp_path / "elsewhere", "holds the current folder")):
            res = cli_in_process("export", str(lite_run), "--format", "hf", "--out", str(out), "--force",
                                 cwd=tmp_path / "elsewhere")
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(lines) == 1 and fragment in lines[0], res.stderr
    assert listing(tmp_path) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("1,2\n")
    before = listing(tmp_path)
    res = cli_in_process("export", str(lite_run), "--format", "hf", "--out", str(other), "--force")
    assert res.returncode == 2 and "--out" in res.stderr and "did not write (data.csv)" in res.stderr
    assert listing(tmp_path) == before
    # a folder export wrote is replaced with --force (and is not without)
    ours = tmp_path / "m"
    for args in ((), ("--force",)):
        res = cli_in_process("export", str(lite_run), "--format", "hf", "--out", str(ours), *args)
        assert res.returncode == 0, res.stderr
    assert json.loads((ours / hfolder.MARKER).read_text())["written_by"].endswith("(export --format hf)")


# ---- 2. buffers that no state dict holds, through every HF save and load --------------------------
def _option_values(check) -> tuple:
    return check.choices if isinstance(check, OneOf) else (True, False) if isinstance(check, Flag) else ()


def _has_buffers(name: str, options: dict) -> bool:
    return next(build_scheme(name, 32, 2, **options).buffers(), None) is not None


def _cases() -> list[tuple[str, dict]]:
    """Every scheme, with its defaults or one option's value, that has a buffer (found by building
    it), and every mHC mixing: what a state dict may lack. (Every scheme's defaults round-trip
    through save_pretrained in test_hf.py.)"""
    cases = []
    for name in list_schemes():
        variants = [{}]
        for option, spec in get_scheme_class(name).all_options().items():
            variants += [{option: v} for v in _option_values(spec.check) if v != spec.default]
        for options in variants:
            try:
                buffered = _has_buffers(name, options)
            except UserError:                   # a value that needs another option with it
                continue
            if buffered or (name == "mhc" and set(options) <= {"mixing"}):
                cases.append((name, options))
    return cases


CASES = _cases()


def test_the_cases_find_the_buffer_of_mhc_lite_and_hold_every_mhc_mixing():
    assert _has_buffers("mhc", {"mixing": "lite"}) and not _has_buffers("mhc", {})
    assert ("mhc", {"mixing": "lite"}) in CASES
    assert {("mhc", "lite"), ("mhc", "deepseek_v4"), ("mhc", None)} <= {(n, o.get("mixing"))
                                                                        for n, o in CASES}


def _perturbed(model):
    """``model`` with its scheme's parameters moved off their init (a fresh init on loading shows)."""
    scheme = model.scheme
    with torch.no_grad():
        for p in scheme.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p) * 0.05)
    return model.eval()


def _same(loaded, reference, x: torch.Tensor) -> None:
    loaded.eval(), reference.eval()
    with torch.no_grad():
        want, got = reference(x).logits, loaded(x).logits
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    buffers = dict(loaded.named_buffers())
    for name, buffer in reference.named_buffers():
        assert torch.equal(buffers[name], buffer), name


def _no_prompt(monkeypatch) -> None:
    def asked(*args):
        raise AssertionError("transformers asked on stdin")

    monkeypatch.setattr(builtins, "input", asked)


@pytest.mark.parametrize("scheme,options", CASES, ids=[f"{n}-{o}" if o else n for n, o in CASES])
def test_a_saved_model_reloads_with_its_buffers_through_every_hf_path(scheme, options, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    _no_prompt(monkeypatch)
    # our language model: export's writer (vendored code), loaded with the installed and that code
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(own_config(scheme, scheme_options=options)).eval()
    _perturbed(ours.model)
    hx.write_model_folder(tmp_path / "own", ours.model, ours.config.to_lm_config())
    _same(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own"), ours, X % 61)
    vendored = dmu.get_class_from_dynamic_module("modeling_siamesenorm.SiameseNormForCausalLM",
                                                 str(tmp_path / "own"))
    _same(vendored.from_pretrained(tmp_path / "own"), ours, X % 61)
    # a family's model adapted: save_pretrained, siamesenorm.hf.save; loaded by adapt_from_pretrained,
    # the Auto classes and the folder's own code
    torch.manual_seed(0)
    adapted = _perturbed(H.adapt(family_config("llama"), scheme, **options))
    adapted.save_pretrained(tmp_path / "pretrained")
    _same(H.adapt_from_pretrained(tmp_path / "pretrained"), adapted, X)
    H.save(adapted, tmp_path / "saved")
    _same(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True),
          adapted, X)
    cls = dmu.get_class_from_dynamic_module(f"modeling_siamesenorm.{type(adapted).__name__}",
                                            str(tmp_path / "saved"))
    _same(cls.from_pretrained(tmp_path / "saved"), adapted, X)


def test_the_issues_mhc_lite_run_exported_loads_as_trained(lite_run, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    _no_prompt(monkeypatch)
    res = cli_in_process("export", str(lite_run), "--format", "hf", "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    trained, cfg = load_trained(lite_run)
    x = X % cfg.model.vocab_size
    with torch.no_grad():
        want = trained(x).logits
    assert torch.isfinite(want).all()
    for trust in (False, True):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=trust)
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(x).logits, want, rtol=0, atol=1e-6)


# ---- 3. adapt_from_pretrained reads a folder before it builds anything -----------------------------
@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory, model) -> Path:
    folder = tmp_path_factory.mktemp("adapted") / "llama"
    model.save_pretrained(folder)
    return folder


def _copy_with(saved_folder: Path, where: Path, **changes) -> Path:
    shutil.copytree(saved_folder, where)
    config = json.loads((where / "config.json").read_text())
    config.update(changes)
    (where / "config.json").write_text(json.dumps(config))
    return where


def _nothing_built(monkeypatch, *, until: str) -> None:
    """Fail the test if the loading gets past ``until`` (``config``: transformers reads the
    config; ``weights``: it builds the model and reads the weights)."""
    def built(*args, **kwargs):
        raise AssertionError("built before refusing")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(built))
    if until == "config":
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", built)
        monkeypatch.setattr(hload, "build_scheme", built)
        monkeypatch.setattr(hload, "adapted_class", built)


@pytest.mark.parametrize("key,value,fragment", [
    ("num_hidden_layers", 1e8, "num_hidden_layers must be a positive integer, got 100000000.0"),
    ("num_hidden_layers", 10**8, f"num_hidden_layers=100,000,000 is beyond what this library builds "
                                 f"(at most {MAX_LAYERS:,}"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
    ("hidden_size", 10**15, "make about"),
    ("vocab_size", 10**14, "make about"),
    ("vocab_size", "50000", "vocab_size must be a positive integer, got '50000'"),
    ("num_attention_heads", True, "num_attention_heads must be a positive integer, got True"),
    ("intermediate_size", -1, "intermediate_size must be a positive integer"),
    ("num_key_value_heads", 2.5, "num_key_value_heads must be a positive integer"),
    ("head_dim", [8], "head_dim must be a positive integer"),
    ("num_attention_heads", None, "num_attention_heads must be a positive integer, got None"),
])
def test_every_size_in_config_json_is_bounded_before_anything_is_built(saved_folder, tmp_path, monkeypatch,
                                                                       key, value, fragment):
    folder = _copy_with(saved_folder, tmp_path / "m", **{key: value})
    _nothing_built(monkeypatch, until="config")
    with pytest.raises(UserError) as error:
        H.adapt_from_pretrained(folder)
    one_line(error, f"{folder}/config.json: ", fragment)


@pytest.mark.parametrize("key,value,tensor", [
    ("hidden_size", 10**6, "model.embed_tokens.weight"),
    ("vocab_size", 10**7, "model.embed_tokens.weight"),
    ("intermediate_size", 10**9, "gate_proj.weight"),
    ("num_key_value_heads", 4, "k_proj.weight"),
])
def test_sizes_the_weights_do_not_have_are_refused_before_any_memory_is_taken(saved_folder, tmp_path,
                                                                              monkeypatch, key, value,
                                                                              tensor):
    """Within the bounds, but not the weights' shapes: transformers allocated and initialised the
    model the config describes (minutes, or the memory of the machine), then refused it."""
    folder = _copy_with(saved_folder, tmp_path / "m", **{key: value})
    _nothing_built(monkeypatch, until="weights")
    with pytest.raises(UserError) as error:
        H.adapt_from_pretrained(folder)
    one_line(error, "config.json does not match the weights", tensor, f"{key}={value}", "damaged")


def test_a_config_object_is_checked_as_the_file_is(saved_folder, monkeypatch):
    config = transformers.AutoConfig.from_pretrained(saved_folder)
    config.num_hidden_layers = 10**6
    _nothing_built(monkeypatch, until="config")
    with pytest.raises(UserError, match="config: num_hidden_layers=1,000,000 is beyond"):
        H.adapt_from_pretrained(saved_folder, config=config)
    with pytest.raises(TypeError, match="config must be a transformers configuration"):
        H.adapt_from_pretrained(saved_folder, config={"num_hidden_layers": 2})


@pytest.mark.parametrize("model_type", ["evil_model", "gpt2", None, 7])
def test_a_folder_of_another_model_type_is_refused_before_transformers_asks(saved_folder, tmp_path,
                                                                           monkeypatch, model_type):
    """An unknown model type with an ``auto_map``: transformers asked "Do you wish to run the custom
    code? [y/N]" on stdin (and would run evil.py on a yes)."""
    sentinel = tmp_path / "ran"
    folder = _copy_with(saved_folder, tmp_path / "m", model_type=model_type,
                        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"})
    (folder / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    _no_prompt(monkeypatch)
    monkeypatch.setattr(sys, "stdin", None)
    _nothing_built(monkeypatch, until="config")
    with pytest.raises(UserError) as error:
        H.adapt_from_pretrained(folder, trust_remote_code=True)
    one_line(error, f"model_type {model_type!r} is not a model siamesenorm.hf.adapt builds",
             "siamesenorm_llama")
    assert not sentinel.exists()


def test_a_path_that_is_not_a_folder_is_refused(tmp_path, monkeypatch):
    _nothing_built(monkeypatch, until="config")
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "file", tmp_path / "missing", "Qwen/Qwen3-0.6B"):
        with pytest.raises(UserError) as error:
            H.adapt_from_pretrained(path)
        one_line(error, "is not a folder")
    with pytest.raises(TypeError, match="path must be a folder's path"):
        H.adapt_from_pretrained(None)
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(UserError, match="cannot read .*config.json"):
        H.adapt_from_pretrained(folder)
