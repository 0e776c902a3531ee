"""Flame SUT client without a cluster: options, executor sizing, batch formation, issue never blocks."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from sut.base import RunFailed, SUTContext
from sut.dataset import Dataset
from sut.engine import EngineSettings, GenerationSettings
from sut.flame.client import FlameOptions, FlameSUT, executors_per_engine

QS = collections.namedtuple("QS", "id index")


def _sut(**opts):
    ds = Dataset("mem", "0" * 64, [np.arange(1, 20, dtype=np.int32)] * 8, [""] * 8, 8)
    ctx = SUTContext(dataset=ds, engine=EngineSettings(model="m", max_num_seqs=256), generation=GenerationSettings(),
                     options=opts, progress=False)
    return FlameSUT(ctx)


def test_executor_sizing():
    assert executors_per_engine(256, 32) == 16 and executors_per_engine(256, 64) == 8
    assert executors_per_engine(256, 32, fill=1.0, slack=1) == 9
    assert executors_per_engine(4, 1000) == 1
    s = _sut(batch_size=64, engines=8)
    assert (s.per_engine, s.n_executors, s.max_inflight) == (8, 64, 128)
    assert _sut(batch_size=32, executors_per_engine=3).n_executors == 3


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"payload": "pickle"}, {"nope": 1}, {"engines": 0}, {"engine_fill": 0}])
def test_bad_options_are_refused(bad):
    with pytest.raises(RunFailed, match="flame SUT options"):
        _sut(**bad)


def test_option_strings_are_converted():
    o = FlameOptions.from_mapping({"batch_size": "64", "batch_window_ms": "5", "allow_prefix_caching": "false",
                                   "executors_per_engine": "4"})
    assert (o.batch_size, o.batch_window_ms, o.allow_prefix_caching, o.executors_per_engine) == (64, 5.0, False, 4)


def test_batches_window_and_flush():
    s = _sut(batch_size=32, batch_window_ms=200)
    t0 = time.monotonic()
    s.issue_queries([QS(i + 1, i % 8) for i in range(70)])
    assert time.monotonic() - t0 < 0.5  # issue_queries only queues
    assert len(s._next_items()) == 32 and len(s._next_items()) == 32
    t1 = time.monotonic()
    assert len(s._next_items()) == 6  # partial batch after the window
    assert 0.15 < time.monotonic() - t1 < 2.0
    s.issue_queries([QS(100 + i, 0) for i in range(3)])
    s.flush_queries()
    t2 = time.monotonic()
    assert len(s._next_items()) == 3 and time.monotonic() - t2 < 0.1  # a flush sends the partial batch at once


def test_trickling_arrivals_fill_a_batch_within_the_window():
    s = _sut(batch_size=4, batch_window_ms=500)

    def trickle():
        for i in range(4):
            s.issue_queries([QS(i + 1, 0)])
            time.sleep(0.05)

    threading.Thread(target=trickle).start()
    assert len(s._next_items()) == 4


def test_app_render_carries_this_process_pythonpath(monkeypatch, tmp_path):
    """A service started with this machine's interpreter must import what the client imports
    (e.g. packages installed with pip --target and put on PYTHONPATH); an explicit --python does not."""
    from sut.flame import app as app_mod

    extra = str(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", f"{extra}:{app_mod.REPO}")
    env = app_mod.render(workdir=str(tmp_path))["spec"]["environments"]["PYTHONPATH"].split(":")
    assert env == [str(app_mod.REPO), extra]
    other = app_mod.render(python="/opt/py/bin/python", repo="/opt/sut", workdir=str(tmp_path))
    assert other["spec"]["environments"]["PYTHONPATH"] == "/opt/sut"
    with pytest.raises(ValueError, match="SUT_REPO"):
        app_mod.render(repo="relative/path")


def test_service_logs_go_to_the_run_folder(tmp_path):
    """Issue 16: the services' output of a run lands in that run's folder (not <repo>/results/flame-service),
    and only services on the client's host write there."""
    import json
    import socket

    ds = Dataset("mem", "0" * 64, [np.arange(1, 20, dtype=np.int32)] * 8, [""] * 8, 8)
    ctx = SUTContext(dataset=ds, engine=EngineSettings(model="m", max_num_seqs=256), generation=GenerationSettings(),
                     options={}, progress=False, run_dir=str(tmp_path / "run1"))
    s = FlameSUT(ctx)
    assert s.service_log_dir() == str(tmp_path / "run1" / "flame-service")
    d = json.loads(s._common_data())
    assert d["log_dir"] == str(tmp_path / "run1" / "flame-service") and d["client_host"] == socket.gethostname()
    assert _sut(service_log_dir="none").service_log_dir() is None and _sut().service_log_dir() is None
    assert "log_dir" not in json.loads(_sut()._common_data())


@pytest.mark.parametrize("bad", [{"warmup_stall_s": 0}, {"unreachable_timeout_s": -1}])
def test_bad_timeouts_are_refused(bad):
    with pytest.raises(RunFailed, match="must be > 0"):
        _sut(**bad)


def test_bind_failures_that_flame_retries_do_not_fail_the_start():
    """Seen with the real Flame v0.6.0: "shim creation failed ... transport error" for one executor, which
    Flame retried with a new process; only the service's own on_session_enter failure or the retry limit
    (1002) fail the start."""
    from types import SimpleNamespace as NS

    s = _sut()
    events = [NS(code=1001, message="Executor <e1> on node <vm> failed to bind session with return_code <11>: shim "
                                    "creation failed: failed to connect to service at </tmp/x/e1.sock>: transport error")]
    s.session = NS(id="s1")
    s.conn = NS(get_session=lambda sid: NS(events=list(events)))
    s._check_bind_failures()
    s._check_bind_failures()
    assert len(s._bind_warnings) == 1  # logged once
    events.append(NS(code=1002, message="Session retry limit reached"))
    with pytest.raises(RunFailed, match="retry limit"):
        s._check_bind_failures()
    events[1:] = [NS(code=1001, message="... return_code <12>: on_session_enter failed: model files missing")]
    with pytest.raises(RunFailed, match="model files missing"):
        s._check_bind_failures()
