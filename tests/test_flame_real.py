"""Faults that only the real Flame v0.6.0 control plane can show: the session manager killed in the middle
of a run (fake engine; the shared fault tests run on both control planes in test_flame_standin.py)."""

from __future__ import annotations

import time

import pytest

flamepy = pytest.importorskip("flamepy")

from tests.test_flame_standin import _assert_exactly_once, _issue, _sut, dataset, lock_dir  # noqa: E402,F401

pytestmark = pytest.mark.realflame


def test_session_manager_killed_mid_run_fails_within_bounded_time(real_flame_factory, dataset, lock_dir):  # noqa: F811
    cluster = real_flame_factory()
    sut, answers = _sut(cluster, dataset, lock_dir, step_s=1.0, close_timeout_s=120, unreachable_timeout_s=5)
    try:
        sut.start()
        samples = _issue(sut, dataset, 40)  # 10 tasks of 1 s on 2 executors
        time.sleep(1.5)
        cluster.kill_session_manager()
        t_kill = time.monotonic()
        assert sut.ledger.idle.wait(30), "every issued sample answered (empty) once the run failed"
        t_failed = time.monotonic() - t_kill
    finally:
        t0 = time.monotonic()
        sut.stop()
        t_stop = time.monotonic() - t0
    assert t_failed < 15 and t_stop < 5 + 10, (t_failed, t_stop)  # not close_timeout_s (120 s)
    err = sut.ledger.error
    assert err and f"Flame session manager at {cluster.endpoint} is unreachable" in err, err
    _assert_exactly_once(samples, answers)
    close = sut.record()["flame"]["close"]
    assert not close["closed"] and "has been unreachable for 5 s" in close["error"]
    # The executor manager and its services outlive the session manager; stopping the cluster ends them all.
    cluster.stop()
    assert not cluster.processes()


def test_session_that_does_not_fit_fails_the_warm_up_with_the_count(real_flame_factory, dataset, lock_dir):  # noqa: F811
    """With Flame's drf policy executors must fit the node (its CPU count): executors of cpu=N (N = this
    host's CPUs) fit one at a time, Flame allocates one of the 2 the session needs, and the warm-up says so
    after warmup_stall_s instead of waiting warmup_timeout_s."""
    import os

    from sut.base import RunFailed

    cluster = real_flame_factory(policies=("priority", "drf", "gang"))
    sut, _ = _sut(cluster, dataset, lock_dir, resreq=f"cpu={os.cpu_count()},mem=1g", warmup_stall_s=3, warmup_log_s=1)
    t0 = time.monotonic()
    try:
        with pytest.raises(RunFailed, match=r"only [01] of 2 Flame executors answered, and Flame has given session \S+ "
                                            r"1 executor\(s\) \(1 \w+\), none new for 3 s; check the cluster's capacity"):
            sut.start()
    finally:
        sut.stop()
    assert time.monotonic() - t0 < 20
    assert cluster.wait_until(lambda: not cluster.executors() and not cluster.service_processes(), 20)
