"""scripts/bench/scenario_ratios.py: each Server / Interactive run as a share of the Offline run beside it, read
from the run.json files of a recorded H100 job (docs/results/h100_2026-12-06d)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "bench"))
import scenario_ratios  # noqa: E402

JOB = REPO / "docs" / "results" / "h100_2026-12-06d"


def test_shares_of_the_offline_run_of_the_same_job(capsys):
    assert scenario_ratios.main([str(JOB)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Offline") and "100.00% of Offline" in out[0]
    server = next(x for x in out if x.startswith("Server"))
    inter = next(x for x in out if x.startswith("Interactive"))
    assert "INVALID" in server and "6,472.8 tok/s" in server and "93.62% of Offline (goal 95%: below)" in server
    assert "TTFT p99 19,692/2,000 ms" in server and "TPOT p99 79.8/100 ms" in server
    assert "VALID" in inter and "79.85% of Offline (goal 82%: below)" in inter and "TPOT p99 26.1/30 ms" in inter
    assert out[-1] == "card: NVIDIA H100 80GB HBM3; Offline: 6,913.9 tok/s"
    run = scenario_ratios.read_run(JOB / "confirm-Server-52-NOT-COMPLIANT" / "run.json")
    assert run["tokens_per_s"] == pytest.approx(6472.75) and run["target_qps"] == 52


def test_no_offline_run_or_two_cards_give_no_share_and_exit_1(tmp_path, capsys):
    for name in ("confirm-Server-52-NOT-COMPLIANT", "confirm-Interactive-43-240s-NOT-COMPLIANT"):
        shutil.copytree(JOB / name, tmp_path / "a" / name)
    assert scenario_ratios.main([str(tmp_path / "a")]) == 1
    cap = capsys.readouterr()
    assert "of Offline" not in cap.out and "no Offline run beside these" in cap.err
    shutil.copytree(JOB, tmp_path / "b")
    rec = json.loads((tmp_path / "b" / "confirm-Server-52-NOT-COMPLIANT" / "run.json").read_text())
    rec["engines"][0]["device"]["name"] = "NVIDIA H200"
    (tmp_path / "b" / "confirm-Server-52-NOT-COMPLIANT" / "run.json").write_text(json.dumps(rec))
    assert scenario_ratios.main([str(tmp_path / "b")]) == 1
    assert "the runs are on different cards" in capsys.readouterr().err
    assert scenario_ratios.main([str(tmp_path / "empty")]) == 2


def test_a_share_a_hair_under_its_goal_reads_below_not_a_rounded_95(capsys):
    """docs/results/h100_2026-12-07d: Server 6,615.5 of Offline 6,965.1 is 94.98 %: shown with two decimals and
    'below'; Interactive 83.14 % 'met'. An INVALID run is 'below' whatever its share, a VALID one shorter than 600 s
    'short run'."""
    assert scenario_ratios.main([str(REPO / "docs" / "results" / "h100_2026-12-07d")]) == 0
    out = capsys.readouterr().out.splitlines()
    server = next(x for x in out if x.startswith("Server"))
    inter = next(x for x in out if x.startswith("Interactive"))
    assert "94.98% of Offline (goal 95%: below)" in server
    assert "83.14% of Offline (goal 82%: met)" in inter
    assert "(goal" not in out[0]
    run = {"scenario": "Server", "validity": "INVALID"}
    assert scenario_ratios.goal_mark(run, 0.99) == " (goal 95%: below)"
    assert scenario_ratios.goal_mark({**run, "validity": "VALID", "min_duration_s": 600}, 0.95) == " (goal 95%: met)"
    assert scenario_ratios.goal_mark({**run, "validity": "VALID", "min_duration_s": 240}, 0.96) == " (goal 95%: short run)"
