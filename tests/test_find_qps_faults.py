"""python -m sut find-qps when a try goes wrong: a ``--fresh-process`` try past ``--timeout-s``
is stopped with the server it started (``sut_runs.run_with_timeout``); a failed try is no verdict (it bounds
nothing, carries no p99s, a resumed search makes it again); accuracy / compliance tries are refused before any
try; ``--resume A --log B`` keeps A's tries in B.

The end-to-end time-out test runs ``python -m sut run --sut vllm-http`` with a server it starts itself through
``--option server_command=`` (tests/fake_vllm_server.py copied into the test's folder, so that its processes can
be found by path, with ``--delay`` longer than the test: every query stalls)."""

import json
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL

from sut.findqps import cli as find_qps
from sut.findqps.search import Try
from sut.run import child as sut_runs


def _pids(pattern: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _tries(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def fake_run(fail_at=(), limit=13.0):
    """``find_qps.sut_try`` stand-in: VALID at or below ``limit`` qps; a try at a qps in ``fail_at`` fails the
    first time (validity None, with the absurd p99 a failed LoadGen run reports), as a crashed run does."""
    calls, failed = [], set()

    def run(scenario, q, *a):
        calls.append(q)
        if q in fail_at and q not in failed:
            failed.add(q)
            rec = {"status": "failed", "error": "RunFailed: replica 0 died",
                   "loadgen": {"result_first_token_99.00_percentile_latency_ns": 5.57e18}}
            return find_qps.try_from_record(q, rec, False, f"run-{q:g}", 3.0, "run failed (exit 1): replica 0 died")
        return Try(q, "VALID" if q <= limit else "INVALID", 400.0, 20.0, 5000.0 * q, f"run-{q:g}", "", 150.0)
    run.calls = calls
    return run


def _args(tmp_path, data, *extra):
    return ["--scenario", "Server", "--min-duration-s", "30", "--output-dir", str(tmp_path / "o"), "--fresh-process",
            *extra, "--", "--config", str(REPO / "loadgen_configs" / "cpu_tiny.toml"), "--dataset", str(data)]


# ----------------------------------------------------------------------------- a failed try is no verdict
def test_a_failed_try_stops_the_search_bounds_nothing_and_is_made_again_on_resume(tmp_path, monkeypatch, capsys,
                                                                                   caplog, synthetic_small):
    run = fake_run(fail_at={8.0})
    monkeypatch.setattr(find_qps, "sut_try", run)
    path = tmp_path / "o" / "tries-Server.jsonl"
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--start", "4")) == 1
    tries = _tries(path)
    assert [(t["qps"], t["validity"]) for t in tries] == [(4, "VALID"), (8, None)] and run.calls == [4, 8]
    assert tries[1]["ttft_p99_ms"] is None and tries[1]["tokens_per_s"] is None  # no nonsense numbers
    assert "the search stopped after 2 new finished tries" in caplog.text  # as many as were appended
    resume = caplog.text.split("go on with:\n  ")[1].splitlines()[0]
    assert find_qps.main(shlex.split(resume)[4:]) == 0
    assert run.calls[2] == 8  # (VALID 4, INVALID none): the failed 8 again, not the midpoint of 4 and 8
    assert "lowest INVALID 8" not in caplog.text


def test_try_from_record_of_a_failed_run_has_no_latencies():
    rec = {"validity": "INVALID", "tokens_per_s": 9.9e9, "loadgen": {
        "result_first_token_99.00_percentile_latency_ns": 5.57e18,
        "result_time_per_output_token_99.00_percentile_ns": 1e15}}
    t = find_qps.try_from_record(8.0, rec, False, "f", 1.0, "run failed")
    assert (t.validity, t.ttft_p99_ms, t.tpot_p99_ms, t.tokens_per_s) == (None, None, None, None)
    assert find_qps.try_from_record(8.0, rec, True, "f", 1.0).ttft_p99_ms == 5.57e12  # a finished run keeps them


# ----------------------------------------------------------------------------- only performance tries
@pytest.mark.parametrize("mode", ["--fresh-process", "--one-process"])
@pytest.mark.parametrize("run_arg,named", [(["--mode", "accuracy", "--no-accuracy-gate"], "--mode accuracy"),
                                           (["--compliance-test", "TEST06"], "--compliance-test TEST06")])
def test_a_try_that_is_not_a_performance_run_is_refused_before_any_try(tmp_path, monkeypatch, capsys, synthetic_small,
                                                                        mode, run_arg, named):
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    monkeypatch.setattr(find_qps.OneProcessTries, "__call__", lambda *a: pytest.fail("a try started"))
    args = [x for x in _args(tmp_path, synthetic_small[0], "--start", "4") if x != "--fresh-process"]
    args.insert(args.index("--"), mode)
    rc = find_qps.main([*args, *run_arg])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and "performance run" in err, err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- --resume A --log B
def test_resume_into_another_log_copies_the_earlier_tries_there_first(tmp_path, monkeypatch, capsys,
                                                                      synthetic_small):
    run = fake_run()
    monkeypatch.setattr(find_qps, "sut_try", run)
    first = tmp_path / "a.jsonl"
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--start", "4", "--max-runs", "2", "--log",
                               str(first))) == 0
    b = tmp_path / "sub" / "b.jsonl"
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--resume", str(first), "--log", str(b), "--max-runs",
                               "0")) == 0  # no new try: B still gets A's tries, and the command names B
    resume = capsys.readouterr().out.split("go on with:\n  ")[-1].splitlines()[0]
    assert shlex.split(resume)[shlex.split(resume).index("--resume") + 1] == str(b)
    assert [t["qps"] for t in _tries(b)] == [4, 8]
    b.unlink()
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--resume", str(first), "--log", str(b), "--max-runs",
                               "1")) == 0
    assert [t["qps"] for t in _tries(b)] == [4, 8, 16] and [t["qps"] for t in _tries(first)] == [4, 8]
    with pytest.raises(SystemExit) as e:  # B holds tries of its own now: going on from A into it is refused
        find_qps.main(_args(tmp_path, synthetic_small[0], "--resume", str(first), "--log", str(b)))
    assert e.value.code == 2 and f"--log {b} already holds tries" in capsys.readouterr().err
    assert run.calls == [4, 8, 16]


# ----------------------------------------------------------------------------- --timeout-s
def test_run_with_timeout_kills_the_whole_process_group_after_the_grace(tmp_path):
    """A child that ignores SIGTERM, with a grandchild in its process group: both are gone after the grace."""
    marker = tmp_path / "grandchild-marker"
    t0 = time.monotonic()
    rc, err = sut_runs.run_with_timeout(["bash", "-c", f"trap '' TERM; exec -a {marker} sleep 300 & sleep 300"], 1.0,
                                        grace_s=1.0)
    assert rc is None and err.strip().endswith("timed out after 1 s: killed (SIGKILL) 1 s after SIGTERM"), err
    assert time.monotonic() - t0 < 10
    time.sleep(0.5)
    assert not _pids(str(marker))


def test_run_with_timeout_stops_with_sigterm_first():
    rc, err = sut_runs.run_with_timeout(["bash", "-c", "trap 'echo stopping >&2; exit 130' TERM; sleep 300 & wait"],
                                        1.0, grace_s=30.0)
    assert rc is None and "stopping" in err and err.strip().endswith("timed out after 1 s: stopped (SIGTERM)"), err


def test_a_long_run_says_every_heartbeat_that_it_still_runs_with_its_last_line(caplog):
    """bench_suts / find_qps --fresh-process were silent for the minutes a run takes."""
    caplog.set_level("INFO", logger="sut.run.child")
    rc, err = sut_runs.run_with_timeout(["bash", "-c", "sleep 0.6; echo 'engine 0 ready' >&2; sleep 1.6"], 30,
                                        heartbeat_s=0.4, label="r1")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("r1: still running")]
    assert rc == 0 and err == "engine 0 ready\n" and 3 <= len(lines) <= 6, lines
    assert lines[0].endswith("(nothing logged yet)") and lines[-1].endswith("(last line: engine 0 ready)")
    caplog.clear()
    assert sut_runs.run_with_timeout(["true"], 30, heartbeat_s=0.4)[0] == 0 and not caplog.records


def test_ctrl_c_while_a_run_is_in_its_own_session_stops_that_run_too(tmp_path, monkeypatch, caplog):
    """The run has a session of its own (the terminal's Ctrl-C does not reach it): the script stops it, and says
    how long that may take (a recheck's find: up to the grace in silence)."""
    marker = tmp_path / "run-marker"
    real_wait = subprocess.Popen.wait

    def interrupted_wait(self, timeout=None):
        if timeout is not None and timeout > 100:  # the wait for the run itself, not the grace wait
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        sut_runs.run_with_timeout(["bash", "-c", f"exec -a {marker} sleep 300"], 3600.0, grace_s=5.0)
    time.sleep(0.5)
    assert not _pids(str(marker))
    assert "stopping the running try" in caplog.text and "up to 5 s for its engine to shut down" in caplog.text


def test_a_second_ctrl_c_during_the_grace_still_kills_the_run_group(tmp_path, monkeypatch):
    """Ctrl-C, then again while the grace runs: a run that ignores SIGTERM and its group are still killed."""
    marker = tmp_path / "run-marker"
    real_wait = subprocess.Popen.wait

    def interrupted_wait(self, timeout=None):
        if timeout is not None:  # the run's own wait and the grace wait: a Ctrl-C during each
            time.sleep(1.0)  # the run has set its TERM trap
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        sut_runs.run_with_timeout(["bash", "-c", f"trap '' TERM; exec -a {marker} sleep 120 & wait"], 3600.0,
                                  grace_s=5.0)
    time.sleep(0.5)
    assert not _pids(str(marker))


@pytest.mark.slow
def test_sigterm_of_a_fresh_process_search_stops_its_run_and_the_server_it_started(tmp_path, synthetic_small):
    """`timeout 12 find_qps.py --fresh-process ...` (SIGTERM to the script's group, which the run, in a session of
    its own, is not in): the script stops the run, the run its server; nothing is left running."""
    server = tmp_path / "stalling_server.py"
    server.write_text((REPO / "tests" / "fake_vllm_server.py").read_text())
    runs = tmp_path / "runs"
    cmd = ["timeout", "12", sys.executable, "-m", "sut", "find-qps", "--fresh-process", "--scenario", "Server",
           "--start", "20", "--min-duration-s", "2", "--min-query-count", "40", "--max-runs", "1", "--output-dir",
           str(runs), "--", "--sut", "vllm-http", "--option", f"server_command={sys.executable} {server} --delay 3000",
           "--user-conf", str(CPU_CONF), "--model", str(TINY_MODEL), "--max-model-len", "4096",
           "--dataset", str(synthetic_small[0]), "--max-samples", "8"]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        time.sleep(1)
        assert out.returncode == 124 and "interrupted (SIGTERM)" in out.stderr, out.stderr[-2000:]  # 124: timeout's
        assert not _pids(str(server)) and not _pids(f"--output-dir {runs}")
        assert [json.loads(p.read_text())["status"] for p in runs.glob("*/run.json")] == ["failed"]
    finally:
        for pid in _pids(str(server)) | _pids(f"--output-dir {runs}"):
            subprocess.run(["kill", "-9", str(pid)])


def test_run_once_records_a_run_killed_while_running_as_failed(tmp_path, monkeypatch):
    """A run killed after the grace never wrote its end: its run.json says failed with the time-out."""
    def killed(cmd, timeout_s, **_):
        (tmp_path / "r-1").mkdir()
        (tmp_path / "r-1" / "run.json").write_text(json.dumps({"status": "running"}))
        return None, "...\ntimed out after 5 s: killed (SIGKILL) 60 s after SIGTERM\n"
    monkeypatch.setattr(sut_runs, "run_with_timeout", killed)
    o = sut_runs.run_once([], tmp_path, "r-1", 5.0)
    rec = json.loads((tmp_path / "r-1" / "run.json").read_text())
    assert o.rc is None and rec == o.record and rec["status"] == "failed"
    assert rec["error"] == "TimeoutError: timed out after 5 s: killed (SIGKILL) 60 s after SIGTERM"


def test_run_once_records_a_run_killed_after_ctrl_c_as_interrupted(tmp_path, monkeypatch):
    """Ctrl-C of a --fresh-process search while the try waited for LoadGen's Server schedule;
    the try was killed after the grace and its run.json stayed "running". A run that recorded itself is left alone."""
    for name, rec in (("r-killed", {"status": "running"}), ("r-recorded", {"status": "failed", "error": "its own"})):
        def stopped(cmd, timeout_s, name=name, rec=rec, **_):
            (tmp_path / name).mkdir()
            (tmp_path / name / "run.json").write_text(json.dumps(rec))
            raise KeyboardInterrupt
        monkeypatch.setattr(sut_runs, "run_with_timeout", stopped)
        with pytest.raises(KeyboardInterrupt):
            sut_runs.run_once([], tmp_path, name, 5.0)
    killed = json.loads((tmp_path / "r-killed" / "run.json").read_text())
    assert (killed["status"], killed["error"]) == ("failed", "interrupted (SIGINT, Ctrl-C)") and killed["finished"]
    assert json.loads((tmp_path / "r-recorded" / "run.json").read_text()) == {"status": "failed", "error": "its own"}


@pytest.mark.slow
def test_fresh_process_try_past_its_timeout_leaves_no_server_and_no_running_record(tmp_path, caplog):
    server = tmp_path / "fake_vllm_server.py"
    shutil.copy(REPO / "tests" / "fake_vllm_server.py", server)
    data = tmp_path / "ds.json"
    data.write_text(json.dumps([{"instruction": "x", "input": "y", "tok_input": [128000, 10 + i, 11, 12],
                                 "output": "z"} for i in range(8)]))
    t0 = time.monotonic()
    try:
        rc = find_qps.main(["--fresh-process", "--timeout-s", "8", "--scenario", "Server", "--start", "20",
                            "--min-duration-s", "2", "--min-query-count", "40", "--max-runs", "2", "--output-dir",
                            str(tmp_path / "runs"), "--", "--sut", "vllm-http", "--option",
                            f"server_command={sys.executable} {server} --delay 1000", "--user-conf", str(CPU_CONF),
                            "--model", str(TINY_MODEL), "--max-model-len", "4096", "--dataset", str(data)])
        time.sleep(1)
        left = _pids(str(server))
    finally:
        for pid in _pids(str(server)):
            subprocess.run(["kill", "-9", str(pid)])
    assert rc == 1 and not left, f"server(s) left running: {left}"
    assert time.monotonic() - t0 < sut_runs.TIMEOUT_GRACE_S  # stopped by SIGTERM, not killed after the grace
    (rec,) = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/run.json")]
    assert rec["status"] == "failed" and "interrupted" in rec["error"], rec.get("error")
    (t,) = _tries(tmp_path / "runs" / "tries-Server.jsonl")
    assert t["validity"] is None and "timed out after 8 s: stopped (SIGTERM) (--timeout-s)" in t["note"], t
    assert "search failed: timed out after 8 s" in caplog.text


# ----------------------------------------------------------------------------- --log that cannot be written
@pytest.mark.parametrize("where", ["folder", "under a file"])
def test_a_log_that_cannot_be_written_is_refused_before_any_try(tmp_path, monkeypatch, capsys, synthetic_small,
                                                                where):
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    (tmp_path / "f").write_text("")
    bad = {"folder": tmp_path, "under a file": tmp_path / "f" / "tries.jsonl"}[where]
    with pytest.raises(SystemExit) as e:
        find_qps.main(_args(tmp_path, synthetic_small[0], "--start", "4", "--log", str(bad)))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--log {bad}" in err and ("not a folder" in err or "not a file" in err), err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- target_qps above the 1e7 cap
def test_a_search_whose_next_rate_is_above_the_cap_stops_with_exit_1_and_no_resume_hint(tmp_path, monkeypatch,
                                                                                        capsys, caplog,
                                                                                        synthetic_small):
    run = fake_run(limit=1e300)
    monkeypatch.setattr(find_qps, "sut_try", run)
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--start", "200000", "--factor", "100")) == 1
    assert run.calls == [200000]
    text = caplog.text + capsys.readouterr().out
    assert "above the 1e+07" in text and "highest VALID 200000" in text and "go on with" not in text, text
    assert "Traceback" not in text


def test_a_search_that_ran_out_of_tries_just_below_the_cap_prints_no_resume_hint(tmp_path, monkeypatch, capsys,
                                                                                 caplog, synthetic_small):
    monkeypatch.setattr(find_qps, "sut_try", fake_run(limit=1e300))
    assert find_qps.main(_args(tmp_path, synthetic_small[0], "--start", "200000", "--factor", "100", "--max-runs",
                               "1")) == 0
    out = capsys.readouterr().out
    assert "go on with" not in out and "above the 1e+07" in out, out


@pytest.mark.parametrize("start", [None, "2e7"])
def test_a_rate_above_the_cap_in_the_resume_file_or_start_is_refused_before_any_try(tmp_path, monkeypatch, capsys,
                                                                                    synthetic_small, start):
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    first = tmp_path / "a.jsonl"
    args = _args(tmp_path, synthetic_small[0], "--start", "4", "--max-runs", "0")
    settings = {"scenario": "Server", "min_duration_s": 30.0, "min_query_count": 1000,
                "run_args": args[args.index("--") + 1:]}
    first.write_text(json.dumps({"qps": 4, "validity": "INVALID", "settings": settings}) + "\n"
                     + json.dumps({"qps": 1e300, "validity": "VALID", "settings": settings}) + "\n")
    extra = ["--start", start] if start else ["--resume", str(first)]
    with pytest.raises(SystemExit) as e:
        find_qps.main(_args(tmp_path, synthetic_small[0], *extra))
    err = capsys.readouterr().err
    named = "--start 2e+07" if start else f"{first} line 2"
    assert e.value.code == 2 and named in err and "1e+07" in err, err
