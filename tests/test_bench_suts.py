"""scripts/bench/bench_suts.py: run order rotates per round; medians and ratios skip failed runs; labelled variants."""

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_suts  # noqa: E402

from sut.run.child import RunOutcome


def test_order_rotates_so_no_sut_always_runs_first():
    order = bench_suts.rounds_order(["vllm", "vllm-http", "flame"], 3)
    firsts = [order[i * 3][1] for i in range(3)]
    assert firsts == ["vllm", "vllm-http", "flame"]
    assert sorted(order) == sorted((k, s) for k in range(3) for s in ("vllm", "vllm-http", "flame"))


def test_summary_is_median_of_good_runs_and_ratio_to_the_first_sut():
    runs = [{"sut": "a", "ok": True, "tokens_per_s": 100.0}, {"sut": "a", "ok": True, "tokens_per_s": 110.0},
            {"sut": "a", "ok": True, "tokens_per_s": 90.0}, {"sut": "b", "ok": True, "tokens_per_s": 99.0},
            {"sut": "b", "ok": False, "tokens_per_s": 1.0}]
    s = bench_suts.summarize(runs, ["a", "b"])
    assert s["a"] == {"median_tokens_per_s": 100.0, "runs": 3, "ratio_to_a": 1.0}
    assert s["b"] == {"median_tokens_per_s": 99.0, "runs": 1, "ratio_to_a": 0.99}
    assert bench_suts.summarize([{"sut": "a", "ok": False, "tokens_per_s": None}], ["a"])["a"]["ratio_to_a"] is None


def test_variants_are_labelled_entries_with_their_own_run_args():
    variant = 'vllm-http+stats=--sut vllm-http --option "server_args=--max-num-partial-prefills 2"'
    args = bench_suts.entry_args(["vllm", "vllm-http", "vllm-http+stats"], [variant],
                                 ["vllm-http+stats=--server-log-stats", "vllm=--dispatch-chunk 256"])
    assert args == {"vllm": ["--sut", "vllm", "--dispatch-chunk", "256"], "vllm-http": ["--sut", "vllm-http"],
                    "vllm-http+stats": ["--sut", "vllm-http", "--option", "server_args=--max-num-partial-prefills 2",
                                        "--server-log-stats"]}


@pytest.mark.parametrize("suts, variants, extras, error", [
    (["a", "a"], [], [], "distinct"),
    (["a b"], [], [], "a label is"),
    (["a"], ["b=--sut a"], [], "LABEL one of --suts"),
    (["a"], ["a"], [], "expected LABEL=ARGS"),
    (["a"], ["a=--sut x", "a=--sut y"], [], "given twice"),
    (["a"], ["a=--server-log-stats"], [], "must name the SUT"),
    (["a"], ["a=--sut"], [], "exactly once"),
    (["a"], ["a=--sut="], [], "exactly once"),
    (["a"], ["a=--sut --max-num-seqs 4"], [], "exactly once"),
    (["a"], ["a=--sut vllm --sut flame"], [], "exactly once"),
    (["vllm", "x"], ["vllm=--sut vllm-http"], [], "may not be a SUT's name"),
    (["vllm-http", "x"], ["vllm-http=--sut vllm-http --server-log-stats"], [], "may not be a SUT's name"),
    (["vllm", "vllm-http"], [], ["vllm=--sut vllm-http"], "--extra vllm: must not name --sut"),
    (["a"], ["a=--sut vllm"], ["a=--sut=flame"], "--extra a: must not name --sut"),
    (["a"], [], ["b=--x"], "--extra b: not one of --suts"),
])
def test_bad_variants_are_refused(suts, variants, extras, error):
    with pytest.raises(ValueError, match=error):
        bench_suts.entry_args(suts, variants, extras)


def test_main_runs_each_label_with_its_args_in_rotation_and_labels_the_summary(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run_once(run_args, out, name, timeout_s):
        calls.append((name.split("-", 1)[1], run_args))
        tps = 100.0 if "--server-log-stats" in run_args else 99.0
        return RunOutcome(0, {"validity": "VALID", "tokens_per_s": tps}, None, "")

    monkeypatch.setattr(bench_suts, "run_once", fake_run_once)
    rc = bench_suts.main(["--suts", "vllm-http", "vllm-http+stats", "--rounds", "2", "--out", str(tmp_path),
                          "--variant", "vllm-http+stats=--sut vllm-http --server-log-stats", "--", "--model", "M"])
    assert rc == 0
    assert [c[0] for c in calls] == ["vllm-http-r0", "vllm-http+stats-r0", "vllm-http+stats-r1", "vllm-http-r1"]
    assert calls[1][1] == ["--model", "M", "--sut", "vllm-http", "--server-log-stats"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["entry_args"]["vllm-http+stats"] == ["--sut", "vllm-http", "--server-log-stats"]
    assert summary["summary"]["vllm-http+stats"]["ratio_to_vllm-http"] == round(100 / 99, 4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:  # a usage error: exit 2, the reason on stderr
        bench_suts.main(["--suts", "a", "--out", str(tmp_path), "--", "--sut", "vllm"])
    assert ei.value.code == 2
    assert "the run args after -- must not name --sut (give it with --suts / --variant)" in capsys.readouterr().err


def test_sigterm_is_taken_as_ctrl_c_so_the_run_in_its_own_session_is_stopped(monkeypatch):
    """sut_runs gives each run a session of its own: SIGTERM of the script must raise KeyboardInterrupt (which
    run_with_timeout answers by stopping the run), and the script then exits 130."""
    import os
    import signal
    import time

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def main():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    monkeypatch.setattr(bench_suts, "main", main)
    try:
        assert bench_suts._main_stoppable() == 130
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_an_invalid_run_is_left_out_of_the_medians_and_the_console_says_why(tmp_path, monkeypatch, caplog):
    """A --quick run on idle cores can end before its minimum duration: LoadGen says INVALID, rc 0. It is not
    counted, and the console says so with the run's real folder (the name with -NOT-COMPLIANT where it is one)."""
    def fake_run_once(run_args, out, name, timeout_s):
        validity = "INVALID" if name.endswith("-r0") and "vllm-http" in name else "VALID"
        return RunOutcome(0, {"validity": validity, "tokens_per_s": 50.0}, out / f"{name}-NOT-COMPLIANT", "")

    monkeypatch.setattr(bench_suts, "run_once", fake_run_once)
    with caplog.at_level(logging.INFO, logger=bench_suts.log.name):
        rc = bench_suts.main(["--suts", "vllm", "vllm-http", "--rounds", "2", "--out", str(tmp_path), "--",
                              "--model", "M"])
    assert rc == 1
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["vllm-http"]["runs"] == 1 and summary["vllm"]["runs"] == 2
    assert "not counted: LoadGen said INVALID" in caplog.text and "raise --target-qps" in caplog.text
    assert f"{tmp_path}/" in caplog.text and "-vllm-http-r0-NOT-COMPLIANT)" in caplog.text
