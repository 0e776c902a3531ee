"""``sut.flame.health.ExecutorHealth`` on canned Flame listings (the real control plane's case is the slow
``test_flame_real.py::test_executor_manager_killed_mid_run_fails_within_bounded_time``)."""

from __future__ import annotations

from types import SimpleNamespace

import flamepy
from flamepy.proto import types_pb2

from sut.flame.health import ExecutorHealth


def _ex(state: str, session: str, node: str = "n1"):
    return SimpleNamespace(status=SimpleNamespace(state=types_pb2.ExecutorState.Value("Executor" + state),
                                                  session_id=session), spec=SimpleNamespace(node=node))


def _node(name: str, state: str):
    return SimpleNamespace(metadata=SimpleNamespace(name=name), status=SimpleNamespace(state=types_pb2.NodeState.Value(state)))


class Conn:
    def __init__(self):
        self.executors, self.nodes, self.fail = [], [], False
        self.sessions = ["s0", "s1"]

    def list_executors(self):
        if self.fail:
            raise ConnectionError("unreachable")
        return self.executors

    def list_nodes(self):
        return self.nodes

    def list_sessions(self):
        return [SimpleNamespace(id=s) for s in self.sessions]


def _health(conn, inflight):
    sessions = [SimpleNamespace(id="s0", replica=0), SimpleNamespace(id="s1", replica=1)]
    return ExecutorHealth(conn, sessions, lambda r: inflight[r], 1.0, lambda r, m: None)


def test_a_node_gone_notready_loses_the_replicas_whose_executors_it_held():
    conn, inflight = Conn(), [3, 2]
    h = _health(conn, inflight)
    conn.executors = [_ex("Bound", "s0", "n1"), _ex("Bound", "s1", "n2")]
    conn.nodes = [_node("n1", "Unknown"), _node("n2", "Unknown")]  # v0.6.0 lists healthy nodes as Unknown
    assert h.check() is None
    conn.executors = [_ex("Void", "", "n1"), _ex("Bound", "s1", "n2")]
    conn.nodes = [_node("n1", "NotReady"), _node("n2", "Unknown")]
    replica, msg = h.check()
    assert replica == 0 and "session s0 (replica 0) while 3 task(s) ran" in msg and "node(s) n1 NotReady" in msg


def test_no_live_executor_twice_running_loses_the_replica_but_idle_or_unreachable_does_not():
    conn, inflight = Conn(), [0, 1]
    h = _health(conn, inflight)
    conn.executors = [_ex("Bound", "s0"), _ex("Releasing", "s1")]
    assert h.check() is None  # one empty listing is no proof
    conn.fail = True
    assert h.check() is None  # cannot ask: the session manager checks handle that
    conn.fail = False
    replica, msg = h.check()
    assert replica == 1 and "0 live executor(s) listed" in msg
    h2 = _health(conn, [0, 0])  # nothing in flight: an executor released after delay_release is no loss
    conn.executors = []
    assert h2.check() is None and h2.check() is None and h2.check() is None


def test_a_session_flame_no_longer_lists_twice_running_loses_the_replica_though_its_executor_looks_bound():
    """Flame v0.6.0 (storage none) drops a session whose application is unregistered and keeps its executor
    Bound to it: only the session listing shows the loss."""
    conn, inflight = Conn(), [2, 0]
    h = _health(conn, inflight)
    conn.executors = [_ex("Bound", "s0"), _ex("Bound", "s1")]
    conn.sessions = ["s1"]
    assert h.check() is None  # one listing without it is no proof
    conn.sessions = ["s0", "s1"]
    assert h.check() is None  # listed again: the count starts over
    conn.sessions = []
    assert h.check() is None
    replica, msg = h.check()
    assert replica == 0 and msg.startswith("session s0 (replica 0) is gone: Flame no longer lists it while 2 task(s) ran")
    h2 = _health(conn, [0, 0])  # nothing in flight: a session gone after the run's tasks is no loss here
    assert h2.check() is None and h2.check() is None and h2.check() is None


class Unanswered(Conn):
    """A session manager that is stopped or hung: every listing ends at its deadline."""

    def __init__(self):
        super().__init__()
        self.mute = False

    def list_executors(self):
        if self.mute:
            raise flamepy.FlameError(flamepy.FlameErrorCode.INTERNAL, "failed to list executors: Deadline Exceeded")
        return super().list_executors()


def test_two_unanswered_polls_while_tasks_run_lose_the_run_naming_the_session_manager():
    conn, inflight = Unanswered(), [0, 2]
    conn.executors = [_ex("Bound", "s0"), _ex("Bound", "s1")]
    h = _health(conn, inflight)
    conn.mute = True
    assert h.check() is None  # one unanswered poll is no proof
    conn.mute = False
    assert h.check() is None  # it answered: the count starts over
    conn.mute = True
    assert h.check() is None
    replica, msg = h.check()
    assert replica == 1 and "answered none of 2 polls in a row" in msg and "2 task(s) of replica 1" in msg
    idle = _health(conn, [0, 0])  # nothing in flight: a slow listing loses nothing
    assert idle.check() is None and idle.check() is None and idle.check() is None


def test_the_connections_unary_calls_get_a_deadline_and_its_streams_none():
    from sut.flame.endpoint import DeadlineStub, no_answer

    calls = []

    class Stub:
        def __getattr__(self, name):
            return lambda request, **kw: calls.append((name, kw.get("timeout")))

    stub = DeadlineStub(Stub(), 7.0)
    stub.ListExecutor("req")
    stub.CloseSession("req", timeout=1.0)  # a call's own timeout stays
    stub.WatchTask("req")
    assert calls == [("ListExecutor", 7.0), ("CloseSession", 1.0), ("WatchTask", None)]
    assert no_answer("failed to close session: Deadline Exceeded") and not no_answer("Connection refused")


def test_the_services_engine_stall_limit_is_the_runs_unless_the_flame_option_sets_it(tmp_path):
    """engine_stall_s unset: the services end a silent engine after the run's --stall-timeout-s (TransportSpec);
    the flame option wins when given."""
    import json

    from sut.core.transport import TransportSpec
    from sut.engine import EngineSettings, GenerationSettings
    from sut.flame.options import FlameOptions
    from sut.flame.transport import FlameTransport

    def sent(stall_opt, run_stall):
        spec = TransportSpec(engine=EngineSettings(model="m"), generation=GenerationSettings(),
                             options=FlameOptions(engine_stall_s=stall_opt), stall_timeout_s=run_stall)
        t = FlameTransport.__new__(FlameTransport)
        t.spec, t.o, t.dataset, t.allow_prefix_caching = spec, spec.options, None, False
        t.service_log_dir = lambda: None
        return json.loads(t.common_data(0))["engine_stall_s"]

    assert sent(None, 60.0) == 60.0 and sent(None, 300.0) == 300.0 and sent(45.0, 60.0) == 45.0
