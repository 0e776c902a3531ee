"""The Flame stand-in itself (tests/flame_standin), driven by the real flamepy 0.6.0 client and real service
processes (tests/flame_standin/echo_service.py). The Flame SUT's own tests against the stand-in live in
tests/test_flame_standin.py.

Each service process costs ~1.5 s (``import flamepy``), so sessions are shared where the behaviour under test
allows it. See docs/flame_standin.md for what these tests do and do not prove about the real Flame.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # so that `tests.flame_standin` imports under plain `pytest` too
    sys.path.insert(0, str(ROOT))

import flamepy  # noqa: E402,F401
import grpc  # noqa: E402
from flamepy import FlameError, FlameErrorCode, ResourceRequirement, SessionAttributes, SessionState, TaskState  # noqa: E402
from flamepy.proto import frontend_pb2, frontend_pb2_grpc  # noqa: E402

from tests.flame_standin import StandinCluster, echo_app_attributes  # noqa: E402

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- helpers
def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return st[st.rfind(")") + 2] not in "ZX"
    except OSError:
        return False


def executors_of(cluster, sid):
    return [e for e in cluster.executors() if e["bound_session_id"] == sid]


def task_rec(cluster, sid, tid):
    return next(t for t in cluster.tasks(sid) if t["id"] == tid)


def watch_many(session, task_ids, timeout=60):
    """One watcher thread per task (not Session.run(), whose pool has only 10 threads per connection).
    Returns {task_id: last Task message or the exception}."""
    results = {}

    def watch(tid):
        last = None
        try:
            for m in session.watch_task(tid):
                last = m
            results[tid] = last
        except Exception as e:  # noqa: BLE001
            results[tid] = e

    threads = [threading.Thread(target=watch, args=(tid,), daemon=True) for tid in task_ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert all(not t.is_alive() for t in threads), "some watch streams did not end"
    return results


# -------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    wd = tmp_path_factory.mktemp("standin")
    c = StandinCluster(
        wd,
        max_executors=8,
        bind_retry_limit=2,  # the real default is 5; 2 keeps the starvation test short
        kill_grace_s=1.0,
        # No GPUs on this node (so gpu=1 sessions never fit), and one FEM-level variable for ${VAR} tests.
        env={"CUDA_VISIBLE_DEVICES": "", "STANDIN_TEST_BASE": "base"},
    )
    c.start()
    yield c
    pids = [e["pid"] for e in c.executors() if e["pid"]]
    c.stop()
    c.stop()  # idempotent
    assert not [p for p in pids if alive(p)], "service processes survived stop()"


@pytest.fixture(autouse=True)
def _clear_stuck_executors(cluster):
    """A test that fails between a leave failure and its own restart_executor_manager() would leave a stuck
    executor, which Flame offers to every later session: the module's later tests would hang on it. Clear it."""
    yield
    if any(e["stuck"] for e in cluster.executors()):
        cluster.restart_executor_manager()


@pytest.fixture(scope="module")
def conn(cluster):
    apps = cluster.workdir / "apps"
    apps.mkdir(exist_ok=True)
    c = flamepy.connect(cluster.endpoint)
    c.register_application("echo", echo_app_attributes(working_directory=str(apps), delay_release=30))
    c.register_application("echo-short", echo_app_attributes(working_directory=str(apps), delay_release=1))
    c.register_application("echo-crash", echo_app_attributes(working_directory=str(apps), delay_release=2))
    yield c
    c._executor.shutdown(wait=False)
    c._channel.close()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.endpoint[len("http://"):])
    yield frontend_pb2_grpc.FrontendStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def serial(conn):
    """One session, one executor (max_instances=1), shared by the tests below in file order."""
    return conn.create_session(
        SessionAttributes(application="echo", max_instances=1, common_data=b'{"tag": "serial"}')
    )


# ---------------------------------------------------------------- one-executor session
def test_echo_round_trip_and_wire_shape(cluster, serial, stub):
    assert serial.invoke(b"hello") == b"hello"  # task 1
    assert serial.invoke(b"none") is None  # task 2: service returned None -> output unset
    info = json.loads(serial.invoke(b"info"))  # task 3
    assert info["session_id"] == serial.id
    assert info["common_data"] == '{"tag": "serial"}'
    assert info["endpoint"] == cluster.endpoint
    assert info["pgid"] == info["pid"], "service must lead its own process group"
    (ex,) = executors_of(cluster, serial.id)
    assert ex["pid"] == info["pid"] and ex["state"] == "Bound" and ex["session_id"] == serial.id

    # CreateTask echoes the input; ids are sequential per session from 1.
    resp = stub.CreateTask(frontend_pb2.CreateTaskRequest(task={"session_id": serial.id, "input": b"abc"}))
    assert resp.metadata.id == "4" and resp.spec.input == b"abc" and resp.status.state == 0
    assert len(resp.status.events) == 0

    # Watching a terminal task: exactly one message, without events; GetTask has the events.
    msgs = list(serial.watch_task("4"))
    assert msgs[-1].state == TaskState.SUCCEED and msgs[-1].output == b"abc"
    assert all(m.state != TaskState.PENDING and not m.events for m in msgs)
    assert [m.state for m in serial.watch_task("4")] == [TaskState.SUCCEED]
    got = serial.get_task("4")
    assert [e.code for e in got.events] == [0, 1, 2]
    assert got.creation_time.microsecond == 0, "sqlite engine keeps whole seconds"
    assert [t.id for t in serial.list_tasks()] == ["1", "2", "3", "4"]

    # No initial snapshot: a task watched while Running yields only its terminal message ...
    a = serial.create_task(b"sleep:0.8")
    assert cluster.wait_until(lambda: task_rec(cluster, serial.id, a.id)["state"] == "Running", 10)
    # ... and a task watched while Pending yields Running, then the terminal state.
    b = serial.create_task(b"sleep:0.4")
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("b", [m.state for m in serial.watch_task(b.id)]))
    th.start()
    assert [m.state for m in serial.watch_task(a.id)] == [TaskState.SUCCEED]
    th.join(10)
    assert res["b"] == [TaskState.RUNNING, TaskState.SUCCEED]


def test_many_in_flight_tasks_serial_and_fifo(cluster, serial):
    tasks = [serial.create_task(b"sleep:0.05") for _ in range(16)]
    results = watch_many(serial, [t.id for t in tasks])
    assert all(getattr(results[t.id], "state", None) == TaskState.SUCCEED for t in tasks), results
    recs = {r["id"]: r for r in cluster.tasks(serial.id)}
    mine = [recs[t.id] for t in tasks]
    starts = [r["started_at"] for r in mine]
    assert starts == sorted(starts), "tasks must be launched lowest id first"
    for prev, nxt in zip(mine, mine[1:]):
        assert nxt["started_at"] >= prev["completed_at"], "one executor runs one task at a time"
    assert len({r["executor_id"] for r in mine}) == 1
    assert json.loads(results[tasks[-1].id].output)["max_concurrency"] == 1
    assert len(executors_of(cluster, serial.id)) == 1, "max_instances=1 caps the executors"

    # Session.run(): more than 10 futures still complete (its 10 watch threads just queue).
    futs = [serial.run(b"r%d" % i) for i in range(12)]
    assert [f.result(timeout=30) for f in futs] == [b"r%d" % i for i in range(12)]


def test_task_failure_message(cluster, serial):
    fut = serial.run(b"fail:boom happened")
    with pytest.raises(FlameError) as ei:
        fut.result(timeout=30)
    # Terminal watch messages carry no events, so flamepy cannot see the service's message ...
    assert ei.value.message == "Task failed without error message"
    # ... GetTask has it (event code 3).
    got = serial.get_task(fut._task_id)
    assert got.state == TaskState.FAILED
    assert [e.message for e in got.events if e.code == 3] == ["boom happened"]
    assert serial.invoke(b"still alive") == b"still alive", "a failed task does not hurt the executor"


def test_oversize_input_rejected_at_create_task(cluster, serial):
    before = len(cluster.tasks(serial.id))
    with pytest.raises(FlameError) as ei:
        serial.create_task(b"x" * (5 * 1024 * 1024))
    assert "failed to create task" in ei.value.message and "larger than max" in ei.value.message
    assert len(cluster.tasks(serial.id)) == before


def test_oversize_output(cluster, serial):
    # TaskResult > 4 MiB: the FEM side cannot decode it -> the task is Failed.
    fut = serial.run(b"big:5000000")
    with pytest.raises(FlameError) as ei:
        fut.result(timeout=30)
    assert ei.value.message == "Task failed without error message"
    (msg,) = [e.message for e in serial.get_task(fut._task_id).events if e.code == 3]
    assert "larger than max" in msg

    # Input 1.5 MiB + output 3 MB: every hop is fine and the task Succeeds, but the client cannot receive
    # the terminal Task message (it carries input + output) -- nor GetTask.
    fut = serial.run(b"big:3000000:" + b"p" * (1536 * 1024))
    with pytest.raises(FlameError) as ei:
        fut.result(timeout=30)
    assert "larger than max" in ei.value.message
    assert cluster.wait_until(lambda: task_rec(cluster, serial.id, fut._task_id)["state"] == "Succeed", 10)
    with pytest.raises(FlameError):
        serial.get_task(fut._task_id)


def test_close_kills_the_process_group(cluster, serial):
    child = int(serial.invoke(b"child"))  # a `sleep 600` started by the service, same process group
    (ex,) = executors_of(cluster, serial.id)
    pid = ex["pid"]
    assert alive(pid) and alive(child)
    serial.close()
    assert cluster.wait_until(lambda: executors_of(cluster, serial.id)[0]["state"] == "Released", 10)
    assert not alive(pid) and not alive(child), "no orphans after unbind"
    (ex,) = executors_of(cluster, serial.id)
    assert ex["sigkill_needed"] is False, "flamepy services exit on SIGTERM alone"
    out = Path(ex["log_out"]).read_text()
    assert "on_session_enter" in out and "on_session_leave" in out
    assert not (cluster.workdir / "apps" / "work" / "echo").exists(), "<wd>/work/<app> is removed on release"
    with pytest.raises(FlameError):
        serial.create_task(b"late")  # sqlite mode: closed session


# -------------------------------------------------------------------- other sessions
def test_parallel_executors_up_to_max_instances(cluster, conn):
    s = conn.create_session(SessionAttributes(application="echo", max_instances=3))
    tasks = [s.create_task(b"sleep:0.6") for _ in range(9)]
    results = watch_many(s, [t.id for t in tasks])
    assert all(getattr(results[t.id], "state", None) == TaskState.SUCCEED for t in tasks), results

    mine = executors_of(cluster, s.id)
    assert len(mine) == 3, "one executor per scheduling cycle while tasks are Pending, up to max_instances"
    assert len({e["pid"] for e in mine}) == 3
    listed = [e for e in conn.list_executors() if e.status.session_id == s.id]
    assert len(listed) == 3 and all(e.status.state == 4 for e in listed)  # ExecutorBound

    recs = cluster.tasks(s.id)
    by_exec = {}
    for r in recs:
        by_exec.setdefault(r["executor_id"], []).append(r)
    assert len(by_exec) >= 2
    for rs in by_exec.values():  # serial within each executor
        rs.sort(key=lambda r: r["started_at"])
        for prev, nxt in zip(rs, rs[1:]):
            assert nxt["started_at"] >= prev["completed_at"]
    overlap = any(
        a["executor_id"] != b["executor_id"] and a["started_at"] < b["completed_at"] and b["started_at"] < a["completed_at"]
        for a in recs
        for b in recs
    )
    assert overlap, "different executors run in parallel"

    s.close()
    assert cluster.wait_until(lambda: all(e["state"] == "Released" for e in executors_of(cluster, s.id)), 10)
    assert not [e["pid"] for e in mine if alive(e["pid"])]


def test_service_crash_then_later_tasks_fail_fast(cluster, conn):
    s = conn.create_session(SessionAttributes(application="echo-crash", max_instances=1))  # delay_release=2
    pid = json.loads(s.invoke(b"info"))["pid"]
    a = s.create_task(b"sleep:5")
    later = [s.create_task(b"after-%d" % i) for i in range(3)]
    assert cluster.wait_until(lambda: task_rec(cluster, s.id, a.id)["state"] == "Running", 10)
    killed_at = time.time()
    assert cluster.kill_service() == pid

    results = watch_many(s, [t.id for t in [a, *later]], timeout=30)
    for t in [a, *later]:
        assert results[t.id].state == TaskState.FAILED
        got = s.get_task(t.id)
        assert [e.code for e in got.events].count(1) == 1, "no automatic retry"
        (msg,) = [e.message for e in got.events if e.code == 3]
        # tonic's texts, as the real v0.6.0 FEM reports them (test_flame_standin.py checks them on both)
        assert msg == ("transport error" if t is a else "Connection refused (os error 111)"), msg
    assert max(task_rec(cluster, s.id, t.id)["completed_at"] for t in later) - killed_at < 3.0, "fail fast"
    assert not alive(pid)

    # After delay_release with no tasks, OnSessionLeave fails (the process is gone): like the v0.6.0 FEM the
    # executor stays in Unbinding for good (leave_failure="stuck"), no longer counted for the session ...
    assert cluster.wait_until(lambda: executors_of(cluster, s.id)[0]["stuck"], 10)
    (ex,) = executors_of(cluster, s.id)
    assert ex["state"] == "Unbinding" and ex["session_id"] is None and ex["leave_error"]
    # ... but, as in real v0.6.0 (test_flame_real_cluster.py pins it), Flame keeps offering the stuck executor
    # to every session that needs one, so no new executor is made: new work stays Pending, in this session and
    # in a new one, until the executor manager restarts.
    t = s.create_task(b"after the leave failure")
    s2 = conn.create_session(SessionAttributes(application="echo", max_instances=1))
    t2 = s2.create_task(b"new session")
    time.sleep(1.5)
    assert task_rec(cluster, s.id, t.id)["state"] == "Pending" and task_rec(cluster, s2.id, t2.id)["state"] == "Pending"
    assert [e["id"] for e in cluster.executors() if e["state"] != "Released"] == [ex["id"]]
    s.close()
    s2.close()
    # As with Flame, only a restart of the executor manager clears it (the later tests share this cluster).
    assert cluster.restart_executor_manager() == 1
    s3 = conn.create_session(SessionAttributes(application="echo", max_instances=1))
    assert s3.invoke(b"back") == b"back"
    s3.close()


def test_bind_failure_retries_then_starves(cluster, conn):
    s = conn.create_session(
        SessionAttributes(application="echo", max_instances=1, common_data=b'{"fail_enter": "cannot load model"}')
    )
    t = s.create_task(b"never runs")
    assert cluster.wait_until(lambda: [c for c, _ in cluster.session_events(s.id)] == [1001, 1001, 1002], 30)
    time.sleep(0.5)  # several scheduling cycles: no new attempt
    events = cluster.session_events(s.id)
    assert [c for c, _ in events] == [1001, 1001, 1002]
    assert "return_code <12>" in events[0][1] and "cannot load model" in events[0][1]
    assert "2/2" in events[2][1]
    mine = executors_of(cluster, s.id)
    assert len(mine) == 2 and len({e["pid"] for e in mine}) == 2, "each attempt is a new process"
    assert cluster.wait_until(lambda: all(e["state"] == "Released" for e in executors_of(cluster, s.id)), 10)

    got = conn.get_session(s.id)  # visible through flamepy as session events
    assert [e.code for e in got.events] == [1001, 1001, 1002]
    assert got.state == SessionState.OPEN and got.pending == 1
    assert task_rec(cluster, s.id, t.id)["state"] == "Pending"
    s.close()
    assert task_rec(cluster, s.id, t.id)["state"] == "Cancelled"


def test_close_rejected_while_running_and_pending_cancelled(cluster, conn, stub):
    s = conn.create_session(SessionAttributes(application="echo", max_instances=1))
    a = s.create_task(b"sleep:1.5")
    b = s.create_task(b"queued")
    assert cluster.wait_until(lambda: task_rec(cluster, s.id, a.id)["state"] == "Running", 15)
    with pytest.raises(FlameError) as ei:
        s.close()
    assert ei.value.code == FlameErrorCode.INTERNAL
    assert "Cannot close session with running tasks" in ei.value.message
    assert task_rec(cluster, s.id, b.id)["state"] == "Pending"
    assert [m.state for m in s.watch_task(b.id)][-1] == TaskState.SUCCEED
    s.close()

    cluster.pause_scheduler()  # keep the next session's tasks Pending (no executor)
    try:
        s2 = conn.create_session(SessionAttributes(application="echo", max_instances=1))
        ts = [s2.create_task(b"p%d" % i) for i in range(3)]
        time.sleep(0.3)
        assert executors_of(cluster, s2.id) == []
        closed = conn.close_session(s2.id)
        assert closed.state == SessionState.CLOSED
        assert [r["state"] for r in cluster.tasks(s2.id)] == ["Cancelled"] * 3
        # flamepy 0.6.0 has no CANCELLED: the watch fails to parse state 4.
        with pytest.raises(FlameError) as ei:
            list(s2.watch_task(ts[0].id))
        assert "not a valid TaskState" in ei.value.message
        status = stub.GetSession(frontend_pb2.GetSessionRequest(session_id=s2.id)).status
        assert (status.state, status.cancelled, status.pending) == (1, 3, 0)
        with pytest.raises(FlameError):
            s2.create_task(b"late")
    finally:
        cluster.resume_scheduler()


def test_delay_release_idle_restarts_the_process(cluster, conn):
    s = conn.create_session(SessionAttributes(application="echo-short", max_instances=1))  # delay_release=1
    first = json.loads(s.invoke(b"info"))
    assert cluster.wait_until(lambda: executors_of(cluster, s.id)[0]["state"] == "Released", 10)
    assert not alive(first["pid"])
    second = json.loads(s.invoke(b"info"))
    assert second["pid"] != first["pid"]
    assert (second["enter_count"], second["invocations"]) == (1, 1), "fresh process, fresh service object"
    s.close()


def test_service_environment_dirs_and_sigkill_escalation(cluster, conn, tmp_path):
    wd = tmp_path / "envapp"
    wd.mkdir()
    attrs = echo_app_attributes(
        working_directory=str(wd),
        environments={
            "ECHO_IGNORE_SIGTERM": "1",
            "EXPANDED": "${STANDIN_TEST_BASE}/x",
            "UNEXPANDED": "${NO_SUCH_VAR_XYZ}/y:${STANDIN_TEST_BASE}",  # one unknown -> kept verbatim
        },
    )
    conn.register_application("echo-env", attrs)
    s = conn.create_session(SessionAttributes(application="echo-env", max_instances=1))
    assert s.invoke(b"env:EXPANDED") == b"base/x"
    assert s.invoke(b"env:UNEXPANDED") == b"${NO_SUCH_VAR_XYZ}/y:${STANDIN_TEST_BASE}"
    assert s.invoke(b"env:STANDIN_TEST_BASE") == b"base"  # the FEM's environment is inherited
    info = json.loads(s.invoke(b"info"))
    assert info["cwd"] == str(wd)
    assert info["tmpdir"] == str(wd / "work" / "echo-env" / "tmp")
    (ex,) = executors_of(cluster, s.id)
    assert Path(ex["log_out"]).parent == wd and Path(ex["log_err"]).exists()
    s.close()
    assert cluster.wait_until(lambda: executors_of(cluster, s.id)[0]["state"] == "Released", 10)
    (ex,) = executors_of(cluster, s.id)
    assert ex["sigkill_needed"] is True, "a service ignoring SIGTERM would outlive its binding in real Flame"
    assert not alive(ex["pid"])
    assert not (wd / "work" / "echo-env").exists()
    conn.unregister_application("echo-env")
    assert conn.get_application("echo-env") is None


def test_storage_and_api_semantics(cluster, conn, stub):
    with pytest.raises(FlameError) as ei:
        conn.register_application("echo", echo_app_attributes())
    assert "UNIQUE constraint failed" in ei.value.message
    with pytest.raises(FlameError) as ei:
        conn.register_application("rel-wd", echo_app_attributes(working_directory="relative/dir"))
    assert "absolute path" in ei.value.message
    assert conn.get_application("nope") is None
    assert {"echo", "flmexec", "flmping", "flmrun"} <= {a.name for a in conn.list_applications()}
    with pytest.raises(FlameError):
        conn.create_session(SessionAttributes(application="nope"))

    cluster.pause_scheduler()
    try:
        s = conn.open_session("sem-1", SessionAttributes(application="echo", max_instances=2))
        assert conn.open_session("sem-1").id == "sem-1"
        assert conn.open_session("sem-1", SessionAttributes(application="echo", max_instances=2)).id == "sem-1"
        with pytest.raises(FlameError) as ei:
            conn.open_session("sem-1", SessionAttributes(application="echo", max_instances=3))
        assert ei.value.code == FlameErrorCode.INVALID_ARGUMENT
        with pytest.raises(FlameError) as ei:
            conn.open_session("sem-unknown")
        assert ei.value.code == FlameErrorCode.NOT_FOUND
        with pytest.raises(FlameError) as ei:
            conn.unregister_application("echo")
        assert "open sessions" in ei.value.message
        assert "sem-1" in {x.id for x in conn.list_sessions()}

        with pytest.raises(FlameError):
            s.get_task("42")
        assert list(s.watch_task("42")) == [], "watching an unknown task ends silently"

        # A watch on a task whose session disappears ends silently: no message, no error.
        t = s.create_task(b"p")
        got = {}

        def raw_watch():
            try:
                got["msgs"] = list(stub.WatchTask(frontend_pb2.WatchTaskRequest(task_id=t.id, session_id="sem-1")))
            except grpc.RpcError as e:
                got["err"] = e

        th = threading.Thread(target=raw_watch)
        th.start()
        assert cluster.wait_until(lambda: cluster.watchers("sem-1", t.id) == 1, 10), "the watch is waiting on the task"
        cluster.drop_session("sem-1")
        th.join(10)
        assert not th.is_alive() and got == {"msgs": []}
        assert cluster.watchers("sem-1", t.id) == 0

        # DeleteSession: refused while tasks are open, then the session is gone.
        d = conn.create_session(SessionAttributes(application="echo"))
        d.create_task(b"p")
        with pytest.raises(grpc.RpcError) as ei:
            stub.DeleteSession(frontend_pb2.DeleteSessionRequest(session_id=d.id))
        assert "open tasks" in ei.value.details()
        d.close()
        stub.DeleteSession(frontend_pb2.DeleteSessionRequest(session_id=d.id))
        with pytest.raises(FlameError):
            conn.get_session(d.id)
    finally:
        cluster.resume_scheduler()

    # DRF: a gpu=1 session never fits a node without GPUs -- it stays Pending with no executor.
    g = conn.create_session(
        SessionAttributes(application="echo", resreq=ResourceRequirement(cpu=1, memory=1 << 30, gpu=1))
    )
    g.create_task(b"x")
    time.sleep(0.5)
    assert executors_of(cluster, g.id) == []
    g.close()

    (node,) = conn.list_nodes()
    assert node.status.state == 1 and node.status.capacity.gpu == 0


def test_gpu_slots(tmp_path):
    with StandinCluster(tmp_path, gpu_slots=["3", "5"], kill_grace_s=1.0) as c:
        conn = flamepy.connect(c.endpoint)
        try:
            conn.register_application("echo", echo_app_attributes(working_directory=str(tmp_path)))
            gpu1 = ResourceRequirement(cpu=1, memory=1 << 30, gpu=1)
            s = conn.create_session(SessionAttributes(application="echo", resreq=gpu1))
            tasks = [s.create_task(b"sleep:0.5") for _ in range(6)]
            results = watch_many(s, [t.id for t in tasks])
            execs = {e["id"]: e for e in executors_of(c, s.id)}
            assert len(execs) == 2, "each executor takes a free slot; two slots, two executors"
            assert {e["slot"] for e in execs.values()} == {"3", "5"}
            for r in c.tasks(s.id):
                out = json.loads(results[r["id"]].output)
                assert out["cuda"] == out["slot"] == execs[r["executor_id"]]["slot"]
            assert {n.metadata.name for n in conn.list_nodes()} == {f"{c.node_name}-slot3", f"{c.node_name}-slot5"}

            big = conn.create_session(SessionAttributes(application="echo", resreq=ResourceRequirement(cpu=1, gpu=2)))
            big.create_task(b"x")
            s.close()
            time.sleep(0.5)
            assert executors_of(c, big.id) == [], "gpu=2 never fits a one-GPU node"
            big.close()
        finally:
            conn._executor.shutdown(wait=False)
            conn._channel.close()


def test_cli_serves_until_interrupted(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.flame_standin", "--port", "0", "--workdir", str(tmp_path)],
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("FLAME_ENDPOINT=http://127.0.0.1:"), line + proc.stderr.read()
        conn = flamepy.connect(line.split("=", 1)[1])
        assert "flmrun" in {a.name for a in conn.list_applications()}
        conn._channel.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_run_can_tell_the_standin_from_flame_by_its_nodes(tmp_path):
    """The stand-in marks its nodes; the transport records the control plane it reached (a run against the
    stand-in is no Flame result), and a cluster whose nodes cannot be listed is 'unknown', not a failure."""
    from types import SimpleNamespace as NS

    from flamepy.proto import types_pb2

    from sut.flame.endpoint import control_plane_kind
    from tests.flame_standin import StandinCluster

    cluster = StandinCluster.__new__(StandinCluster)  # only what _node_protos reads
    cluster.gpu_slots, cluster.node_name, cluster._node_gpus = None, "host", 0
    nodes = cluster._node_protos()
    assert control_plane_kind(NS(list_nodes=lambda: nodes)) == "stand-in"
    real = types_pb2.Node(status=types_pb2.NodeStatus(info=types_pb2.NodeInfo(arch="x86_64", os="linux")))
    assert control_plane_kind(NS(list_nodes=lambda: [real])) == "flame"

    def broken():
        raise RuntimeError("unavailable")
    assert control_plane_kind(NS(list_nodes=broken)) == "unknown"
