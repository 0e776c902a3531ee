"""One LoadGen test on a helper thread, watched from the main thread (``sut.run.harness`` runs it).

``run_loadgen`` builds the QSL and LoadGen's SUT and log settings and runs ``StartTestWithLogSettings`` through
``start_test_interruptible``: the test runs on a thread while the main thread ticks the ledger and watches for
Ctrl-C / SIGTERM, a stall (no sample completed for ``stall_timeout_s``) and any failure; after one it waits at
most ``drain_limit_s`` for LoadGen to return (``LOADGEN_DRAIN_S``, ``STREAMING_DRAIN_S``). ``interrupt_reason``
words a stop for the run record. ``LoadGenObjects`` holds the LoadGen objects, destroyed only once StartTest
has returned. The heap that start-up made (engines' clients, the dataset, the ledger) is frozen out of the
garbage collector (``gc.freeze``) while the test runs, so a full collection does not walk it mid-test.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from sut.base import SystemUnderTest
from sut.data.dataset import Dataset, QuerySampleLibrary
from sut.settings.loadgen import scheduled_queries
from sut.settings.run import RunSettings

log = logging.getLogger("sut.run.harness")  # the run's console lines keep the harness's name


@dataclass
class LoadGenObjects:
    """LoadGen's SUT and QSL of a run; they may be destroyed only once StartTest has returned."""

    sut_handle: Any = None
    qsl: Optional[QuerySampleLibrary] = None
    returned: bool = True
    t_start: Optional[float] = None

    def destroy(self, lg) -> None:
        if not self.returned:
            return
        if self.sut_handle is not None:
            lg.DestroySUT(self.sut_handle)
        if self.qsl is not None:
            self.qsl.destroy()


def run_loadgen(lg, sut: SystemUnderTest, rs: RunSettings, dataset: Dataset, ts, audit_config: Optional[str],
                run_dir: Path, objs: LoadGenObjects) -> Optional[str]:
    """Build the QSL and LoadGen's SUT into ``objs``, run the test; returns the error or None."""
    objs.qsl = QuerySampleLibrary(dataset, ts.performance_sample_count_override)
    objs.sut_handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
    out = lg.LogOutputSettings()
    out.outdir = str(run_dir)
    out.copy_summary_to_stdout = True
    ls = lg.LogSettings()
    ls.log_output = out
    ls.enable_trace = rs.enable_trace
    audit = str(Path(audit_config).resolve()) if audit_config else str(run_dir / "no-audit.config")
    log.info("LoadGen %s %s mode, model key %s, output %s", rs.scenario, rs.mode, rs.model_key, run_dir)
    objs.t_start = time.monotonic()
    objs.returned = True  # nothing runs yet: a Ctrl-C before LoadGen's thread starts leaves none behind

    def started() -> None:
        objs.returned = False

    error, objs.returned = start_test_interruptible(lg, objs.sut_handle, objs.qsl.handle, ts, ls, audit, sut,
                                                    rs.stall_timeout_s, objs.qsl.performance_sample_count,
                                                    on_start=started)
    return error


#: After a failure the ledger answers every outstanding sample, and LoadGen returns within seconds
#: (13,368 samples: well under one) once its schedule has ended: Offline's one query at once. If it has not
#: returned after this long, the run stops waiting.
LOADGEN_DRAIN_S = 120.0
#: Server / Interactive: LoadGen 6.0.17 has no abort and its scheduler goes on issuing queries (each answered
#: empty at once) until min duration and min query count are reached; after a failure the run waits for that
#: schedule only when it ends within ``LOADGEN_DRAIN_S``, plus this grace, else only this grace (seconds).
STREAMING_DRAIN_S = 10.0


def drain_limit_s(ts, streaming: bool, failed_after_s: float, perf_count: int) -> float:
    """Seconds to wait for LoadGen after a failure ``failed_after_s`` seconds into its test (``ts``: its
    ``TestSettings``): Offline ``LOADGEN_DRAIN_S``; Server / Interactive the rest of the schedule
    (``max(min duration, scheduled queries / target_qps)``, a lower bound) plus ``STREAMING_DRAIN_S`` when that
    fits in ``LOADGEN_DRAIN_S``, else just ``STREAMING_DRAIN_S`` (the schedule will not end early).
    ``perf_count``: the QSL's performance sample count; with equal issue (``sample_concatenate_permutation``,
    on for llama3_1-8b in mlperf.conf) LoadGen rounds the query count up to a whole multiple of it."""
    if not streaming:
        return LOADGEN_DRAIN_S
    queries = scheduled_queries(ts, perf_count)
    schedule_s = max(ts.min_duration_ms / 1000.0, queries / ts.server_target_qps)
    wait = STREAMING_DRAIN_S + max(0.0, schedule_s - failed_after_s)
    return wait if wait <= LOADGEN_DRAIN_S else min(STREAMING_DRAIN_S, LOADGEN_DRAIN_S)


def interrupt_reason(e: KeyboardInterrupt) -> str:
    """``interrupted (<signal>)`` for the run record; a bare ``KeyboardInterrupt`` is Ctrl-C."""
    return f"interrupted ({e.args[0] if e.args else 'SIGINT, Ctrl-C'})"


def start_test_interruptible(lg, sut_handle, qsl_handle, ts, ls, audit, sut, stall_timeout_s, perf_count: int,
                             on_start: Callable[[], None] = lambda: None) -> tuple[Optional[str], bool]:
    """Run StartTest on a thread; the main thread watches for Ctrl-C/SIGTERM, stalls and failures.
    ``on_start`` is called just before the thread starts (a Ctrl-C raised before it leaves no thread behind).

    Returns ``(error or None, whether StartTest returned)``. On Ctrl-C or a stall the ledger answers
    the outstanding samples empty so that LoadGen returns, and the run is reported failed. After any
    failure the main thread waits at most ``drain_limit_s`` for LoadGen; a further Ctrl-C during
    that wait is only logged.
    """
    done = threading.Event()
    exc: list = []

    def target():
        try:
            lg.StartTestWithLogSettings(sut_handle, qsl_handle, ts, ls, audit)
        except BaseException as e:  # noqa: BLE001
            exc.append(e)
        finally:
            done.set()

    t = threading.Thread(target=target, name="loadgen", daemon=True)
    gc.collect()
    gc.freeze()  # what start-up made stays out of every collection during the test (unfrozen at its end)
    t_start = time.monotonic()
    on_start()
    t.start()
    led = sut.ledger
    streaming = ts.scenario == lg.TestScenario.Server  # Interactive too
    error = None
    failed_at = drain_s = None
    while not done.is_set():
        try:
            if done.wait(0.5):
                break
            led.tick()
            now = time.monotonic()
            last = led.last_complete_t or led.first_issue_t
            if error is None and last and led.outstanding and now - last > stall_timeout_s:
                detail = sut.stall_detail()
                error = (f"no sample completed for {stall_timeout_s:.0f} s with {led.outstanding} outstanding (stall)"
                         + (f"; {detail}" if detail else ""))
                led.fail(error)
            if failed_at is None and (error or led.error):
                failed_at, drain_s = now, drain_limit_s(ts, streaming, now - t_start, perf_count)
                log.info("waiting up to %.0f s for LoadGen to return (%s)", drain_s,
                         "the rest of its Server schedule" if streaming and drain_s > STREAMING_DRAIN_S
                         else "it may run on; the run is reported failed either way")
            if failed_at is not None and now - failed_at > drain_s:
                error = (f"{error or led.error}; LoadGen did not return within {drain_s:.0f} s after it"
                         + (" (its Server schedule runs on to min duration; no abort in LoadGen)" if streaming else ""))
                log.error("%s", error)
                break
        except KeyboardInterrupt as e:
            if error is None and led.error is None:
                error = interrupt_reason(e)
                led.fail(error)
            else:
                log.warning("already stopping (%s); waiting for LoadGen to return", error or led.error)
    gc.unfreeze()
    if exc:
        error = error or f"LoadGen raised: {exc[0]!r}"
    return error, done.is_set()

