"""Through the Flame SUT: a full-size Offline query (mlperf.conf's 13,368 samples, equal
issue) fails before any sample completes. ``python -m sut run --sut flame`` against the stand-in
control plane with the fake engine and the fault hooks (tests/flame_doubles.py, through the transport's
extension points); batch 0's task fails on every attempt, so its task thread
fails the run and answers the whole outstanding query, then ends. Before the ledger's completer
thread that thread's ``QuerySamplesComplete`` crashed LoadGen (SIGSEGV, run.json "running", the
session never closed). Now: exit 1, run.json "failed" naming the batch, the session closed, every
executor released and no process of the run left."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time

import flamepy
import psutil
import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

from sut.flame import app as app_mod
from tests import flame_standin as standin
from tests.flame_doubles import fake_options

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _register_app(endpoint, tmp_path):
    doc = app_mod.render(workdir=str(tmp_path / "svc"))
    conn = flamepy.connect(endpoint)
    app_mod.register(conn, doc)
    conn.close()


def _fake_engine_options(tmp_path):
    """--option flags: the fake engine (10 s per batch) and an injected fault: batch 0's task raises on its
    first and its retried attempt."""
    faults = {"task_error": {"batches": [0], "times": 2}, "state_dir": str(tmp_path)}
    out = []
    for k, v in fake_options(step_s=10, faults=faults).items():
        out += ["--option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    return out


def test_flame_task_failure_on_a_full_size_query_fails_cleanly(tmp_path, synthetic_full):
    lock_dir = tempfile.mkdtemp(prefix="sef-", dir="/tmp")
    try:
        with standin.StandinCluster(tmp_path / "cluster", max_executors=4) as cluster:
            _register_app(cluster.endpoint, tmp_path)
            cmd = [sys.executable, "-m", "sut", "run", "--sut", "flame", "--flame-endpoint", cluster.endpoint,
                   "--dataset", str(synthetic_full), "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
                   "--no-progress", "--output-dir", str(tmp_path / "out"), "--run-name", "full",
                   *_fake_engine_options(tmp_path), "--option", f"lock_dir={lock_dir}",
                   "--option", "close_timeout_s=120", "--executors-per-engine", "2"]
            proc = subprocess.Popen(cmd, cwd=REPO, env=sut_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            children = []
            try:
                deadline = time.monotonic() + 600
                while proc.poll() is None and time.monotonic() < deadline:
                    children = _descendants(proc.pid) or children
                    time.sleep(0.5)
                out = proc.communicate(timeout=60)[0]
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 1, (proc.returncode, out[-3000:])
            run_dir = next((tmp_path / "out").glob("full*"))
            rec = json.loads((run_dir / "run.json").read_text())
            assert rec["status"] == "failed" and "batch 0" in rec["error"], rec.get("error")
            led = rec["ledger"]
            assert led["issued"] >= 13368 and led["completed"] + led["answered_empty"] == led["issued"], led
            assert led["answered_empty"] > 13000  # step_s=10: (nearly) no batch finished before the failure
            flame = rec["flame"]
            assert flame["close"].get("closed") is True, flame["close"]
            st = cluster.session_state(flame["session_id"])
            assert st["state"] == "Closed" and st["counts"]["Running"] == 0, st
            _wait(lambda: all(e["state"] == "Released" for e in cluster.executors()), 60, "executors released")
            _wait(lambda: not [c for c in children if _alive(c)], 30, "no process of the run left")
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for: {what}")
