"""The Flame service process and its parent, the executor manager (no Flame, no vLLM): a service whose executor
manager died stops by itself (``sut.flame.service.watch_parent``), also when the manager died while the service
was still importing (``python -m sut.flame.serve`` reads its parent's pid before the slow imports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import flamepy  # noqa: F401 (required: missing, these tests fail)
import pytest
from conftest import REPO, process_ended

from sut.engine import EngineSettings, GenerationSettings
from sut.flame.service import PARENT_STOPPED_ENV, main, parent_stopped_s, watch_parent
from sut.flame.service_config import make_common_data


def _enter_in_background(endpoint: Path, common: bytes) -> threading.Thread:
    """Call the service's OnSessionEnter as the executor manager does (no deadline), on a daemon thread."""
    import grpc
    from flamepy.proto import shim_pb2, shim_pb2_grpc

    def call():
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        try:
            shim_pb2_grpc.InstanceStub(channel).OnSessionEnter(shim_pb2.SessionContext(
                session_id="s-enter", application=shim_pb2.ApplicationContext(name="sut-vllm", shim="Host"),
                common_data=common))
        except grpc.RpcError:
            pass  # the service went away mid-call: what the test wants

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("while_entering, how", [(False, "killed"), (True, "killed"), (False, "stopped")],
                         ids=["idle", "entering", "stopped"])
def test_a_service_whose_executor_manager_died_stops_by_itself(tmp_path, while_entering, how):
    """Flame v0.6.0 never ends the services of a dead executor manager; an orphaned engine host would hold its
    engine slot against every later run. The service watches its parent and stops, also
    while a gRPC thread is still inside on_session_enter (a slow engine start, a slot wait): the process ends
    without joining it. A parent that is stopped (SIGSTOP: a hung node) and stays so for the bound (2 s here, 30 s
    by default) ends the service too: before, it lived until the node resumed."""
    endpoint = tmp_path / "exec-1.sock"
    env = dict(os.environ, FLAME_INSTANCE_ENDPOINT=str(endpoint), PYTHONPATH=str(REPO), SUT_FLAME_PARENT_STOPPED_S="2")
    # a stand-in executor manager: a shell that starts the service and then only waits
    parent = subprocess.Popen(["bash", "-c", f"{sys.executable} -m sut.flame.serve 2>{tmp_path}/svc.err & echo $!; "
                               "sleep 120"], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 120  # the service imports sut.engine: slow on a loaded host
        while not endpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert endpoint.exists(), (tmp_path / "svc.err").read_text()
        if while_entering:
            common = make_common_data(EngineSettings(model="m"), GenerationSettings(), lock_dir=str(tmp_path / "locks"),
                                      service_hooks="tests.flame_doubles:Faults",
                                      service_hooks_args={"enter_sleep_s": 120})
            _enter_in_background(endpoint, common)
            deadline = time.monotonic() + 30
            while "injected: on_session_enter sleeps" not in (tmp_path / "svc.err").read_text():
                assert time.monotonic() < deadline, (tmp_path / "svc.err").read_text()
                time.sleep(0.2)
        if how == "killed":
            parent.kill()  # the executor manager dies (SIGKILL): the service is re-parented
            parent.wait(5)
        else:
            os.kill(parent.pid, signal.SIGSTOP)  # the executor manager hangs
        deadline = time.monotonic() + 30
        while not process_ended(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not process_ended(pid):
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the service was still running 30 s after its parent was {how}")
        said = "is gone: stopping" if how == "killed" else "has been stopped for"
        assert said in (tmp_path / "svc.err").read_text()
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)  # a stopped process takes SIGKILL too


def test_watch_parent_stops_at_once_when_the_parent_read_at_start_is_gone():
    """The parent read at the start of the process is gone (the process was re-parented during its imports): the
    watch sets ``stop`` before it returns, without waiting a poll; the parent the process has now is not gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stop = threading.Event()
    assert not watch_parent(stop, poll_s=60, parent=dead.pid).is_alive() and stop.is_set()
    alive = threading.Event()
    thread = watch_parent(alive, poll_s=60, parent=os.getppid())
    assert thread.is_alive() and not alive.is_set()
    alive.set()  # ends the watch thread


# ``python -m sut.flame.serve`` whose import of sut.flame.service (the slow part) waits until its parent has died
_HELD_SERVE = """
import os, pathlib, runpy, sys, time
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "sut.flame.service":
            sys.meta_path.remove(self)
            parent = os.getppid()
            pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
            deadline = time.monotonic() + 300
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
sys.meta_path.insert(0, Hold())
runpy.run_module("sut.flame.serve", run_name="__main__", alter_sys=True)
"""


def test_main_reads_its_parent_before_it_publishes_the_socket(tmp_path):
    """An executor manager that dies while its service is still importing re-parents the service: the entry point
    read the manager's pid before the imports, so the service notices, stops and never publishes its socket (read
    after the imports, the pid was the new parent's and the orphan served for good)."""
    endpoint, started, err = tmp_path / "exec-1.sock", tmp_path / "started", tmp_path / "svc.err"
    env = dict(os.environ, FLAME_INSTANCE_ENDPOINT=str(endpoint), PYTHONPATH=str(REPO))
    parent = subprocess.Popen(["bash", "-c", '"$0" -c "$1" "$2" 2>"$3" & sleep 120', sys.executable, _HELD_SERVE,
                               str(started), str(err)], env=env, start_new_session=True)
    pid = None
    try:
        deadline = time.monotonic() + 120  # the interpreter's start: slow on a loaded host
        while not (started.exists() and started.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, err.read_text()
            time.sleep(0.1)
        pid = int(started.read_text())
        parent.kill()  # the executor manager dies during the service's imports
        parent.wait(5)
        deadline = time.monotonic() + 120
        while not process_ended(pid) and not endpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_ended(pid) and not endpoint.exists(), err.read_text()
        assert f"the executor manager (pid {parent.pid}) that started this service is gone" in err.read_text()
    finally:
        if pid is not None and not process_ended(pid):
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def test_proc_state_reads_a_stopped_process_and_a_running_one():
    from sut.flame.service import proc_state

    p = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while proc_state(p.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_state(p.pid) == "T"
        os.kill(p.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while proc_state(p.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_state(p.pid) in ("S", "R")
    finally:
        p.kill()
        p.wait()
    assert proc_state(p.pid) is None  # reaped: no such process


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", " "])
def test_a_bad_parent_stopped_bound_is_refused_naming_it_not_a_busy_poll_or_a_traceback(monkeypatch, caplog, tmp_path,
                                                                                      value):
    """0 or less made the watch poll without a pause (``stop.wait(0)``) and stop the service at the parent's first
    stopped moment; a word raised a bare ``ValueError`` in the service's start; NaN stopped it at once. Unset or
    blank: the default."""
    if not value.strip():
        assert parent_stopped_s({PARENT_STOPPED_ENV: value}) == 30.0 and parent_stopped_s({}) == 30.0
        return
    with pytest.raises(ValueError, match=f"{PARENT_STOPPED_ENV}='{value}': expected seconds > 0"):
        parent_stopped_s({PARENT_STOPPED_ENV: value})
    with pytest.raises(ValueError, match="poll_s and stopped_s must be > 0"):
        watch_parent(threading.Event(), parent=os.getppid(), stopped_s=float(value) if value != "abc" else -1.0)
    monkeypatch.setenv("FLAME_INSTANCE_ENDPOINT", str(tmp_path / "exec.sock"))
    monkeypatch.setenv(PARENT_STOPPED_ENV, value)
    assert main(parent=os.getppid()) == 2
    assert f"{PARENT_STOPPED_ENV}='{value}': expected seconds > 0" in caplog.text
    assert not (tmp_path / "exec.sock").exists()


def test_parent_stopped_bound_takes_seconds_and_inf():
    assert parent_stopped_s({PARENT_STOPPED_ENV: "2"}) == 2.0
    assert parent_stopped_s({PARENT_STOPPED_ENV: "inf"}) == float("inf")
