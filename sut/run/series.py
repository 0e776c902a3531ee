"""Several LoadGen tests over one SUT start: engines started once, one run folder per test, stopped once.

``python -m sut find-qps`` (one-process mode) uses it to try several Server / Interactive ``target_qps``
values without paying the engine start (CUDA graphs: ~60-90 s on an H200) for every try::

    with SUTSeries(rs, es, gen, options, command) as series:   # checks: InputError before anything starts
        rec1 = series.run(8.0, "try-1")    # starts the engines, then one LoadGen test; run.json as usual
        rec2 = series.run(12.0, "try-2")   # the same engines, a fresh SUT object and ledger
    # leaving the block (also on an error or Ctrl-C) stops the engines

Each ``run(target_qps, run_name)`` is what ``sut.run.harness.run_benchmark`` does for one run, over the
engines the first test started: its own run folder under ``rs.output_dir`` with LoadGen's logs, a copy
of user.conf and a complete ``run.json`` (status, ledger counts, LoadGen results, latency, validity,
compliance reasons); ``run.json`` ``series`` says which test of the series it was and where the engines
started (their ``engine-N.log`` are in the first test's folder). Every test gets a fresh ``TransportSUT``
with a fresh ledger (exactly-once holds per test) whose request ids continue after the previous test's,
so that a late answer to an earlier test can never count as one of this test's. The first test's SUT
starts the transport and leaves it running at its ``stop`` (``keep_transport``); later SUTs attach to it.

LoadGen settings: ``TestSettings.FromConfig`` may run once per process (``sut.settings.loadgen``), so the
first test's settings are built the normal way and every later test's are a field-by-field copy of them
(``copy_test_settings``) with only ``server_target_qps`` changed. Every test is marked not compliant
(``target_qps`` from the command line, "test N of a one-process series ...").

Errors: bad input raises ``InputError`` / ``DatasetError`` before anything starts. A test that fails
(engine death, a sample never answered, a ledger error, Ctrl-C) raises as ``run_benchmark`` does, with its
``run.json`` ``failed``; the series is then spent (a later ``run`` raises ``RunFailed``), and ``close`` stops
the engines. A failed test whose LoadGen Server schedule still runs (no abort in LoadGen) leaves its thread
behind (``sut.exits.leave_without_cleanup``): the caller's ``run_main`` then ends the process after ``close``.
A later test's ``target_qps`` is checked as the first's (``check_target_qps``), before its folder; refused, it ends
the series with ``RunFailed`` (exit 1: engines have run, so it is not bad input before anything started).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from sut import exits
from sut.core.loadgen_sut import TransportSUT
from sut.engine import EngineSettings, GenerationSettings
from sut.errors import InputError, RunFailed
from sut.run.harness import (
    _audit_config,
    _execute,
    _noncompliance_reasons,
    open_run,
    prepare_run,
    raise_recorded,
    release_record_space,
)
from sut.scenarios import STREAMING_SCENARIOS
from sut.settings.loadgen import check_target_qps, copy_test_settings, loadgen_test_settings
from sut.settings.run import RunSettings

log = logging.getLogger(__name__)

#: The compliance reason every test of a series carries (``{n}``: the try's number in its search, from 1).
SERIES_REASON = "try {n} of a one-process target_qps search"
#: Added for the tests after the first.
WARM_REASON = ": engine warm from earlier tries"


class SUTSeries:
    """LoadGen tests at several ``target_qps`` over one engine start (module docstring).

    Args:
        rs: the run settings every test shares (``scenario`` Server or Interactive; ``target_qps`` and
            ``run_name`` are set per test).
        es / gen / options / command: as ``sut.run.harness.run_benchmark``'s.

    Raises ``InputError`` / ``DatasetError`` (bad input, nothing started): also for an Offline scenario or
    a backend that is not a ``TransportSUT`` (nothing to keep running between tests).
    """

    def __init__(self, rs: RunSettings, es: EngineSettings, gen: GenerationSettings, options: Any = None,
                 command: Optional[str] = None):
        if rs.scenario not in STREAMING_SCENARIOS:
            raise InputError(f"a series of target_qps tests needs --scenario Server or Interactive, not {rs.scenario}")
        self.rs, self.es, self.command = rs, es, command
        self.backend, self.options, self.model, self.gen, self.dataset = prepare_run(rs, es, gen, options)
        if not issubclass(self.backend, TransportSUT):
            raise InputError(f"--sut {rs.sut} cannot keep its engines between tests (not a transport SUT)")
        self.audit_config = _audit_config(rs)
        self.transport = None  # started by the first test; stopped by close()
        self.tests = 0  # tests begun
        self.first_dir: Optional[Path] = None
        self._ts = None  # the first test's TestSettings (FromConfig ran for it)
        self._reasons: list[str] = []
        self._next_rid = 0  # the next test's first request id
        self._sut: Optional[TransportSUT] = None  # the current test's SUT
        self._failed: Optional[str] = None

    def __enter__(self) -> "SUTSeries":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _settings(self, rs: RunSettings, target_qps: float):
        """This test's ``TestSettings`` and compliance reasons (``FromConfig`` for the first test only)."""
        if self._ts is None:
            ts, reasons = loadgen_test_settings(rs, len(self.dataset))
            self._ts = ts
            self._reasons = reasons + _noncompliance_reasons(self.gen, self.es, self.audit_config, self.backend,
                                                             self.options)
            return ts, list(self._reasons)
        ts = copy_test_settings(self._ts, server_target_qps=float(target_qps))
        try:
            check_target_qps(ts, rs, where=f"try {self.tests + 1}")
        except InputError as e:  # engines have run: the end of the series, not bad input (exit 1, not 2)
            raise RunFailed(f"the series cannot go on: {e}") from None
        return ts, list(self._reasons)

    def _make_sut(self, ctx) -> TransportSUT:
        if self.transport is None:
            sut = self.backend(ctx, keep_transport=True)
            self.transport = sut.transport
        else:
            sut = self.backend(ctx, transport=self.transport)
        self._sut = sut
        return sut

    def run(self, target_qps: float, run_name: str, search_try: Optional[int] = None) -> dict:
        """One LoadGen test at ``target_qps`` (queries/s) into the run folder ``run_name``; returns its record
        (also its ``run.json``). ``search_try``: the try's number in its whole search, earlier sessions'
        tries included (default: this series' test number), for the compliance reason. The first call starts
        the engines. Raises as ``run_benchmark`` (the test's ``run.json`` then says ``failed``); ``RunFailed``
        at once after an earlier test failed or ``close``."""
        if self._failed:
            raise RunFailed(f"the series cannot go on: {self._failed}")
        if not target_qps > 0:
            raise InputError(f"target_qps must be a positive number of queries/s, got {target_qps}")
        n = self.tests + 1
        rs = dataclasses.replace(self.rs, target_qps=float(target_qps), run_name=run_name)
        ts, reasons = self._settings(rs, target_qps)
        reasons.append(SERIES_REASON.format(n=search_try or n) + (WARM_REASON if n > 1 else ""))
        run_dir, record = open_run(rs, self.es, self.gen, self.options, self.model, self.dataset, reasons,
                                   self.command, self.audit_config)
        self.tests = n
        self.first_dir = self.first_dir or run_dir
        record["series"] = {"test": n, "engines_started_in": str(self.first_dir)}
        self._sut = None
        try:
            return _execute(rs, self.es, self.gen, self.backend, self.options, self.model, self.dataset, ts,
                            self.audit_config, run_dir, record, make_sut=self._make_sut,
                            first_request_id=self._next_rid)
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
            self._failed = f"test {n} ({run_dir.name}) failed: {type(e).__name__}: {e}"
            raise_recorded(run_dir, record, e)
        finally:
            release_record_space(run_dir)
            if self._sut is not None:
                self._next_rid += self._sut.ledger.issued

    def close(self) -> None:
        """Stop the engines (idempotent; safe after a failure). No test can run after it. A stop signal meanwhile
        is raised once they are stopped (``exits.stops_held``: cut short, a server group could outlive the run)."""
        self._failed = self._failed or "the series was closed"
        if self.transport is not None:
            log.info("stopping the engines of the series (%d test(s))", self.tests)
            with exits.stops_held():
                self.transport.stop()
