"""Faults on the real Flame v0.6.0 control plane that the stand-in cannot show the same way: a manager killed in
the middle of a run, a session dropped under a run (the stand-in's ``drop_session`` ends the watch streams; the
real one keeps them open), a session too large for the node, a close during the engine start (fake engine; the
shared fault tests run on both control planes in test_flame_standin.py)."""

from __future__ import annotations

import time

import flamepy
import pytest

from tests.test_flame_standin import _assert_exactly_once, _issue, _sid, _sut, dataset, lock_dir  # noqa: F401

pytestmark = pytest.mark.realflame


def _kill_mid_run(cluster, dataset, lock_dir, kill, answered_within_s: float, **opts):  # noqa: F811
    """Start the fake-engine Flame SUT, issue 40 samples (10 tasks of 1 s on 2 executors), ``kill()`` a manager
    1.5 s later; ``(sut, answers, samples, s from the kill until every sample was answered, s the stop took)``."""
    sut, answers = _sut(cluster, dataset, lock_dir, step_s=1.0, close_timeout_s=120, **opts)
    try:
        sut.start()
        samples = _issue(sut, dataset, 40)
        time.sleep(1.5)
        kill()
        t_kill = time.monotonic()
        assert sut.ledger.idle.wait(answered_within_s), "every issued sample answered (empty) once the run failed"
        t_failed = time.monotonic() - t_kill
    finally:
        t0 = time.monotonic()
        sut.stop()
        t_stop = time.monotonic() - t0
    return sut, answers, samples, t_failed, t_stop


def test_session_manager_killed_mid_run_fails_within_bounded_time(real_flame_factory, dataset, lock_dir):  # noqa: F811
    cluster = real_flame_factory()
    sut, answers, samples, t_failed, t_stop = _kill_mid_run(cluster, dataset, lock_dir, cluster.kill_session_manager,
                                                            30, unreachable_timeout_s=5)
    assert t_failed < 15 and t_stop < 5 + 10, (t_failed, t_stop)  # not close_timeout_s (120 s)
    err = sut.ledger.error
    assert err and f"Flame session manager at {cluster.endpoint} is unreachable" in err, err
    _assert_exactly_once(samples, answers)
    close = sut.record()["flame"]["close"]
    assert not close["closed"] and "has been unreachable for 5 s" in close["error"]
    # The executor manager and its services outlive the session manager; stopping the cluster ends them all.
    cluster.stop()
    assert not cluster.processes()


def test_a_stopped_session_manager_fails_the_run_and_its_stop_within_bounded_time(  # noqa: F811
        real_flame_factory, dataset, lock_dir, monkeypatch):  # noqa: F811
    """Before: a SIGSTOPped session manager accepts connections and answers nothing; flamepy's calls have no deadline,
    so the health poll hung, the run failed only at its stall limit and its stop then waited for good. Now every
    unary call has a deadline (here 2 s), two unanswered polls fail the run naming the cause, and the stop gives up
    closing at once (the loss is why its tasks can never end)."""
    import signal

    from sut.flame import endpoint

    monkeypatch.setattr(endpoint, "RPC_TIMEOUT_S", 2.0)
    cluster = real_flame_factory()
    try:
        sut, answers, samples, t_failed, t_stop = _kill_mid_run(
            cluster, dataset, lock_dir, lambda: cluster.fsm.send_signal(signal.SIGSTOP), 60, health_check_s=1,
            unreachable_timeout_s=5)
    finally:
        cluster.fsm.send_signal(signal.SIGCONT)
    assert t_failed < 30 and t_stop < 30, (t_failed, t_stop)  # not the stall limit, not for good
    err = sut.ledger.error
    assert err and "the Flame session manager answered none of 2 polls in a row" in err, err
    _assert_exactly_once(samples, answers)
    close = sut.record()["flame"]["close"]
    assert not close["closed"] and "Deadline Exceeded" in close["error"], close  # given up at once: the loss said why
    cluster.stop()
    assert not cluster.processes()


def test_session_that_does_not_fit_fails_the_warm_up_with_the_count(real_flame_factory, dataset, lock_dir):  # noqa: F811
    """With Flame's drf policy executors must fit the node (its CPU count): executors of cpu=N (N = this
    host's CPUs) fit one at a time, Flame allocates one of the 2 the session needs, and the warm-up says so
    after warmup_stall_s instead of waiting warmup_timeout_s."""
    import os

    from sut.errors import RunFailed

    cluster = real_flame_factory(policies=("priority", "drf", "gang"))
    sut, _ = _sut(cluster, dataset, lock_dir, resreq=f"cpu={os.cpu_count()},mem=1g", warmup_stall_s=3, warmup_log_s=1)
    t0 = time.monotonic()
    try:
        with pytest.raises(RunFailed, match=r"only [01] of 2 Flame executors answered, and Flame has given session \S+ "
                                            r"1 executor\(s\) \(1 \w+\), none new for 3 s; check the cluster's capacity") as ei:
            sut.start()
        # the way out, named (a --batch-size 1 asked a 24-executor node for 512)
        assert "--option executors_per_engine=1 " in str(ei.value) and "--option min_executors=1" in str(ei.value)
    finally:
        sut.stop()
    assert time.monotonic() - t0 < 20
    assert cluster.wait_until(lambda: not cluster.executors() and not cluster.service_processes(), 20)


@pytest.mark.slow  # ~45 s: the session manager notices a dead executor manager after its 30 s heartbeat timeout
def test_executor_manager_killed_mid_run_fails_within_bounded_time(real_flame_factory, dataset, lock_dir):  # noqa: F811
    """Flame v0.6.0 keeps the tasks of a dead executor manager Running for good, so the run
    waited for its 30-min stall limit and its stop for close_timeout_s. Now the executor health check fails it
    once Flame lists the node NotReady, and the stop does not wait for the lost tasks."""
    cluster = real_flame_factory()
    sut, answers, samples, t_failed, t_stop = _kill_mid_run(cluster, dataset, lock_dir, cluster.kill_executor_manager,
                                                            90, health_check_s=1.0)
    assert t_failed < 60 and t_stop < 10, (t_failed, t_stop)  # not the stall limit, not close_timeout_s (120 s)
    err = sut.ledger.error
    assert err and "Flame lost the executors of session" in err and "NotReady" in err, err
    _assert_exactly_once(samples, answers)
    close = sut.record()["flame"]["close"]
    assert not close["closed"] and "Cannot close session with running tasks" in close["error"]


def test_a_session_closed_during_the_engine_start_ends_its_services_within_seconds(  # noqa: F811
        real_flame_factory, dataset, lock_dir):  # noqa: F811
    """After a run stopped in its warm-up, Flame could end the services only once
    their OnSessionEnter returned, so an engine host finished its engine start (here 60 s) and slot waiters waited
    slot_wait_s. The services now see the close (EnterWatch) and end the entry at once."""
    import threading

    cluster = real_flame_factory()
    sut, _ = _sut(cluster, dataset, lock_dir, engine_factory_args={"step_s": 0.05, "start_s": 60.0, "block": 16},
                  warmup_timeout_s=120)
    failed = []
    starter = threading.Thread(target=lambda: failed.append(_start_expecting_failure(sut)), daemon=True)
    starter.start()
    try:
        assert cluster.wait_until(lambda: len(cluster.service_processes()) >= 2, 30), "the services started"
        time.sleep(3.0)  # inside on_session_enter: the engine host's start, the forwarder's wait for it
        sid = sut.transport.sessions[0].id
        flamepy.connect(cluster.endpoint).close_session(sid)  # what the run's stop does after a Ctrl-C
        t_close = time.monotonic()
        assert cluster.wait_until(lambda: not cluster.service_processes(), 25), cluster.service_processes()
        assert time.monotonic() - t_close < 25  # not the 60 s engine start
    finally:
        sut.stop()
        starter.join(30)


def _start_expecting_failure(sut):
    try:
        sut.start()
    except Exception as e:  # noqa: BLE001 - the warm-up fails once its session is closed
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("aio_watch", [True, False], ids=["aio-watch", "flamepy-watch"])
def test_lost_session_fails_the_run(real_flame_factory, dataset, lock_dir, aio_watch):  # noqa: F811
    """The real twin of the stand-in's lost-session test: with storage ``none``, Flame v0.6.0 lets the run's
    application be unregistered under its open session and drops that session from memory. Unlike the stand-in's
    ``drop_session``, the watch streams never end and the executor stays Bound to the lost session: only the
    health check's session listing sees it (without it the run waited for its stall limit). The run fails within
    seconds, saying so, every issued sample is answered once, and the stop does not wait for the lost tasks."""
    cluster = real_flame_factory()
    sut, answers = _sut(cluster, dataset, lock_dir, step_s=1.0, aio_watch=aio_watch, health_check_s=1.0)
    try:
        sut.start()
        samples = _issue(sut, dataset, 16)
        time.sleep(0.5)
        conn = flamepy.connect(cluster.endpoint)
        sid = _sid(sut)
        conn.unregister_application(sut.opts.app)
        t_lost = time.monotonic()
        assert sid not in {s.id for s in conn.list_sessions()}, "Flame dropped the session with its application"
        assert sut.ledger.idle.wait(30), "every issued sample answered (empty) once the run failed"
        t_failed = time.monotonic() - t_lost
    finally:
        t0 = time.monotonic()
        sut.stop()
        t_stop = time.monotonic() - t0
    err = sut.ledger.error
    assert err and f"session {sid} (replica 0) is gone: Flame no longer lists it" in err, err
    assert t_failed < 15 and t_stop < 15, (t_failed, t_stop)
    _assert_exactly_once(samples, answers)


def test_a_restarted_session_manager_ends_the_lost_sessions_services_and_the_next_run_starts(  # noqa: F811
        real_flame_factory, dataset, lock_dir):  # noqa: F811
    """Before: after a kill -9 and restart of the session manager (storage none: every session lost) the run failed
    at once, but its services (engine host included) served on for good, and the next run's services waited for the
    engine slot (slot_wait_s) and failed. Now every service sees that Flame no longer knows its session and stops
    within GONE_BOUND_S, and the next run gets the slot."""
    from sut.flame.enter_watch import GONE_BOUND_S

    cluster = real_flame_factory()
    sut, answers = _sut(cluster, dataset, lock_dir, step_s=1.0, close_timeout_s=30, unreachable_timeout_s=5)
    try:
        sut.start()
        sid = sut.transport.sessions[0].id
        samples = _issue(sut, dataset, 40)
        time.sleep(1.5)
        assert len(cluster.service_processes()) >= 2
        cluster.kill_session_manager()
        cluster.restart_session_manager()
        t_restart = time.monotonic()
        assert sut.ledger.idle.wait(30), "every issued sample answered (empty) once the run failed"
    finally:
        sut.stop()
    err = sut.ledger.error
    assert err and f"no longer knows session {sid} (it was restarted" in err, err
    _assert_exactly_once(samples, answers)
    assert cluster.wait_until(lambda: not cluster.service_processes(), GONE_BOUND_S + 5), \
        [p.pid for p in cluster.service_processes()]
    assert time.monotonic() - t_restart < GONE_BOUND_S + 5
    nxt, nxt_answers = _sut(cluster, dataset, lock_dir, slot_wait_s=20, warmup_timeout_s=60)
    try:
        nxt.start()  # its engine host takes the slot the lost session's host held
        more = _issue(nxt, dataset, 8)
        nxt.flush_queries()
        assert nxt.ledger.idle.wait(60)
    finally:
        nxt.stop()
    assert nxt.ledger.error is None
    _assert_exactly_once(more, nxt_answers)
