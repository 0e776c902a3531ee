"""The embedded default (``python -m sut demo``): three runs with equal settings that
``python -m sut package --allow-noncompliant`` can lay out, and the command that does it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sut.run import demo

REPO = Path(__file__).resolve().parent.parent
# flags that may differ between the demo's runs: what makes each run what it is
ROLE_FLAGS = {"--mode", "--compliance-test", "--run-name", "--min-duration-s", "--min-query-count", "--tokenizer"}


def _flags(cmd: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a ``python -m sut run`` command (flags without a value map to '')."""
    args = cmd[cmd.index("run") + 1:]
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = ""
            i += 1
    return out


@pytest.fixture
def recorded(monkeypatch):
    """Replace each ``python -m sut`` step by a recorder that writes the run.json a run would."""
    calls: list[list[str]] = []

    def fake_sut(*args: str) -> None:
        calls.append(list(args))
        if args[0] == "run":
            f = _flags(list(args))
            d = Path(f["--output-dir"]) / f"{f['--run-name']}-NOT-COMPLIANT"
            d.mkdir(parents=True)
            (d / "run.json").write_text(json.dumps({
                "output_dir": str(d), "validity": "VALID", "samples_per_s": 1.0, "tokens_per_s": 9.0,
                "ledger": {"completed": 64}, "accuracy": {"passed": False},
                "test06": {"passed": True, "samples": 64}, "model": {"eos_token_ids": [128001, 128008, 128009]}}))

    monkeypatch.setattr(demo, "_sut", fake_sut)
    return calls


def test_demo_runs_are_packable_and_print_the_package_command(tmp_path, recorded, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="sut.run.demo"):
        assert demo.run_demo(Path("results/demo"), stamp="S1") == 0
    synthetic, *runs = recorded
    assert synthetic[0] == "synthetic" and synthetic[synthetic.index("--samples") + 1] == str(demo.SAMPLES)
    flags = [_flags(r) for r in runs]
    assert [f.get("--mode", "") for f in flags] == ["performance", "accuracy", ""]
    assert flags[2]["--compliance-test"] == "TEST06"
    shared = [{k: v for k, v in f.items() if k not in ROLE_FLAGS} for f in flags]
    assert shared[0] == shared[1] == shared[2], "the three runs must share engine, dataset and SUT settings"
    assert "--max-samples" not in shared[0] and shared[0]["--dataset"] == synthetic[synthetic.index("--out") + 1]

    text = caplog.text
    cmd = shlex.split(text.split("lay the three runs out")[1].splitlines()[1])
    assert cmd[:5] == ["python", "-m", "sut", "package", "--allow-noncompliant"]
    k = {cmd[i]: cmd[i + 1] for i in range(5, len(cmd) - 1, 2)}
    assert k["--out"] == "results/demo/S1/submission"
    assert [k["--performance"], k["--accuracy"], k["--test06"]] == [
        f"results/demo/S1/{n}-NOT-COMPLIANT" for n in ("performance", "accuracy", "test06")]
    assert "python -m accuracy --accuracy-log results/demo/S1/accuracy-NOT-COMPLIANT/mlperf_log_accuracy.json" in text
    assert "--tokenizer results/demo/data/tokenizer --eos-ids 128001,128008,128009" in text


def test_a_second_demo_does_not_collide(tmp_path, recorded):
    assert demo.run_demo(tmp_path, stamp="A") == 0
    assert demo.run_demo(tmp_path, stamp="B") == 0
    assert {p.name for p in (tmp_path / "B").iterdir()} == {
        "performance-NOT-COMPLIANT", "accuracy-NOT-COMPLIANT", "test06-NOT-COMPLIANT"}
    assert recorded[0] == recorded[4]  # the same (deterministic) data for both


@pytest.mark.slow
def test_demo_then_its_package_command_end_to_end(tmp_path):
    """The real demo (three engine starts; 5.5 min on 2 cores), then the command it prints."""
    run = subprocess.run([sys.executable, "-m", "sut", "demo", "--output-dir", str(tmp_path / "demo")], cwd=REPO,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LoadGen VALID" in run.stderr, run.stderr[-3000:]  # PERF_MIN_SAMPLES outlast the 10 s on 2 cores
    line = run.stderr.split("lay the three runs out")[1].splitlines()[1]
    cmd = shlex.split(line)
    assert cmd[:5] == ["python", "-m", "sut", "package", "--allow-noncompliant"]
    pkg = subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert pkg.returncode == 0, pkg.stderr[-3000:]
    out = Path(cmd[cmd.index("--out") + 1])
    (root,) = out.glob("closed/demo/results/1xCPU_tiny_demo/*/Offline")
    for name in ("performance/run_1/mlperf_log_summary.txt", "accuracy/accuracy.txt", "TEST06/verify_accuracy.txt",
                 "measurements.json", "user.conf"):
        assert (root / name).is_file(), name
    assert list(out.rglob("NOT-COMPLIANT.txt")) == [out / "closed" / "demo" / "NOT-COMPLIANT.txt"]  # one, at the root
