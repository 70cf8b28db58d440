"""benchmarks/traffic.py at a tiny size: Inductor's byte counts per case, the ratios and the floors."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "traffic.py"


def _load():
    spec = importlib.util.spec_from_file_location("traffic_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floor_is_the_papers_stream_count():
    """Per sublayer and element: Pre-Norm 2s + 2a forward, 3s + 2a backward; two normalised streams
    4s + 2a and 6s + 2a; a normalised and an accumulated one (ResiDual) 4s + 2a and 4s + 2a (fp32
    streams, bf16 branch tensors: 28, 48 and 40 bytes)."""
    traffic = _load()
    assert traffic.stream_floor((1, 0), False, 1, 1, 4, 2) == 28
    assert traffic.stream_floor((2, 0), False, 1, 1, 4, 2) == 48
    assert traffic.stream_floor((1, 1), False, 1, 1, 4, 2) == 40
    assert traffic.stream_floor((2, 0), True, 2, 10, 4, 2) == 10 * (2 * 48 + 7 * 2)
    assert traffic.stream_floor(None, False, 2, 10, 4, 2) is None


def test_attn_res_floor_counts_each_mix_sum_and_accumulation():
    """One sublayer: the embedding's norm (a mix of one source, 3s + 2a = 16), the exit's mix of
    h and out beyond Pre-Norm's final norm (3 * (s + a) + 2a - 16 = 6), h's second gradient (s = 4).
    Two sublayers as one block add b + out (3a) and b's second gradient (a) where the full form
    has a third source: 60 either way; one sublayer a block is the full form."""
    traffic = _load()
    assert traffic.attn_res_floor(1, None, 1, 4, 2) == 26
    assert traffic.attn_res_floor(2, 2, 10, 4, 2) == traffic.attn_res_floor(2, None, 10, 4, 2) == 600
    assert traffic.attn_res_floor(8, 1, 1, 4, 2) == traffic.attn_res_floor(8, None, 1, 4, 2) == 432
    assert traffic.attn_res_floor(8, 4, 1, 4, 2) < 432
    assert traffic.case_floor("attn_res-block4", 8, 1, 4, 2) == traffic.attn_res_floor(8, 4, 1, 4, 2)


def test_a_tiny_run_prints_every_ratio(tmp_path, capsys):
    traffic = _load()
    out = tmp_path / "t.md"
    assert traffic.main(["--cases", "siamese", "--dim", "32", "--layers", "1", "--heads", "2",
                         "--batch", "1", "--seq", "16", "--vocab", "32", "--markdown", str(out)]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.read_text().splitlines() if re.match(r"\| (pre|siamese) ", line)}
    assert set(rows) == {"pre", "siamese"}
    assert rows["pre"][1] == "1.000" and rows["pre"][5] == "1.000"
    assert float(rows["siamese"][0]) > float(rows["pre"][0]) > 0       # MiB moved
    assert float(rows["siamese"][5]) > 1.0 and float(rows["siamese"][6]) > 0   # floor / pre, bytes / floor
    assert out.read_text() in capsys.readouterr().out + "\n"


def test_an_unknown_case_is_refused_in_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT), "--cases", "pre,nope"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: unknown case 'nope'; choose from {', '.join(_load().CASES)}"]
