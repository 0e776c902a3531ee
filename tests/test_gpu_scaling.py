"""scripts/bench/gpu_scaling.py: the GPU scaling verdict from run records (no GPU needed)."""

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "bench" / "gpu_scaling.py"


def _record(root, n, tok_s, samples, validity="VALID", compliant=False):
    d = root / (f"gpus{n}" + ("" if compliant else "-NOT-COMPLIANT"))
    d.mkdir()
    engines = [{"samples": s, "device": {"uuid": f"GPU-{i}"}} for i, s in enumerate(samples)]
    (d / "run.json").write_text(json.dumps({"tokens_per_s": tok_s, "validity": validity, "engines": engines}))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_scaling_met_and_missed(tmp_path):
    _record(tmp_path, 1, 7344.45, [3060])
    _record(tmp_path, 2, 14604.6, [2549, 2551])
    _record(tmp_path, 4, 27000.0, [2600, 2500, 2550, 2550], compliant=True)  # 3.68x < 3.88: missed
    out = _run(tmp_path, 1, 2)
    assert out.returncode == 0, out.stderr
    assert "speed-up 1.9885 (target >= 1.94)" in out.stdout and "spread 0.0008" in out.stdout
    assert "GPU-0" in out.stdout and "GPU-1" in out.stdout
    out = _run(tmp_path, 1, 2, 4)
    assert out.returncode == 1 and out.stdout.splitlines()[-1].endswith("MISSED")


def test_unbalanced_invalid_or_missing_runs_fail(tmp_path):
    _record(tmp_path, 1, 7000.0, [3000])
    _record(tmp_path, 2, 14000.0, [2400, 2600])  # spread 0.08 > 0.02
    assert _run(tmp_path, 1, 2).returncode == 1
    assert _run(tmp_path, 1, 8).returncode == 1 and "no run record for 8" in _run(tmp_path, 1, 8).stderr
    assert _run(tmp_path, 2).returncode == 2  # no one-GPU baseline
    bad = tmp_path / "b"
    bad.mkdir()
    _record(bad, 1, 7000.0, [3000])
    _record(bad, 2, 14000.0, [1500, 1500], validity="INVALID")
    assert _run(bad, 1, 2).returncode == 1
