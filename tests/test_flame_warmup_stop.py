"""Ctrl-C / SIGTERM during the Flame warm-up (found by a fault test): the KeyboardInterrupt raised in the main
thread's wait left the warm-up pool, whose exit joined the warm-up threads, and they ran on until every
executor answered or the stall limit (111 s on a dead executor manager). Now they are told to stop."""

from __future__ import annotations

import collections
import threading
import time
from types import SimpleNamespace

import pytest

from sut.errors import RunFailed
from sut.flame import transport as tr


def test_ctrl_c_during_the_warm_up_stops_the_warm_up_threads_at_once(monkeypatch):
    stopped = []

    class SlowWarmup:  # a warm-up that would wait 60 s for executors, unless aborted
        def __init__(self, rs, need, on_answer, abort, *rest):
            self.abort = abort

        def run(self):
            if self.abort.wait(60):
                stopped.append(threading.current_thread().name)
                raise RunFailed("warm-up stopped")
            return {}

    def wait_then_ctrl_c(futs, return_when):
        time.sleep(0.2)
        raise KeyboardInterrupt()

    monkeypatch.setattr(tr, "Warmup", SlowWarmup)
    monkeypatch.setattr(tr.cf, "wait", wait_then_ctrl_c)
    fake = SimpleNamespace(o=SimpleNamespace(min_executors=1), per_engine=1, warmup=[],
                           counters=SimpleNamespace(note_ping=lambda m: None), service_log_dir=lambda: None)
    sessions = [SimpleNamespace(replica=r, id=f"s{r}") for r in range(2)]
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        tr.FlameTransport._warm_up(fake, sessions)
    assert time.monotonic() - t0 < 5.0
    assert len(stopped) == 2


def test_the_warm_up_line_says_when_services_wait_for_a_slot(tmp_path):
    """A user's run after a stopped one spent 80 s of its slot wait while its log said only "16 Binding": the
    services' own logs (this host's, in the run folder) said why."""
    import os

    from sut.flame.warmup import slot_wait_note

    assert slot_wait_note(None, 300) == "" and slot_wait_note(str(tmp_path), 300) == ""
    (tmp_path / "e1.log").write_text("x\nWARNING slot cpu-0-1.e0 is held by another session's engine host; waiting "
                                     "for it to go (at most slot_wait_s, 300 s)\n")
    note = slot_wait_note(str(tmp_path), 300)
    assert "engine slot(s) cpu-0-1.e0 held by another session's engine host" in note and "300 s" in note
    old = time.time() - 120
    os.utime(tmp_path / "e1.log", (old, old))  # an old wait, over by now
    assert slot_wait_note(str(tmp_path), 300) == ""


def test_a_stalled_warm_up_names_the_other_sessions_that_hold_the_executors():
    """A user killed a run with SIGKILL; the next run's stall advice (executors_per_engine, min_executors)
    could not help: the killed run's session still held the executors. It is named now, with how to close it."""
    from sut.flame.options import FlameOptions
    from sut.flame.warmup import Warmup, _Progress

    held = {"sut-vllm-old": 8, "sut-vllm-r1": 8}  # the second is this run's other replica: no competition
    rs = SimpleNamespace(id="sut-vllm-r0", replica=0, o=FlameOptions(warmup_stall_s=1.0),
                         executors=lambda: (collections.Counter({"Binding": 8}), []),
                         other_sessions=lambda exclude: {k: v for k, v in held.items() if k not in exclude})
    w = Warmup(rs, 16, lambda meta: None, run_sessions=frozenset({"sut-vllm-r0", "sut-vllm-r1"}))
    progress = _Progress(t0=0.0, need=16)
    w._progress(progress, 0.5)  # 8 listed: progress
    with pytest.raises(RunFailed) as e:
        w._progress(progress, 5.0)
    msg = str(e.value)
    assert "8 executor(s) are held by other open session(s): sut-vllm-old (8)" in msg and "sut-vllm-r1" not in msg
    assert "python -m sut.flame close SESSION_ID" in msg and "executors_per_engine" not in msg
    held.clear()
    with pytest.raises(RunFailed, match="executors_per_engine=8"):  # nothing held elsewhere: the capacity advice
        w._progress(progress, 10.0)


def _watch(states, entered=False, unreachable_s=60.0):
    """A ``SessionWatch`` over the answers ``states`` (then the last again): ``(closed, gone, entry calls, gone
    reasons)`` after 0.3 s of 0.01 s polls."""
    from sut.flame.enter_watch import SessionWatch

    calls, reasons, it = [], [], iter(states)
    w = SessionWatch("s1", lambda: calls.append(1), endpoint="http://x:1", poll_s=0.01, on_gone=reasons.append,
                     unreachable_s=unreachable_s)
    w.state = lambda: next(it, states[-1])
    if entered:
        w.entered()
    w.start()
    time.sleep(0.3)
    w.stop()
    return w.closed.is_set(), w.gone.is_set(), calls, reasons


def test_enter_watch_calls_back_once_when_the_session_closes_or_is_unknown_and_never_when_unreachable():
    from sut.flame.enter_watch import CLOSED, GONE, OPEN

    assert _watch([OPEN, OPEN, CLOSED])[::2] == (True, [1])
    assert _watch([GONE])[::2] == (True, [1])
    assert _watch([None])[::2] == (False, [])  # cannot ask: keep entering
    assert _watch([OPEN])[::2] == (False, [])
    from sut.flame.enter_watch import SessionWatch

    assert SessionWatch("s1", lambda: None, endpoint=None).start().closed.is_set() is False  # no FLAME_ENDPOINT


def test_after_entering_a_session_flame_no_longer_knows_stops_the_service_once():
    """Before: the watch ended with the entry, so a service whose session a restarted session manager lost (storage
    none) served on for good, its engine host holding the engine slot against every later run."""
    from sut.flame.enter_watch import CLOSED, GONE, OPEN

    closed, gone, calls, reasons = _watch([OPEN, OPEN, GONE], entered=True)
    assert gone and not closed and calls == [] and len(reasons) == 1
    assert reasons[0] == "the Flame session manager at http://x:1 no longer knows session s1"
    # a session manager that cannot be asked for unreachable_s in a row: gone too, once
    _, gone, _, reasons = _watch([OPEN, None], entered=True, unreachable_s=0.1)
    assert gone and len(reasons) == 1 and "has not answered for" in reasons[0]
    # Closed is Flame's to end (it unbinds the executor); open, or not answering for a while, is no reason
    assert _watch([CLOSED], entered=True)[1:] == (False, [], [])
    assert _watch([OPEN, None, OPEN], entered=True, unreachable_s=0.1)[1:] == (False, [], [])


def test_session_state_reads_not_found_as_gone_and_other_errors_as_unknown():
    """Flame v0.6.0 answers GetSession of an unknown session with NOT_FOUND and the bare id as details (flamepy's
    get_session turns that into 'failed to get session: <id>', which the former check, 'not found' in the message,
    never matched)."""
    import grpc

    from sut.flame.enter_watch import CLOSED, GONE, OPEN, session_state

    class Err(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

    def stub(result):
        def get_session(req, timeout):
            assert req.session_id == "s1" and timeout > 0
            if isinstance(result, Exception):
                raise result
            return SimpleNamespace(status=SimpleNamespace(state=result))
        return SimpleNamespace(GetSession=get_session)

    assert session_state(stub(Err(grpc.StatusCode.NOT_FOUND)), "s1") == GONE
    assert session_state(stub(Err(grpc.StatusCode.UNAVAILABLE)), "s1") is None
    assert session_state(stub(Err(grpc.StatusCode.DEADLINE_EXCEEDED)), "s1") is None
    assert session_state(stub(0), "s1") == OPEN and session_state(stub(1), "s1") == CLOSED


def test_a_warm_up_past_its_time_limit_names_the_other_sessions_and_how_to_close_them(monkeypatch):
    """A locality run whose executors another (SIGKILLed) run's session held failed after its
    warm-up limit without the `python -m sut.flame close` advice the stall path gives."""
    from sut.flame.options import FlameOptions
    from sut.flame.warmup import Warmup

    rs = SimpleNamespace(id="sut-vllm-r0", replica=0, o=FlameOptions(warmup_timeout_s=0.3, warmup_stall_s=600.0),
                         executors=lambda: (collections.Counter(), []), check_bind_failures=lambda: None,
                         other_sessions=lambda exclude: {"sut-vllm-old": 4})
    w = Warmup(rs, 4, lambda meta: None, run_sessions=frozenset({"sut-vllm-r0"}))
    monkeypatch.setattr(w, "_ping", lambda: w.pending.setdefault(str(len(w.pending)), None))
    monkeypatch.setattr(w, "_collect", lambda: None)
    monkeypatch.setattr(w, "_progress", lambda progress, now: None)
    with pytest.raises(RunFailed) as e:
        w.run()
    msg = str(e.value)
    assert "only 0 of 4 Flame executors answered within 0 s" in msg
    assert "held by other open session(s): sut-vllm-old (4)" in msg and "python -m sut.flame close SESSION_ID" in msg
