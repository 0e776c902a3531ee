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
