"""LoadGen-only reproduction of the early-failure crash: no engine, no model.

Each round runs one LoadGen Offline performance test (mlperf.conf's settings for ``llama3_1-8b``:
equal issue, token latencies, ``min_query_count`` 13,368 by default) over a QSL of ``--samples``
samples. ``issue_queries`` starts a helper thread that answers every issued sample with an empty
response and then returns at once, the way an engine watcher thread answers a whole query when
its engine dies before the first sample completes.

``--via raw``: the helper calls ``QuerySamplesComplete`` itself (what the ledger's fail path did
before the fix). LoadGen logs every completion through a per-thread log buffer (``TlsLogger``);
when that thread exits while LoadGen's IO thread is still swapping its buffer, LoadGen frees the
buffer while a swap of it is still pending, and the IO thread then works on freed memory (gdb:
SIGSEGV in ``TlsLogger::SwapBuffers`` called from ``Logger::IOThread``, ``this`` = the exited
thread's logger): exit 139, in about one round of ten on a 2-core host (so nearly every 20-round
run), 5 of 6 single runs on the host. A helper that sleeps 2 ms before it ends, or
never ends, does not crash.

``--via ledger-fail`` / ``--via ledger-complete``: the helper calls ``SampleLedger.fail`` /
``SampleLedger.complete`` and exits; the ledger must hand the ``QuerySamplesComplete`` calls to a
thread that never exits, so every round ends normally.

Prints one line per round; exit 0 when every round answered every issued sample exactly once,
1 otherwise (a crash shows as the signal's exit code, e.g. 139).

Usage: ``python tests/loadgen_exit_repro.py --via raw --rounds 20``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def settings(lg, min_query_count: int):
    """mlperf.conf's Offline settings for llama3_1-8b (FromConfig should run once per process, so
    every round reuses this one result); a 1 s minimum duration keeps rounds short."""
    ref = lg.TestSettings()
    ref.scenario = lg.TestScenario.Offline
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as f:
        f.write("llama3_1-8b.Offline.target_qps = 3\n")
        f.flush()
        if ref.FromConfig(f.name, "llama3_1-8b", "Offline") != 0:
            raise SystemExit("FromConfig failed")
    ref.mode = lg.TestMode.PerformanceOnly
    ref.min_duration_ms = 1000
    if min_query_count:
        ref.min_query_count = min_query_count
    return ref


def one_round(lg, ts, n_samples: int, via: str, outdir: str) -> tuple[int, int]:
    """Run one test; return ``(issued, answered)`` sample counts."""
    from sut.base import SampleLedger

    answered = []
    ledger = None if via == "raw" else SampleLedger((128009,), progress=False, complete_fn=_counting(answered))

    def answer_raw(samples):
        from sut.ledger.response import complete_samples

        complete_samples([(s.id, np.zeros(0, np.int32)) for s in samples])
        answered.extend(s.id for s in samples)

    def answer_ledger(samples):
        pairs = ledger.issue(samples)
        if via == "ledger-fail":
            ledger.fail("engine 0 died before the first sample completed (reproduction)")
        else:
            ledger.complete([(rid, np.zeros(0, np.int32)) for rid, _ in pairs])

    issued = []

    def issue(samples):
        issued.extend(samples)
        target = answer_raw if via == "raw" else answer_ledger
        threading.Thread(target=target, args=(list(samples),), name="short-lived", daemon=True).start()

    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(n_samples, n_samples, lambda _: None, lambda _: None)
    out = lg.LogOutputSettings()
    out.outdir = outdir
    out.copy_summary_to_stdout = False
    ls = lg.LogSettings()
    ls.log_output = out
    lg.StartTestWithLogSettings(sut, qsl, ts, ls, os.path.join(outdir, "no-audit.config"))
    lg.DestroySUT(sut)
    lg.DestroyQSL(qsl)
    if ledger is not None:
        ledger.close()
    return len(issued), len(answered)


def _counting(answered: list):
    from sut.ledger.response import complete_samples

    def fn(results):
        complete_samples(results)
        answered.extend(sid for sid, _ in results)

    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--via", choices=["raw", "ledger-fail", "ledger-complete"], default="ledger-fail")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--samples", type=int, default=13368, help="QSL size (default: the official 13,368)")
    p.add_argument("--min-query-count", type=int, default=0, help="0 = mlperf.conf's (13,368)")
    a = p.parse_args(argv)
    import mlperf_loadgen as lg

    ts = settings(lg, a.min_query_count)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            t0 = time.monotonic()
            issued, answered = one_round(lg, ts, a.samples, a.via, tmp)
            print(f"round {r}: {answered} of {issued} issued samples answered in {time.monotonic() - t0:.2f} s",
                  flush=True)
            ok = ok and issued == answered > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
