"""A failed or stopped Server run whose LoadGen schedule runs on (LoadGen 6.0.17 has no abort) exits promptly
with its own code (1 failed, 130 stopped), never "terminate called without an active exception" (134) or a
segfault; `--target-qps` values LoadGen cannot run sensibly are refused with exit 2.

The runs use the fake vLLM server (tests/fake_vllm_server.py) behind --sut vllm-http, min duration 300 s
(longer than the drain limit) and the streaming drain grace lowered to 2 s
(``sut.run.loadgen_watch.STREAMING_DRAIN_S``; ``LOADGEN_DRAIN_S`` as shipped, or 5 s where said), so that a run
that waits for LoadGen's schedule or for the full drain limit times out."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import mlperf_loadgen as lg
import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL

from sut.errors import InputError
from sut.settings.loadgen import OFFLINE_MAX_QUERY_SAMPLES, SERVER_MAX_QUERIES, check_target_qps
from sut.settings.run import RunSettings

# STREAMING_DRAIN_S lowered: without the fix the run waits LOADGEN_DRAIN_S (120 s) and the test times out.
PROMPT = "import sut.run.loadgen_watch as w; w.STREAMING_DRAIN_S = 2.0"
# the set-up: a 5 s drain limit that the run reaches with LoadGen's thread still running
DRAIN_5 = "import sut.run.loadgen_watch as w; w.LOADGEN_DRAIN_S = 5.0"
RUN = "; import sys; from sut.cli import main; sys.exit(main(sys.argv[1:]))"
FIND_QPS = "; import sys; from sut.cli import main; sys.exit(main(['find-qps', *sys.argv[1:]]))"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/fake_vllm_server.py"), "--model", str(TINY_MODEL),
                             "--port", str(port), "--delay", "0.05"], cwd=REPO)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def dataset(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps([{"instruction": "x", "input": "y", "tok_input": [128000, 10 + i, 11, 12], "output": "z"}
                             for i in range(8)]))
    return p


def _run_args(url, dataset, out, *extra):
    """``sut run``'s flags over the fake server; ``out`` None: no ``--output-dir`` (find-qps sets each try's)."""
    where = [] if out is None else ["--output-dir", str(out)]
    return ["--sut", "vllm-http", "--server-url", url, "--model", str(TINY_MODEL), "--max-model-len", "4096",
            "--no-progress", "--user-conf", str(CPU_CONF), "--dataset", str(dataset), *where, *extra]


def _stop_mid_run(cmd, log, server, how, timeout=45, started="LoadGen Server"):
    """Start ``cmd``, wait until LoadGen's Server test runs (the console says ``started``), then stop it ``how``; ``(exit code, seconds from
    the stop to the exit, console text)``."""
    with open(log, "w") as fh:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while started not in log.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # queries flowing
        t0 = time.monotonic()
        if how == "server-killed":
            server.kill()
        else:
            run.send_signal(getattr(signal, how))
        rc = run.wait(timeout=timeout)
        return rc, time.monotonic() - t0, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


@pytest.mark.parametrize("how, want_rc", [("SIGINT", 130), ("SIGTERM", 130), ("server-killed", 1)])
def test_a_stopped_or_failed_server_run_exits_promptly_with_its_own_code(tmp_path, fake_server, dataset, how,
                                                                          want_rc):
    url, server = fake_server
    out = tmp_path / "runs"
    cmd = [sys.executable, "-c", PROMPT + RUN, "run", *_run_args(url, dataset, out, "--scenario", "Server",
           "--target-qps", "4", "--min-duration-s", "300", "--min-query-count", "1")]
    rc, took, text = _stop_mid_run(cmd, tmp_path / "console.txt", server, how)
    rec = json.loads(next(out.glob("*/run.json")).read_text())
    assert rec["status"] == "failed" and "LoadGen did not return within 2 s" in rec["error"], rec.get("error")
    assert ("interrupted (" in rec["error"]) == (want_rc == 130)
    assert "terminate called" not in text and rc == want_rc, (rc, text[-1500:])
    assert took < 30 and "still runs (it cannot be stopped); exiting with code" in text


def test_the_drain_limit_reached_exits_1_not_134(tmp_path, fake_server, dataset):
    url, server = fake_server
    out = tmp_path / "runs"
    cmd = [sys.executable, "-c", DRAIN_5 + RUN, "run", *_run_args(url, dataset, out, "--scenario", "Server",
           "--target-qps", "4", "--min-duration-s", "300", "--min-query-count", "1")]
    rc, took, text = _stop_mid_run(cmd, tmp_path / "console.txt", server, "server-killed")
    assert json.loads(next(out.glob("*/run.json")).read_text())["status"] == "failed"
    assert "terminate called" not in text and rc == 1, (rc, text[-1500:])


def test_find_qps_one_process_try_that_fails_exits_1_promptly(tmp_path, fake_server, dataset):
    url, server = fake_server
    out = tmp_path / "search"
    cmd = [sys.executable, "-c", PROMPT + FIND_QPS, "--scenario", "Server", "--start", "4", "--max-runs", "2",
           "--min-duration-s", "300", "--min-query-count", "1", "--output-dir", str(out), "--",
           *_run_args(url, dataset, None, "--max-samples", "1")]
    # (find_qps logs no "LoadGen Server" line: its try's compliance line comes just before LoadGen starts)
    rc, took, text = _stop_mid_run(cmd, tmp_path / "console.txt", server, "server-killed",
                                   started="try 1 of a one-process target_qps search")
    recs = [json.loads(p.read_text()) for p in out.rglob("run.json")]
    assert [r["status"] for r in recs] == ["failed"] and "LoadGen did not return within 2 s" in recs[0]["error"], recs
    assert "terminate called" not in text and rc == 1, (rc, text[-1500:])
    assert took < 30


#: A server launcher (``server_command``) whose process group keeps a member that ignores SIGTERM (a vLLM engine
#: slow to shut down): it writes that member's pid to ``$1``, then runs the fake server in its place.
_SLOW_TO_END = """#!/bin/bash
pidfile=$1; shift
(trap '' TERM; exec sleep 300) &
echo $! > "$pidfile"
exec {python} {server} "$@"
"""


def test_a_stop_signal_while_a_failed_run_ends_its_servers_ends_them_all_and_exits_130(tmp_path, dataset):
    """A Server run whose server died is ending its servers (after the drain, LoadGen's schedule still running) when
    Ctrl-C comes: the ending goes on to SIGKILL (here after the 6 s grace) and the run exits 130 naming the dead
    server. The stop used to cut the ending short: the group's SIGTERM-deaf member outlived the run, and the process
    exited under LoadGen's thread (a segfault)."""
    from conftest import process_ended

    launcher, pidfile, out, log = tmp_path / "serve.sh", tmp_path / "member.pid", tmp_path / "runs", tmp_path / "c.txt"
    launcher.write_text(_SLOW_TO_END.format(python=sys.executable, server=REPO / "tests/fake_vllm_server.py"))
    launcher.chmod(0o755)
    grace = "; import sut.core.transports.http_servers as h; h.end.__defaults__ = (6.0,)"
    cmd = [sys.executable, "-c", PROMPT + grace + RUN, "run", "--sut", "vllm-http", "--option",
           f"server_command={launcher} {pidfile} --delay 0.2", "--model", str(TINY_MODEL), "--max-model-len", "4096",
           "--no-progress", "--user-conf", str(CPU_CONF), "--dataset", str(dataset), "--output-dir", str(out),
           "--scenario", "Server", "--target-qps", "4", "--min-duration-s", "300", "--min-query-count", "1"]
    with open(log, "w") as fh:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    member = None
    try:
        for text in ("LoadGen Server", "LoadGen did not return within"):
            deadline = time.monotonic() + 90
            while text not in log.read_text():
                assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            if member is None:
                member = int(pidfile.read_text())
                time.sleep(2)  # queries flowing
                server = int(re.search(r"server 0 starting: pid (\d+)", log.read_text()).group(1))
                os.kill(server, signal.SIGKILL)  # its launcher's pid: the fake server exec'd in its place
        time.sleep(1)  # the servers' ending under way: the member ignores its SIGTERM
        run.send_signal(signal.SIGINT)
        rc = run.wait(timeout=60)
        ended = process_ended(member)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if member is not None and not process_ended(member):
            os.kill(member, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130 and "terminate called" not in text, (rc, text[-2000:])
    assert ended, "the server's SIGTERM-deaf group member outlived the run"
    rec = json.loads(next(out.glob("*/run.json")).read_text())
    assert rec["status"] == "failed" and "vllm-http server 0" in rec["error"], rec.get("error")


def test_a_server_run_that_ends_normally_still_exits_0(tmp_path, fake_server, dataset):
    url, _ = fake_server
    out = tmp_path / "runs"
    cmd = [sys.executable, "-c", PROMPT + RUN, "run", *_run_args(url, dataset, out, "--scenario", "Server",
           "--target-qps", "20", "--min-duration-s", "1", "--min-query-count", "20")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    assert json.loads(next(out.glob("*/run.json")).read_text())["status"] == "ok"
    assert "still runs" not in done.stdout + done.stderr


# ----------------------------------------------------------------------------- target_qps sanity
# (check_target_qps on settings made here: a second FromConfig in this process would skip mlperf.conf for the
# tests after this one; the effective user.conf value is checked through the command line below)
def _ts(scenario, qps, min_duration_s=600.0, min_query_count=1):
    ts = lg.TestSettings()
    ts.scenario = getattr(lg.TestScenario, scenario)
    ts.server_target_qps = ts.offline_expected_qps = qps
    ts.min_duration_ms, ts.min_query_count = int(min_duration_s * 1000), min_query_count
    return ts


def _rs(**kw):
    return RunSettings(sut="vllm-http", dataset="unused.json", **kw)


def test_a_streaming_target_qps_slower_than_the_stall_timeout_is_refused():
    with pytest.raises(InputError, match=r"^user.conf: target_qps 1e-06 queries/s .* stall timeout 300 s; use at "
                                         r"least 0.0033$"):
        check_target_qps(_ts("Server", 1e-6), _rs(scenario="Server"), "user.conf")
    with pytest.raises(InputError, match=r"target_qps 0.001 queries/s means one query every 1000 s on average"):
        check_target_qps(_ts("Server", 0.001), _rs(scenario="Interactive", stall_timeout_s=600), "--target-qps")
    check_target_qps(_ts("Server", 0.002), _rs(scenario="Interactive", stall_timeout_s=600), "x")  # 500 s: allowed


def test_an_offline_query_over_100_times_the_dataset_is_refused():
    assert OFFLINE_MAX_QUERY_SAMPLES == 1_336_800
    with pytest.raises(InputError, match=r"--target-qps: Offline target_qps 1e\+07 samples/s .* 1,336,800 allowed"):
        check_target_qps(_ts("Offline", 1e7), _rs(), "--target-qps")
    with pytest.raises(InputError, match=r"Offline target_qps 2100 samples/s x min duration 600 s makes a query of "
                                         r"about 1,386,000 samples"):
        check_target_qps(_ts("Offline", 2100), _rs(), "user.conf")
    with pytest.raises(InputError, match=r"about 2,000,000 samples \(min_query_count 2000000\)"):
        check_target_qps(_ts("Offline", 1, min_query_count=2_000_000), _rs(), "user.conf")
    check_target_qps(_ts("Offline", 2000), _rs(), "x")  # 1,320,000 samples: allowed
    check_target_qps(_ts("Offline", 1e7), _rs(mode="accuracy"), "x")  # accuracy: one query of the dataset


def test_a_server_schedule_over_100_times_the_dataset_is_refused_and_a_long_one_warned(caplog):
    """Server target_qps 1e9 in user.conf (1e7 on the command line) was accepted, and LoadGen, which
    builds the whole schedule first, grew the harness past 6 GB in 20 s with nothing issued."""
    assert SERVER_MAX_QUERIES == 1_336_800
    with pytest.raises(InputError, match=r"^user.conf: target_qps 1e\+09 queries/s x min duration 10 s makes about "
                                         r"10,000,000,000 queries .* 1,336,800 allowed .* before it issues the first$"):
        check_target_qps(_ts("Server", 1e9, min_duration_s=10), _rs(scenario="Server"), "user.conf")
    with pytest.raises(InputError, match=r"target_qps 2229 queries/s x min duration 600 s makes about 1,337,400"):
        check_target_qps(_ts("Server", 2229), _rs(scenario="Interactive"), "--target-qps")
    caplog.set_level("WARNING", logger="sut.settings.loadgen")
    check_target_qps(_ts("Server", 2228), _rs(scenario="Server"), "x")  # 1,336,800 queries: allowed
    check_target_qps(_ts("Server", 1e7), _rs(scenario="Server", mode="accuracy"), "x", samples=13_368)  # each once
    assert not caplog.records
    check_target_qps(_ts("Server", 0.001), _rs(scenario="Server", mode="accuracy", stall_timeout_s=1800), "x",
                     samples=64)
    check_target_qps(_ts("Server", 0.02, min_query_count=100), _rs(scenario="Server"), "y")  # 5,000 s
    check_target_qps(_ts("Server", 0.5, min_query_count=100), _rs(scenario="Server"), "z")  # 600 s: quiet
    check_target_qps(_ts("Server", 0.01, min_duration_s=10), _rs(scenario="Server"), "q")  # 10 s + 100 s: quiet
    check_target_qps(_ts("Server", 0.001, min_duration_s=10), _rs(scenario="Interactive", stall_timeout_s=1800),
                     "w")  # 10 s + 1,000 s
    assert [r.getMessage() for r in caplog.records] == [
        "x: target_qps 0.001 queries/s: LoadGen issues its 64 queries over about 17.8 h",
        "y: target_qps 0.02 queries/s: LoadGen issues its 100 queries over about 1.4 h",
        "w: target_qps 0.001 queries/s: LoadGen issues its 1 queries over about 17 min"]


@pytest.mark.parametrize("scenario, conf_line, flags, message", [
    ("Server", "llama3_1-8b.Server.target_qps = 0.0001", [], "user.conf: target_qps 0.0001 queries/s"),
    ("Server", "llama3_1-8b.Server.target_qps = 1e9", [], "user.conf: target_qps 1e+09 queries/s x min duration"),
    ("Offline", None, ["--target-qps", "1e7"], "--target-qps: Offline target_qps 1e+07 samples/s")])
def test_a_refused_target_qps_exits_2_before_the_run_folder(tmp_path, fake_server, dataset, scenario, conf_line,
                                                           flags, message):
    url, _ = fake_server
    out = tmp_path / "runs"
    args = _run_args(url, dataset, out, "--scenario", scenario, *flags)
    if conf_line:
        conf = tmp_path / "user.conf"
        conf.write_text(conf_line + "\n")
        args[args.index(str(CPU_CONF))] = str(conf)
    done = subprocess.run([sys.executable, "-m", "sut", "run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr + done.stdout, done.stderr[-1500:]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("raise_after", ["OSError('disk full')", "SystemExit(3)"])
def test_an_unmapped_error_after_leave_without_cleanup_still_leaves_by_os_exit(raise_after):
    """A thread that cannot be stopped was reported, then the command raises something outside the exit-code map
    (a full disk while writing run.json): the process must still end by ``os._exit`` (a normal interpreter exit
    would crash under LoadGen's thread), with 1 (or SystemExit's code) and the traceback logged."""
    code = ("import logging, sys, threading; logging.basicConfig(); from sut import exits\n"
            "class Guard:  # stands for LoadGen's objects: a normal exit runs this and prints the marker\n"
            "    def __del__(self): print('NORMAL-EXIT', flush=True)\n"
            "g = Guard()\n"
            "def fn():\n"
            "    exits.leave_without_cleanup('LoadGen StartTest thread')\n"
            f"    raise {raise_after}\n"
            "exits.run_main(fn)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == (3 if "SystemExit" in raise_after else 1), p.stderr
    assert "NORMAL-EXIT" not in p.stdout and "still runs" in p.stderr
    assert "OSError" in p.stderr or "SystemExit" in p.stderr


def test_drain_limit_counts_the_queries_equal_issue_adds():
    """A Server try of min_query_count 480 over a 64-sample QSL issues 512 queries (equal issue): stopped
    130 s into a 2 queries/s schedule, 126 s of it remain, more than the 120 s LoadGen may run on, so the
    harness waits only the 10 s grace (it waited the full 120 s when it counted 480 queries)."""
    import mlperf_loadgen as lg

    from sut.run.loadgen_watch import LOADGEN_DRAIN_S, STREAMING_DRAIN_S, drain_limit_s
    from sut.settings.loadgen import scheduled_queries

    ts = lg.TestSettings()
    ts.scenario, ts.min_query_count, ts.server_target_qps, ts.min_duration_ms = lg.TestScenario.Server, 480, 2.0, 10_000
    ts.sample_concatenate_permutation = True
    assert scheduled_queries(ts, 64) == 512 and scheduled_queries(ts, 0) == 480
    assert drain_limit_s(ts, True, 130.0, 64) == STREAMING_DRAIN_S
    assert drain_limit_s(ts, True, 200.0, 64) == STREAMING_DRAIN_S + 56.0
    ts.sample_concatenate_permutation = False
    assert drain_limit_s(ts, True, 130.0, 64) == STREAMING_DRAIN_S + 110.0 <= LOADGEN_DRAIN_S


def test_a_stop_signal_after_loadgen_returned_is_recorded_like_any_other_stop(tmp_path):
    """SIGTERM right after LoadGen's test ended reaches ``record_failure``: the record says "interrupted
    (SIGTERM)" as everywhere else, not "KeyboardInterrupt: SIGTERM"."""
    from sut.run.harness import record_failure

    rec = {"status": "running"}
    record_failure(tmp_path, rec, KeyboardInterrupt("SIGTERM"))
    assert rec["status"] == "failed" and rec["error"] == "interrupted (SIGTERM)"
    rec = {"status": "running"}
    record_failure(tmp_path, rec, RuntimeError("boom"))
    assert rec["error"] == "RuntimeError: boom"


def test_a_run_folder_that_refuses_writes_ends_the_run_with_its_cause_not_a_traceback(tmp_path, monkeypatch):
    """A run folder turned read-only (or immutable) mid-run: the last run.json write fails with EPERM/EROFS. The run
    ends with RunFailed (exit 1, one error line) naming the folder, the file and that run.json could not record it;
    an OSError about a file elsewhere is raised as it was (a crash of its own, not the folder's)."""
    import errno

    from sut.errors import RunFailed
    from sut.run import harness

    (tmp_path / "run.json").write_text(json.dumps({"status": "running"}))

    def refuse(run_dir, record):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(run_dir / "run.json.tmp"))

    monkeypatch.setattr(harness, "write_final_record", refuse)
    e = PermissionError(errno.EPERM, "Operation not permitted", str(tmp_path / "run.json.tmp"))
    with pytest.raises(RunFailed, match=r"cannot write in the run folder .*: Operation not permitted "
                                        r"\(.*run.json.tmp\); run.json could not record \(it may still say "
                                        r"'running'\) the failure"):
        harness.raise_recorded(tmp_path, {"status": "ok"}, e)
    elsewhere = PermissionError(errno.EACCES, "Permission denied", "/elsewhere/model/config.json")
    with pytest.raises(PermissionError):
        harness.raise_recorded(tmp_path, {"status": "ok"}, elsewhere)


def test_a_failed_run_has_no_validity_and_keeps_loadgens_word_apart():
    from sut.run.harness import mark_failed

    rec = {"status": "running", "validity": "VALID", "samples_per_s": 3.86, "tokens_per_s": 400.0}
    mark_failed(rec, "interrupted (SIGINT, Ctrl-C)")
    assert rec == {"status": "failed", "error": "interrupted (SIGINT, Ctrl-C)", "validity": None, "samples_per_s": None,
                   "tokens_per_s": None, "loadgen_validity": "VALID", "loadgen_samples_per_s": 3.86,
                   "loadgen_tokens_per_s": 400.0}
    early = {"status": "running"}  # failed before LoadGen reported anything
    mark_failed(early, "x")
    assert early == {"status": "failed", "error": "x"}


def test_a_stop_signal_during_the_accuracy_gate_leaves_a_complete_run_to_score_not_a_running_one(tmp_path, monkeypatch):
    """SIGTERM while the gate scored 13,368 samples exited 130 with run.json still "running"; a
    recheck's: marked "failed", the run could never be packaged even after the re-score it suggested. The LoadGen
    run is complete: status ok, accuracy skipped with the exact re-score command (the run's tokenizer)."""
    import json

    import sut.run.harness as harness
    from sut.engine import EngineSettings
    from sut.settings.run import RunSettings

    def interrupted(*a, **k):
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(harness, "accuracy_gate_record", interrupted)
    tok = tmp_path / "tok"
    rs = RunSettings(sut="vllm", dataset="data.json", output_dir=str(tmp_path), mode="accuracy", tokenizer=str(tok),
                     max_samples=8)
    rec = {"status": "running", "validity": None}
    with pytest.raises(KeyboardInterrupt):
        harness._finish(rs, EngineSettings(model="m"), None, None, tmp_path, rec, None)
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["finished"]
    assert on_disk["accuracy"]["skipped"] == (
        "interrupted (SIGTERM) during the accuracy gate; the LoadGen run is complete: score it with python -m accuracy "
        f"--accuracy-log {tmp_path / 'mlperf_log_accuracy.json'} --dataset data.json --tokenizer {tok} --max-samples 8")


# ----------------------------------------------------------------------------- a full file system
# One write of run.json fails as on a full disk: an empty run.json.tmp is left and ENOSPC raised (the last
# record, status "ok"; every later write finds room again).
NO_SPACE_AT_LAST_RECORD = """
import errno, pathlib
write_text = pathlib.Path.write_text
def full_once(self, data, *a, **k):
    if self.name == "run.json.tmp" and '"status": "ok"' in data and not getattr(full_once, "done", False):
        full_once.done = True
        open(self, "w").close()
        raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return write_text(self, data, *a, **k)
pathlib.Path.write_text = full_once
"""


def _no_leftovers(out):
    return sorted(str(p) for p in out.rglob("*") if p.name.endswith(".tmp") or p.name == ".run.json.reserve")


def test_a_full_disk_at_the_last_record_is_recorded_failed_with_the_cause(tmp_path, fake_server, dataset):
    """Before: a traceback, rc 1, run.json still "running" and a 0-byte run.json.tmp left."""
    url, _ = fake_server
    out = tmp_path / "runs"
    cmd = [sys.executable, "-c", NO_SPACE_AT_LAST_RECORD + RUN.lstrip("; "), "run", *_run_args(url, dataset, out, "--quick")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert "no space left on device writing" in text
    rec = json.loads(next(out.glob("*/run.json")).read_text())
    assert rec["status"] == "failed" and rec["error"].startswith("no space left on device writing "), rec.get("error")
    assert rec["error"].endswith("run.json.tmp (the run folder's file system is full)")
    assert _no_leftovers(out) == []


# The run folder is removed (rm -rf by hand, a cleanup job) just before the last record is written.
FOLDER_GONE_AT_LAST_RECORD = """
import pathlib, shutil
write_text = pathlib.Path.write_text
def gone(self, data, *a, **k):
    if self.name == "run.json.tmp" and '"status": "ok"' in data:
        shutil.rmtree(self.parent)
    return write_text(self, data, *a, **k)
pathlib.Path.write_text = gone
"""


def test_a_run_folder_removed_during_the_run_ends_it_with_one_error_line_not_a_traceback(tmp_path, fake_server,
                                                                                         dataset):
    url, _ = fake_server
    out = tmp_path / "runs"
    cmd = [sys.executable, "-c", FOLDER_GONE_AT_LAST_RECORD + RUN.lstrip("; "), "run",
           *_run_args(url, dataset, out, "--quick")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert re.search(r"the run folder \S+ was removed during the run: the run cannot be recorded \(FileNotFoundError",
                     text), text[-2000:]
    assert list(out.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 6 MiB tmpfs (root only; skipped elsewhere), unmounted after the test."""
    import os

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _fill(mnt):
    """Write zeros into ``mnt/filler`` until the file system is full."""
    import errno

    with open(mnt / "filler", "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    for size in (4096, 512, 1):  # the last partial blocks
        try:
            with open(mnt / "filler", "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * size)
        except OSError:
            pass


def test_a_disk_that_fills_during_a_run_ends_it_failed_and_a_full_one_refuses_to_start(tmp_path, fake_server,
                                                                                      dataset, small_tmpfs):
    """Before: the run that filled its disk ended with a traceback, run.json "running" and a 0-byte run.json.tmp;
    a run on a full disk failed with a traceback after making its folder."""
    url, _ = fake_server
    out = small_tmpfs / "runs"
    log = tmp_path / "console.txt"
    cmd = [sys.executable, "-c", PROMPT + RUN, "run", *_run_args(url, dataset, out, "--scenario", "Server",
           "--target-qps", "20", "--min-duration-s", "6", "--min-query-count", "20")]
    with open(log, "w") as fh:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "LoadGen Server" not in log.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        _fill(small_tmpfs)
        rc = run.wait(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    text = log.read_text()
    assert rc == 1 and "Traceback" not in text and "no space left on device writing" in text, text[-3000:]
    rec = json.loads(next(out.glob("*/run.json")).read_text())
    assert rec["status"] == "failed" and "the run folder's file system is full" in rec["error"], rec.get("error")
    assert _no_leftovers(out) == []
    _fill(small_tmpfs)  # what the removed temporary files freed
    again = subprocess.run([sys.executable, "-m", "sut", "run", *_run_args(url, dataset, small_tmpfs / "more", "--quick")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "No space left on device; a run needs 1 MiB free" in again.stderr, \
        again.stderr[-2000:]
    assert "Traceback" not in again.stderr and not list((small_tmpfs / "more").glob("*"))


def _loadgen_logs(run_dir, summary: bool = True, result: bool = True, accuracy: str = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if summary:
        (run_dir / "mlperf_log_summary.txt").write_text("Result is : VALID\n")
    if result:
        (run_dir / "mlperf_log_detail.txt").write_text(
            ':::MLLOG {"key": "result_validity", "value": "VALID"}\n')
    if accuracy is not None:
        (run_dir / "mlperf_log_accuracy.json").write_text(accuracy)


def test_loadgen_logs_that_went_missing_or_were_cut_off_fail_the_run(tmp_path):
    """LoadGen reports no write error: a disk that filled and freed during the run, or logs removed meanwhile,
    must not leave a run "ok" over a missing result or a cut-off accuracy log."""
    from sut.record.loadgen_log import parse_loadgen_detail
    from sut.run.harness import loadgen_logs_error

    def why(d, mode, issued=2):
        return loadgen_logs_error(_rs(mode=mode), d, parse_loadgen_detail(d / "mlperf_log_detail.txt"), issued)

    _loadgen_logs(tmp_path / "ok")
    assert why(tmp_path / "ok", "performance") is None
    _loadgen_logs(tmp_path / "no_detail", result=False)
    assert why(tmp_path / "no_detail", "performance").startswith("LoadGen's mlperf_log_detail.txt holds no result")
    _loadgen_logs(tmp_path / "no_summary", summary=False)
    assert why(tmp_path / "no_summary", "performance").startswith("LoadGen's mlperf_log_summary.txt is missing")
    entry = '{"seq_id": 0, "qsl_idx": %d, "data": "0A000000", "token_count": 1}'
    _loadgen_logs(tmp_path / "acc", accuracy="[" + ",".join(entry % i for i in range(2)) + "]")
    assert why(tmp_path / "acc", "accuracy") is None
    assert why(tmp_path / "acc", "accuracy", issued=3) == (
        "LoadGen's accuracy log holds 2 entries for 3 issued samples (missing, unreadable or cut off: a disk that "
        "filled or a run folder changed during the run?)")
    _loadgen_logs(tmp_path / "cut", accuracy="[" + entry % 0 + ', {"seq_id": 1, "qsl_idx" 1')
    assert why(tmp_path / "cut", "accuracy").startswith("LoadGen's accuracy log is missing, unreadable or cut off")
    _loadgen_logs(tmp_path / "none")
    assert why(tmp_path / "none", "accuracy").startswith("LoadGen's accuracy log is missing")


def test_two_runs_started_in_the_same_second_get_two_folders_and_a_named_one_is_never_reused(tmp_path, monkeypatch):
    import datetime as real_dt
    import types

    from sut.run import harness

    fixed = real_dt.datetime(2026, 12, 7, 5, 30, 0)
    monkeypatch.setattr(harness, "_dt", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: fixed)))
    rs = _rs(scenario="Offline", output_dir=str(tmp_path))
    first, second = harness._run_dir(rs, compliant=False), harness._run_dir(rs, compliant=False)
    assert first.name == "20261207-053000-vllm-http-Offline-performance-NOT-COMPLIANT"
    assert second.name == "20261207-053000-vllm-http-Offline-performance-2-NOT-COMPLIANT"
    named = _rs(scenario="Offline", output_dir=str(tmp_path), run_name="mine")
    assert harness._run_dir(named, compliant=True).name == "mine"
    with pytest.raises(InputError, match=r"run folder \S+/mine already exists \(choose another --run-name\)"):
        harness._run_dir(named, compliant=True)
