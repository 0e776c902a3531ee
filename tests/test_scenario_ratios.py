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
    assert "INVALID" in server and "6,472.8 tok/s" in server and "93.61% of Offline (goal 95%: not VALID)" in server
    assert "TTFT p99 19,692/2,000 ms" in server and "TPOT p99 79.8/100 ms" in server
    assert "VALID" in inter and "79.84% of Offline (goal 82%: below)" in inter and "TPOT p99 26.1/30 ms" in inter
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
    'below'; Interactive 83.13 % 'met'. An INVALID run is 'below' whatever its share, a VALID one shorter than 600 s
    'short run'."""
    assert scenario_ratios.main([str(REPO / "docs" / "results" / "h100_2026-12-07d")]) == 0
    out = capsys.readouterr().out.splitlines()
    server = next(x for x in out if x.startswith("Server"))
    inter = next(x for x in out if x.startswith("Interactive"))
    assert "94.98% of Offline (goal 95%: below)" in server
    assert "83.13% of Offline (goal 82%: met)" in inter
    assert "(goal" not in out[0]
    run = {"scenario": "Server", "validity": "INVALID"}
    assert scenario_ratios.goal_mark(run, 0.99) == " (goal 95%: not VALID)"
    ok = {**run, "validity": "VALID"}
    assert scenario_ratios.goal_mark({**ok, "min_duration_s": 600}, 0.95) == " (goal 95%: met)"
    assert scenario_ratios.goal_mark({**ok, "min_duration_s": 600}, 0.94996) == " (goal 95%: below)"
    assert scenario_ratios.goal_mark({**ok, "min_duration_s": 240}, 0.96) == " (goal 95%: short run)"
    assert scenario_ratios.goal_mark({**ok, "min_duration_s": None}, 0.96) == " (goal 95%: duration unknown)"
    assert scenario_ratios.pct(0.94996) == " 94.99%" and scenario_ratios.pct(0.8313) == " 83.13%"


def test_a_file_that_is_no_run_record_is_named_and_left_out(tmp_path, capsys):
    """A list, bad JSON or a record missing its scenario / verdict / latencies: named on stderr, the rest still
    read, exit 1; no traceback."""
    shutil.copytree(JOB, tmp_path / "j")
    (tmp_path / "j" / "x").mkdir()
    (tmp_path / "j" / "x" / "run.json").write_text("[1, 2]")
    (tmp_path / "j" / "y").mkdir()
    (tmp_path / "j" / "y" / "run.json").write_text("{not json")
    rec = json.loads((JOB / "confirm-Server-52-NOT-COMPLIANT" / "run.json").read_text())
    for k in ("validity", "scenario"):
        rec.pop(k)
    rec["loadgen"].pop("result_first_token_99.00_percentile_latency_ns")
    (tmp_path / "j" / "z").mkdir()
    (tmp_path / "j" / "z" / "run.json").write_text(json.dumps(rec))
    assert scenario_ratios.main([str(tmp_path / "j")]) == 1
    cap = capsys.readouterr()
    assert "x/run.json: not a run record (a JSON list, not an object) (left out)" in cap.err
    assert "y/run.json: cannot read it as JSON" in cap.err
    odd = next(x for x in cap.out.splitlines() if x.endswith("[z]"))
    assert odd.startswith("?") and "TTFT p99 ?/2,000 ms" in odd
    assert sum(x.startswith(("Offline", "Server", "Interactive")) for x in cap.out.splitlines()) == 3
