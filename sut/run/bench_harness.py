"""``python -m sut bench-harness``: the harness's own cost per sample under real LoadGen, next to a bare LoadGen SUT.

What runs
---------
Real LoadGen (the installed ``mlperf_loadgen``, 6.0.17) over a 13,368-sample QSL of synthetic prompts (CNN/DailyMail
lengths: ``sut.data.synthetic.make_lengths``), in one process, case after case:

* ``loadgen``: a bare LoadGen SUT (:class:`BareSUT`): ``issue_queries`` queues the samples, one long-lived thread
  answers them (Server: ``FirstTokenComplete`` first), every response pointing at one 128-id buffer. What LoadGen
  itself costs; nothing is checked.
* ``harness``: the product's path, ``TransportSUT`` (ledger, dispatcher, routing policy, the completer thread, the
  watch of ``sut.run.loadgen_watch``) over the ``sim`` transport (``sut.core.transports.sim``: engine-free replicas,
  one delivery thread each) with 1 or 8 replicas, answering 128 ids a sample either ``instant`` (every submitted
  chunk answered at once, first tokens first) or ``step`` (continuous-batching engines stepped every ``STEP_TICK_S``
  of wall time: each step's first tokens and completions of a replica go out as one call, as real engines deliver).
  Every check of the run stays on: exactly-once, the replica check, the answer check (lengths, ids inside Llama 3's
  vocabulary, EOS at the end of a short answer), the EOS cut, first token = first id; a case whose ledger failed,
  or that answered other than every issued sample once, fails the command.

Scenarios: ``Offline`` (one query of ``Sizes.offline_samples``); ``Server`` with first tokens, saturated (LoadGen
issues ``Sizes.server_queries`` one-sample queries at ``SATURATED_QPS``, far above what the harness can answer: the
samples/s read is its capacity), and at the fixed rates ``FIXED_QPS`` (8 instant replicas, ``Sizes.fixed_s``
seconds), where the TTFT p99 the harness adds over the bare SUT at the same rate is reported.

Figures per case (``--json FILE``: ``{"cases": [...], ...}``; medians over ``Sizes.rounds`` rounds, every case once
a round, in the same order): ``samples_per_s`` (LoadGen's: Offline ``result_samples_per_second``, Server
``result_completed_samples_per_sec``); ``cpu_us_per_sample`` (the process's CPU time over the LoadGen test, LoadGen's
threads included, less the simulated replicas' own (``SimTransport.sim_cpu_s``), per sample, µs); ``ratio_to_loadgen``
(that CPU over the bare SUT's of the same scenario and rate); ``ttft_p99_ms`` (LoadGen's TTFT p99, Server);
``ttft_p99_added_ms`` (fixed-rate harness cases: over the bare SUT's).

On a shared machine the figures move with the other jobs' load (recorded as ``loadavg``): compare figures of one
run, or runs alternated in time.
"""

from __future__ import annotations

import array
import dataclasses
import json
import logging
import math
import os
import platform
import queue
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from sut.base import SUTContext
from sut.constants import LLAMA3_VOCAB, LLAMA31_EOS, MAX_NEW_TOKENS
from sut.core.loadgen_sut import TransportSUT
from sut.core.transports.sim import SimOptions, SimTransport
from sut.data.dataset import Dataset, QuerySampleLibrary
from sut.data.synthetic import SyntheticSettings, make_lengths
from sut.engine import EngineSettings, GenerationSettings
from sut.errors import RunFailed
from sut.record.loadgen_log import parse_loadgen_detail
from sut.run.loadgen_watch import start_test_interruptible

log = logging.getLogger(__name__)

#: QSL size: llama3_1-8b's performance sample count (mlperf.conf).
QSL_SAMPLES = 13368
#: Server target of the saturated cases (q/s): ~4x the 13,000 samples/s goal, well under what the bare SUT answers.
SATURATED_QPS = 50_000.0
#: Fixed Server rates (q/s): the fastest published 8-accelerator node (~21.7k output tok/s per GPU / 128 tokens x 8
#: GPUs = ~1,300 samples/s), and ~4 times that.
FIXED_QPS = (1300.0, 5000.0)
#: Step replicas: one engine step every STEP_TICK_S s of wall time; a request's first token comes in the step that
#: takes it, its answer STEP_DECODE - 1 steps later; at most STEP_FLEET_SEQS running sequences over the fleet
#: (split over its replicas): at most STEP_FLEET_SEQS / (STEP_DECODE - 1) / STEP_TICK_S = 51,200 samples/s, 4x the goal.
STEP_TICK_S, STEP_DECODE, STEP_FLEET_SEQS = 0.005, 8, 1792
#: Ids per answer (MLPerf's max_tokens); a stall longer than this (s) fails a case.
ANSWER_IDS, STALL_S = MAX_NEW_TOKENS, 60.0


@dataclass(frozen=True)
class Case:
    """One measurement: ``kind`` harness | loadgen; ``scenario`` Offline | Server; ``replicas`` and ``replies``
    (instant | step) for the harness (None for the bare SUT); ``target_qps`` a fixed Server rate (None: Offline, or
    Server saturated)."""

    kind: str
    scenario: str
    replicas: Optional[int] = None
    replies: Optional[str] = None
    target_qps: Optional[float] = None

    @property
    def label(self) -> str:
        who = "loadgen (bare SUT)" if self.kind == "loadgen" else f"harness {self.replicas} x {self.replies}"
        rate = "" if self.scenario == "Offline" else (f" @ {self.target_qps:,.0f} q/s" if self.target_qps
                                                       else " saturated")
        return f"{self.scenario}{rate}, {who}"


@dataclass(frozen=True)
class Sizes:
    """Samples per Offline case, queries per saturated Server case, seconds per fixed-rate case, rounds."""

    offline_samples: int
    server_queries: int
    fixed_s: float
    rounds: int


QUICK = Sizes(offline_samples=QSL_SAMPLES, server_queries=QSL_SAMPLES, fixed_s=2.0, rounds=1)
FULL = Sizes(offline_samples=4 * QSL_SAMPLES, server_queries=2 * QSL_SAMPLES, fixed_s=8.0, rounds=3)


def all_cases(fixed_qps=FIXED_QPS) -> list[Case]:
    """The bare SUT and the harness (1 and 8 replicas, instant and step) in Offline and saturated Server, then
    each fixed Server rate for the bare SUT and the harness over 8 instant replicas."""
    out = [Case("loadgen", "Offline"), Case("loadgen", "Server")]
    for scenario in ("Offline", "Server"):
        out += [Case("harness", scenario, n, replies) for n in (1, 8) for replies in ("instant", "step")]
    for qps in fixed_qps:
        out += [Case("loadgen", "Server", target_qps=qps), Case("harness", "Server", 8, "instant", qps)]
    return out


def bench_dataset(samples: int = QSL_SAMPLES, seed: int = 0) -> Dataset:
    """``samples`` prompts with CNN/DailyMail lengths (views of one random id pool: the harness reads lengths and
    passes prompts on, it never looks inside)."""
    lengths = make_lengths(SyntheticSettings(samples=samples, seed=seed))
    pool = np.random.default_rng(seed).integers(1000, 120000, int(lengths.max()), dtype=np.int32)
    return Dataset("<bench-harness synthetic>", "", [pool[:n] for n in lengths], total_in_file=samples)


class _BareAnswerer:
    """The bare SUT's one long-lived answering thread (a thread that called LoadGen must not end while LoadGen
    runs: ``sut.ledger.sample``). Jobs: ``(sample ids, with first tokens)``; all queued jobs go in one call each."""

    _lock = threading.Lock()
    _queue: Optional[queue.SimpleQueue] = None
    _ids = array.array("B", (np.arange(ANSWER_IDS, dtype="<i4") % 1000 + 10).tobytes())

    @classmethod
    def submit(cls, samples, first: bool) -> None:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.SimpleQueue()
                threading.Thread(target=cls._loop, args=(cls._queue,), name="bare-answerer", daemon=True).start()
        cls._queue.put((samples, first))

    @classmethod
    def _loop(cls, jobs: queue.SimpleQueue) -> None:
        import mlperf_loadgen as lg

        addr, nbytes = cls._ids.buffer_info()
        while True:
            batch = [jobs.get()]
            while not jobs.empty():
                batch.append(jobs.get())
            ids = [s.id for samples, _ in batch for s in samples]
            if batch[0][1]:
                lg.FirstTokenComplete([lg.QuerySampleResponse(i, addr, 4, 1) for i in ids])
            lg.QuerySamplesComplete([lg.QuerySampleResponse(i, addr, nbytes, ANSWER_IDS) for i in ids])


class BareSUT:
    """The bare LoadGen SUT (module docstring): ``issue_queries`` / ``flush_queries`` and nothing else."""

    def __init__(self, first_tokens: bool):
        self.first_tokens = first_tokens

    def issue_queries(self, samples) -> None:
        _BareAnswerer.submit(samples, self.first_tokens)

    def flush_queries(self) -> None:
        pass


class SimSUT(TransportSUT):
    """The product's ``TransportSUT`` over ``sim`` replicas."""

    transport_name = "sim"


def sim_options(case: Case) -> SimOptions:
    """The replicas of a harness case (``STEP_*`` for step replicas; one delivery thread per replica)."""
    n = case.replicas
    if case.replies == "instant":
        return SimOptions(replicas=n, nodes=n, mode="instant", out_len=ANSWER_IDS)
    return SimOptions(replicas=n, nodes=n, mode="step", out_len=STEP_DECODE, answer_len=ANSWER_IDS,
                      tick_s=STEP_TICK_S, max_seqs=math.ceil(STEP_FLEET_SEQS / n), step_tokens=1 << 30)


def test_settings(case: Case, sizes: Sizes):
    """LoadGen ``TestSettings`` of a case (performance mode; no mlperf.conf: the counts are the case's)."""
    import mlperf_loadgen as lg

    ts = lg.TestSettings()
    ts.mode = lg.TestMode.PerformanceOnly
    ts.performance_sample_count_override = QSL_SAMPLES
    ts.min_duration_ms = 0
    if case.scenario == "Offline":
        ts.scenario = lg.TestScenario.Offline
        ts.offline_expected_qps = float(sizes.offline_samples)
        ts.min_query_count = sizes.offline_samples  # Offline: samples in its one query
    else:
        ts.scenario = lg.TestScenario.Server
        ts.use_token_latencies = True
        ts.server_target_qps = case.target_qps or SATURATED_QPS
        n = round(case.target_qps * sizes.fixed_s) if case.target_qps else sizes.server_queries
        ts.min_query_count = n  # max_query_count stays 0 (no cap: LoadGen logs an error when it stops at one)
    return ts


def expected_samples(case: Case, sizes: Sizes) -> int:
    """Samples LoadGen issues in a case (Offline: one query of ``offline_samples``; Server: one per query)."""
    if case.scenario == "Offline":
        return sizes.offline_samples
    return round(case.target_qps * sizes.fixed_s) if case.target_qps else sizes.server_queries


def _log_settings(lg, outdir: str):
    out = lg.LogOutputSettings()
    out.outdir = outdir
    out.copy_summary_to_stdout = False
    ls = lg.LogSettings()
    ls.log_output = out
    return ls


def _figures(case: Case, results: dict, cpu_s: float, samples: int) -> dict:
    """A case's row from LoadGen's results and the CPU seconds it took."""
    sps = results.get("result_samples_per_second" if case.scenario == "Offline" else "result_completed_samples_per_sec")
    ttft = results.get("result_first_token_99.00_percentile_latency_ns")
    return {"scenario": case.scenario, "replicas": case.replicas, "first_tokens": case.scenario != "Offline",
            "kind": case.kind, "replies": case.replies, "target_qps": case.target_qps, "samples": samples,
            "samples_per_s": None if sps is None else float(sps), "cpu_us_per_sample": cpu_s / samples * 1e6,
            "ttft_p99_ms": None if ttft is None else ttft / 1e6}


def run_bare(case: Case, sizes: Sizes, qsl: QuerySampleLibrary, outdir: str) -> dict:
    """One case of the bare SUT; ``RunFailed`` when LoadGen did not get every sample."""
    import mlperf_loadgen as lg

    sut = BareSUT(first_tokens=case.scenario != "Offline")
    handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
    try:
        c0 = time.process_time()
        lg.StartTestWithLogSettings(handle, qsl.handle, test_settings(case, sizes), _log_settings(lg, outdir), "")
        cpu = time.process_time() - c0
    finally:
        lg.DestroySUT(handle)
    results = parse_loadgen_detail(Path(outdir) / "mlperf_log_detail.txt")
    n = expected_samples(case, sizes)
    why = _loadgen_problem(case, results, n)
    if why:
        raise RunFailed(f"{case.label}: {why}")
    return _figures(case, results, cpu, n)


def _loadgen_problem(case: Case, results: dict, n: int) -> Optional[str]:
    """What is wrong with LoadGen's results of a case that should have issued ``n`` samples, or None."""
    if results.get("errors"):
        return f"LoadGen logged {results['errors']} error(s)"
    per_query = n if case.scenario == "Offline" else 1
    issued = (results.get("result_query_count") or 0) * per_query
    return None if issued == n else f"LoadGen issued {issued} samples, {n} expected"


def run_harness(case: Case, sizes: Sizes, dataset: Dataset, qsl: QuerySampleLibrary, outdir: str) -> dict:
    """One case of the harness over ``sim`` replicas; ``RunFailed`` when its run failed or any sample was not
    answered exactly once (with its first token first in Server)."""
    import mlperf_loadgen as lg

    ctx = SUTContext(dataset=dataset, engine=EngineSettings(model="sim"), options=sim_options(case), progress=False,
                     generation=GenerationSettings(eos_token_ids=LLAMA31_EOS), scenario=case.scenario, run_dir=outdir,
                     vocab_size=LLAMA3_VOCAB)
    sut = SimSUT(ctx)
    sim: SimTransport = sut.transport
    handle, returned = None, False
    try:
        sut.start()
        handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
        c0, s0 = time.process_time(), sim.sim_cpu_s()
        error, returned = start_test_interruptible(lg, handle, qsl.handle, test_settings(case, sizes),
                                                   _log_settings(lg, outdir), str(Path(outdir) / "no-audit.config"),
                                                   sut, STALL_S, qsl.performance_sample_count)
        cpu = time.process_time() - c0 - (sim.sim_cpu_s() - s0)
    finally:
        sut.stop()
    if handle is not None and returned:
        lg.DestroySUT(handle)
    results = parse_loadgen_detail(Path(outdir) / "mlperf_log_detail.txt")
    _check_exactly_once(case, sut, error, results, expected_samples(case, sizes))
    return _figures(case, results, cpu, expected_samples(case, sizes))


def _check_exactly_once(case: Case, sut: TransportSUT, error: Optional[str], results: dict, n: int) -> None:
    """``RunFailed`` unless the run had no error, every one of the ``n`` samples was answered once with its output
    (and its first token, Server), and LoadGen logged no error."""
    led = sut.ledger
    first, routed = getattr(led, "first_sent", led.completed), sum(sut.record()["routing"]["answered"])
    counts = (f"{led.issued} issued, {led.completed} answered ({routed} by the replicas they were routed to), "
              f"{led.answered_empty} empty, {first} first tokens, of {n}")
    why = (error or led.error or (counts if not led.issued == led.completed == routed == first == n
                                  or led.answered_empty else None) or _loadgen_problem(case, results, n))
    if why:
        raise RunFailed(f"{case.label}: {why}")


def run_round(cases: list[Case], sizes: Sizes, dataset: Dataset, qsl: QuerySampleLibrary, done: int,
              total: int) -> list:
    """Every case once, in order; logs one line per case (the progress of the command)."""
    rows = []
    for i, case in enumerate(cases):
        with tempfile.TemporaryDirectory(prefix="bench-harness-") as d:
            row = (run_bare(case, sizes, qsl, d) if case.kind == "loadgen"
                   else run_harness(case, sizes, dataset, qsl, d))
        rows.append(row)
        ttft = "" if row["ttft_p99_ms"] is None else f", TTFT p99 {row['ttft_p99_ms']:.2f} ms"
        sps = "n/a" if row["samples_per_s"] is None else f"{row['samples_per_s']:,.0f}"
        log.info("[%d/%d] %s: %s samples/s, %.1f µs CPU a sample%s", done + i + 1, total, case.label, sps,
                 row["cpu_us_per_sample"], ttft)
    return rows


def _median(rows: list, key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r[key] is not None]
    return float(statistics.median(vals)) if vals else None


def summarize(cases: list[Case], rounds: list[list[dict]]) -> list[dict]:
    """One row per case: medians over the rounds; ``ratio_to_loadgen`` (CPU a sample over the bare SUT's of the same
    scenario and rate) and, for fixed-rate harness cases, ``ttft_p99_added_ms`` over the bare SUT's."""
    rows = []
    for i, case in enumerate(cases):
        per = [r[i] for r in rounds]
        row = dict(per[0], rounds=len(per))
        for key in ("samples_per_s", "cpu_us_per_sample", "ttft_p99_ms"):
            row[key] = _median(per, key)
        rows.append(row)
    bare = {(r["scenario"], r["target_qps"]): r for r in rows if r["kind"] == "loadgen"}
    for r in rows:
        ref = bare.get((r["scenario"], r["target_qps"]))
        r["ratio_to_loadgen"] = r["cpu_us_per_sample"] / ref["cpu_us_per_sample"] if ref else None
        if r["kind"] == "harness" and r["target_qps"] and ref and None not in (r["ttft_p99_ms"], ref["ttft_p99_ms"]):
            r["ttft_p99_added_ms"] = r["ttft_p99_ms"] - ref["ttft_p99_ms"]
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table (what the command prints)."""
    head = f"{'case':<44} {'samples/s':>10} {'CPU µs/sample':>14} {'x loadgen':>10} {'TTFT p99 ms':>12} {'added':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        case = Case(r["kind"], r["scenario"], r["replicas"], r["replies"], r["target_qps"])

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        lines.append(f"{case.label:<44} {f(r['samples_per_s'], ',.0f'):>10} {f(r['cpu_us_per_sample'], '.1f'):>14} "
                     f"{f(r['ratio_to_loadgen'], '.1f'):>10} {f(r['ttft_p99_ms'], '.2f'):>12} "
                     f"{f(r.get('ttft_p99_added_ms'), '.2f'):>7}")
    return "\n".join(lines)


def run_bench(sizes: Sizes, cases: Optional[list[Case]] = None) -> dict:
    """Every case ``sizes.rounds`` times (round after round) and the summary: ``{"cases": [...], "sizes", "machine"}``.
    Raises ``RunFailed`` when a case's run failed or lost a sample."""
    import mlperf_loadgen as lg

    cases = all_cases() if cases is None else cases
    dataset = bench_dataset()
    load0 = os.getloadavg()
    qsl = QuerySampleLibrary(dataset, QSL_SAMPLES)
    try:
        rounds = [run_round(cases, sizes, dataset, qsl, k * len(cases), sizes.rounds * len(cases))
                  for k in range(sizes.rounds)]
    finally:
        qsl.destroy()
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor(),
               "loadavg_before": load0, "loadavg_after": os.getloadavg(),
               "loadgen": getattr(lg, "__version__", None)}
    return {"cases": summarize(cases, rounds), "sizes": dataclasses.asdict(sizes), "machine": machine,
            "per_round": rounds}


def main(quick: bool, json_path: Optional[str]) -> int:
    """``python -m sut bench-harness [--quick] [--json FILE]``: run, print the table, write the JSON; exit 0."""
    sizes = QUICK if quick else FULL
    log.info("bench-harness: %d cases x %d round(s); offline %d samples, saturated Server %d queries, fixed rates "
             "%s s each", len(all_cases()), sizes.rounds, sizes.offline_samples, sizes.server_queries, sizes.fixed_s)
    out = run_bench(sizes)
    print(table(out["cases"]))
    print(f"load average before / after: {out['machine']['loadavg_before']} / {out['machine']['loadavg_after']}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1) + "\n")
        log.info("wrote %s", json_path)
    return 0
