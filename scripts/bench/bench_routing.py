"""Routing and the ledger at fleet scale, simulated: every routing policy over 64-256 engine-free replicas.

Drives the real ``Dispatcher`` (``sut.core.dispatcher``), every routing policy (``sut.core.routing``) and
the real ledgers (``SampleLedger``; ``StreamingLedger`` with first tokens in the Server cases) over
``SimTransport`` replicas (``sut/core/transports/sim.py``: no model; ``replicas`` spread over ``nodes``
emulated nodes, one delivery thread per node). LoadGen is not involved: a recorder stands in for
``QuerySamplesComplete`` / ``FirstTokenComplete`` and counts every answer (``python -m sut`` runs LoadGen).

Cases (per policy, per fleet size):

* ``instant`` replicas answer every chunk at once: the harness's CPU per sample and samples/s.
  ``offline``: one query of every sample (LoadGen's Offline); ``server``: one sample per query, first
  tokens streamed.
* ``step`` replicas emulate continuous-batching engines in lock-step ticks (engine-step-sized result
  batches; ``sut.core.transports.sim``): ``offline`` dispatches one burst and reports the outstanding tokens per
  replica at its end; ``server`` dispatches Poisson arrivals each tick at ``LOAD`` (80 %) of the
  fleet's capacity and reports outstanding tokens per replica after every tick's dispatch (past the
  first ``out_len`` ticks of warm-up).

Request mixes: ``cnn`` (every policy): prompt lengths of CNN/DailyMail (``sut.data.synthetic``: lognormal,
median 782, clipped to [76, 2540]), a shared 28-token header, random ids; ``shared`` (``prefix_affinity``
and ``least_loaded`` for comparison): documents of CNN length (782 ± 50 %) each asked several
48-token questions, popularity Zipf ``s = 1`` (``sut.locality.trace``), replicas reuse a document they
have seen (``SimOptions.cache_docs``). The ``prefix_affinity`` map's memory is also measured at its bound
(filled past ``max_entries`` with distinct prefixes).

First, per fleet size, the routing policy alone (``router_cost``: µs a request). Per case: exactly-once
(every sample answered once, every first token once, no failure), balance (``max/mean`` and
``max/min`` of outstanding tokens across replicas; ``routed`` request counts), harness
CPU µs per sample (process CPU less the simulated replicas' own, ``SimTransport.sim_cpu_s``), and for
``prefix_affinity`` the map's entries, bytes and evictions. Verdicts: exactly-once; every replica used
in the step cases and their ``max/mean`` within ``BALANCE_BOUND`` (a policy that sends everything to one
replica reads ``replicas``), except ``prefix_affinity`` on the shared mix, whose booked load may differ
between replicas by at most ``GATE_SLACK`` x (``release_tokens`` plus one request): its ``excess`` release
gate, with an allowance for work that completed elsewhere since the owner's last hit; the map within
``max_entries`` and ``MAP_ENTRY_BYTES`` per entry. ``prefix_affinity`` on the shared mix also runs with
``release_tokens`` = ``TIGHT_RELEASE`` (the knob's trade: fewer cache hits, better balance).

Usage::

    python scripts/bench/bench_routing.py --quick            # 64 replicas on 8 nodes, small counts (~1 min)
    python scripts/bench/bench_routing.py --json results/bench_routing.json   # 64 and 256 replicas

Exit 0 when every verdict holds, 1 when one fails, 2 for bad arguments (before anything runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from sut.constants import LLAMA31_EOS, MAX_NEW_TOKENS  # noqa: E402
from sut.core.dispatcher import Dispatcher  # noqa: E402
from sut.core.routing import ROUTERS, AffinitySettings, make_router  # noqa: E402
from sut.core.routing.prefix_affinity import MAP_ENTRY_BYTES  # noqa: E402
from sut.core.transport import TransportSpec  # noqa: E402
from sut.core.transports.sim import SimOptions, SimTransport  # noqa: E402
from sut.data.synthetic import SyntheticSettings, make_lengths  # noqa: E402
from sut.engine import GenerationSettings  # noqa: E402
from sut.ledger.sample import SampleLedger  # noqa: E402
from sut.ledger.streaming import StreamingLedger  # noqa: E402
from sut.locality.trace import TraceSettings, make_trace  # noqa: E402
from sut.messages import Request  # noqa: E402

#: Offered load of the ``step`` / ``server`` cases, as a share of the fleet's capacity (``capacity_per_tick``).
LOAD = 0.8
#: Largest ``max/mean`` of outstanding tokens a step case may show (cache-blind policies stay near 1.0-1.6; a
#: policy that piles everything on one replica reads ``replicas``). Not for ``prefix_affinity`` on the shared
#: mix, which trades balance for cache hits up to its release gate: there the router's booked load may differ
#: between replicas by at most ``release_tokens`` plus one request's work (``gate_bound``) when the owner takes
#: a request; completions on other replicas may widen the gap after that, hence ``GATE_SLACK``.
BALANCE_BOUND = 2.0
GATE_SLACK = 1.25
#: ``release_tokens`` of the extra ``prefix_affinity`` case on the shared mix (the default is 65,536).
TIGHT_RELEASE = 8192
#: Dispatcher chunk (the harness default, ``sut.core.loadgen_sut``).
CHUNK = 512


@dataclass(frozen=True)
class Sizes:
    """Sample counts of one size of run: ``offline`` samples per Offline case, ``server_ticks`` ticks of
    arrivals per step/Server case, ``instant_server`` samples per instant/Server case, ``pool`` distinct
    cnn prompts, ``docs_per_replica`` / ``questions`` of the shared mix, ``map_entries`` the map bound
    for the memory case (its default: ``AffinitySettings.max_entries``)."""

    offline: int = 13368
    server_ticks: int = 512
    instant_server: int = 13368
    pool: int = 13368
    docs_per_replica: int = 4
    questions: int = 8
    map_entries: int = 65536


FULL = Sizes()
QUICK = Sizes(offline=2048, server_ticks=192, instant_server=2048, pool=2048, questions=4, map_entries=4096)


@dataclass(frozen=True)
class Case:
    policy: str
    replicas: int
    nodes: int
    mode: str  # instant | step
    scenario: str  # offline | server
    mix: str  # cnn | shared
    release_tokens: int = AffinitySettings.release_tokens  # prefix_affinity's gate


@dataclass
class Workload:
    """Prompts by QSL index (int32 arrays); per index the document (-1: none) and its prefix length."""

    name: str
    prompts: list
    doc_of: np.ndarray
    prefix_tokens: np.ndarray

    @property
    def mean_tokens(self) -> float:
        return float(np.mean([len(p) for p in self.prompts]))


def cnn_mix(pool: int, seed: int = 0) -> Workload:
    """``pool`` prompts with CNN/DailyMail lengths (``sut.data.synthetic``), a common 28-token header."""
    s = SyntheticSettings(samples=pool, seed=seed)
    rng = np.random.default_rng(seed + 1)
    header = rng.integers(1000, 120000, s.header_len, dtype=np.int32)
    prompts = [np.concatenate([header, rng.integers(1000, 120000, int(n) - s.header_len, dtype=np.int32)])
               for n in make_lengths(s)]
    return Workload("cnn", prompts, np.full(pool, -1), np.zeros(pool, dtype=np.int64))


def shared_mix(documents: int, questions: int, seed: int = 0) -> Workload:
    """Documents of CNN length asked ``questions`` questions each on average, Zipf s=1 popularity."""
    trace = make_trace(TraceSettings(documents=documents, doc_tokens=782, doc_jitter=0.5, questions=questions,
                                     question_tokens=48, max_tokens=MAX_NEW_TOKENS, zipf_s=1.0, seed=seed))
    return Workload("shared", [t.prompt for t in trace], np.array([t.document for t in trace]),
                    np.array([t.prefix_tokens for t in trace]))


def capacity_per_tick(o: SimOptions, mean_tokens: float) -> float:
    """Requests per tick one step-mode replica finishes at most: sequence slots over a request's
    ``out_len`` steps, or the step's token budget over a request's tokens, whichever is smaller."""
    return min(o.max_seqs / o.out_len, o.step_tokens / (mean_tokens + o.out_len))


class Recorder:
    """LoadGen's stand-in: counts every answer and first token per LoadGen sample id (``0..total-1``)."""

    def __init__(self, total: int):
        self.answers, self.firsts = [0] * total, [0] * total

    def complete(self, batch) -> None:
        a = self.answers
        for sid, _ in batch:
            a[sid] += 1

    def first(self, batch) -> None:
        f = self.firsts
        for sid, _ in batch:
            f[sid] += 1


def exactly_once(rec: Recorder, ledger, issued: int, streaming: bool) -> Optional[str]:
    """None when every one of ``issued`` samples was answered once (and got one first token when
    streaming) and the ledger saw no failure; else what went wrong."""
    if ledger.error is not None:
        return f"run failed: {ledger.error}"
    bad = [i for i, n in enumerate(rec.answers[:issued]) if n != 1]
    if bad:
        return f"{len(bad)} sample(s) answered other than once (sample {bad[0]}: {rec.answers[bad[0]]} times)"
    if streaming and any(n != 1 for n in rec.firsts[:issued]):
        return "a sample got other than one first token"
    if ledger.completed != issued or ledger.answered_empty:
        return f"ledger: {ledger.completed} completed, {ledger.answered_empty} empty of {issued}"
    return None


def spread(tokens: list) -> dict:
    """``max/mean`` and ``max/min`` (None when a replica holds nothing) of per-replica outstanding tokens."""
    mx, mn, mean = max(tokens), min(tokens), sum(tokens) / len(tokens)
    return {"max_over_mean": mx / mean if mean else 1.0, "max_over_min": mx / mn if mn > 0 else None}


def summarize_spreads(points: list) -> dict:
    """Over a series of ``spread`` points: mean and worst ``max/mean``; median and worst ``max/min`` and the
    share of points where some replica held nothing."""
    mm = [p["max_over_mean"] for p in points]
    ratios = [p["max_over_min"] for p in points if p["max_over_min"] is not None]
    return {"points": len(points), "max_over_mean_avg": float(np.mean(mm)), "max_over_mean_worst": max(mm),
            "max_over_min_median": float(np.median(ratios)) if ratios else None,
            "max_over_min_worst": max(ratios) if ratios else None,
            "idle_replica_share": 1 - len(ratios) / len(points),
            "booked_gap_worst": max(p["booked_gap"] for p in points)}


class Bench:
    """One case's objects: ledger, recorder, simulated fleet, router and dispatcher (``build``)."""

    def __init__(self, case: Case, wl: Workload, total: int, map_entries: int, seed: int = 0):
        """``total``: LoadGen samples this case may issue; ``map_entries``: the affinity map's bound."""
        self.case, self.wl, self.total, self.seed = case, wl, total, seed
        self.streaming = case.scenario == "server"
        self.rec = Recorder(total)
        if self.streaming:
            self.ledger = StreamingLedger(LLAMA31_EOS, progress=False, complete_fn=self.rec.complete,
                                          first_fn=self.rec.first)
        else:
            self.ledger = SampleLedger(LLAMA31_EOS, progress=False, complete_fn=self.rec.complete)
        opts = SimOptions(replicas=case.replicas, nodes=case.nodes, mode=case.mode, out_len=MAX_NEW_TOKENS,
                          cache_docs=wl.name == "shared", doc_of=wl.doc_of, prefix_tokens=wl.prefix_tokens)
        gen = GenerationSettings(max_tokens=MAX_NEW_TOKENS, eos_token_ids=LLAMA31_EOS)
        self.sim = SimTransport(TransportSpec(engine=None, generation=gen, options=opts, stream=self.streaming))
        self.router = make_router(case.policy, case.replicas, MAX_NEW_TOKENS,
                                  AffinitySettings(max_entries=map_entries, release_tokens=case.release_tokens))
        self.dispatcher = Dispatcher(self.sim, self.router, self.ledger, chunk=CHUNK)
        self.samples = [SimpleNamespace(id=i, index=i % len(wl.prompts)) for i in range(total)]
        self.driver_sim_cpu = 0.0  # the driver's own bookkeeping (balance snapshots), not the harness's

    def issue(self, samples: list) -> None:
        """What ``TransportSUT.issue_queries`` and its dispatch thread do with a LoadGen query."""
        prompts = self.wl.prompts
        self.dispatcher.dispatch([Request(rid, prompts[idx], idx) for rid, idx in self.ledger.issue(samples)])

    def snapshot(self) -> dict:
        """``spread`` of the replicas' outstanding tokens, and ``booked_gap``: the router's largest minus
        smallest estimated load (tokens; what the ``excess`` release gate bounds)."""
        c0 = time.thread_time()
        s = spread(self.sim.outstanding_tokens())
        s["booked_gap"] = max(self.router.load) - min(self.router.load)
        self.driver_sim_cpu += time.thread_time() - c0
        return s

    def drain(self, max_ticks: int) -> int:
        """Tick until every issued sample is answered (step mode); returns the ticks taken. ``RuntimeError``
        past ``max_ticks`` (a lost request: the sim or the dispatcher is broken)."""
        t0 = self.sim.t
        while self.ledger.outstanding:
            if self.sim.t - t0 > max_ticks:
                raise RuntimeError(f"{self.ledger.outstanding} sample(s) still outstanding after {max_ticks} ticks")
            self.sim.tick()
        return self.sim.t - t0


def drive_instant(b: Bench) -> dict:
    """Offline: one query of every sample; Server: one query per sample. Waits until all are answered."""
    if b.case.scenario == "offline":
        b.issue(b.samples)
    else:
        for s in b.samples:
            b.issue([s])
    if not b.ledger.idle.wait(120):
        raise RuntimeError(f"{b.ledger.outstanding} sample(s) still outstanding after 120 s")
    return {}


def drive_step_offline(b: Bench) -> dict:
    """One burst of every sample; outstanding tokens per replica at its end; ticks to drain."""
    b.issue(b.samples)
    end = b.snapshot()
    return {"end_of_burst": end, "drain_ticks": b.drain(100 * b.total)}


def drive_step_server(b: Bench, ticks: int) -> dict:
    """Poisson arrivals at ``LOAD`` x capacity per tick for ``ticks`` ticks, a snapshot after each tick's
    dispatch (warm-up: the first ``out_len`` ticks are not summarized), then drain."""
    rate = LOAD * b.case.replicas * capacity_per_tick(b.sim.o, b.wl.mean_tokens)
    counts = np.random.default_rng(b.seed).poisson(rate, ticks)
    points, pos = [], 0
    for t, n in enumerate(counts):
        n = min(int(n), b.total - pos)
        if n:
            b.issue(b.samples[pos:pos + n])
            pos += n
        if t >= b.sim.o.out_len:
            points.append(b.snapshot())
        b.sim.tick()
    b.drain(100 * b.total)
    return {"issued": pos, "arrivals_per_tick": rate, "over_time": summarize_spreads(points)}


def case_total(case: Case, sizes: Sizes, wl: Workload) -> int:
    """Samples a case may issue (step/Server: its expected arrivals plus 10 sigma)."""
    if case.mode == "step" and case.scenario == "server":
        o = SimOptions(replicas=case.replicas, nodes=case.nodes, out_len=MAX_NEW_TOKENS)
        mean = LOAD * case.replicas * capacity_per_tick(o, wl.mean_tokens) * sizes.server_ticks
        return int(mean + 10 * math.sqrt(mean) + 10)
    return sizes.offline if case.scenario == "offline" else sizes.instant_server


def run_case(case: Case, wl: Workload, sizes: Sizes) -> dict:
    """Run one case; returns its figures and verdicts (``exactly_once``: None or what went wrong)."""
    b = Bench(case, wl, case_total(case, sizes, wl), sizes.map_entries)
    b.dispatcher.start()
    try:
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if case.mode == "instant":
            out = drive_instant(b)
        elif case.scenario == "offline":
            out = drive_step_offline(b)
        else:
            out = drive_step_server(b, sizes.server_ticks)
        b.sim.tick()  # every node thread's CPU figure is current after a tick
        if not b.ledger.wait_sent(60):
            raise RuntimeError("answers still queued for the recorder after 60 s")
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        b.sim.stop()
    issued = b.ledger.issued
    harness_cpu = cpu - b.sim.sim_cpu_s() - b.driver_sim_cpu
    out.update(case.__dict__, samples=issued, wall_s=wall, samples_per_s=issued / wall if wall else None,
               cpu_us_per_sample=1e6 * harness_cpu / issued, sim_cpu_share=1 - harness_cpu / cpu if cpu else None,
               exactly_once=exactly_once(b.rec, b.ledger, issued, b.streaming),
               routed_max_over_min=max(b.router.routed) / max(1, min(b.router.routed)),
               replicas_unused=sum(1 for n in b.router.routed if n == 0),
               gate_bound=GATE_SLACK * (case.release_tokens + max(map(len, wl.prompts)) + MAX_NEW_TOKENS))
    if case.policy == "prefix_affinity":
        out["affinity"] = affinity_figures(b.router)
    return out


def affinity_figures(router) -> dict:
    """The prefix-affinity map: entries, bytes (``map_bytes``), its bound, evictions, hits and releases."""
    st = router.stats()
    n, nbytes = len(router.map), router.map_bytes()
    return {"entries": n, "max_entries": router.settings.max_entries, "bytes": nbytes,
            "bytes_per_entry": nbytes / n if n else None, "bound_bytes": router.settings.max_entries * MAP_ENTRY_BYTES,
            "evictions": st["evictions"], "hits": st["affinity_hits"], "releases": st["releases"],
            "new_prefixes": st["new_prefixes"]}


def map_at_bound(replicas: int, max_entries: int, fills: float = 2.0) -> dict:
    """Fill a ``prefix_affinity`` map with ``fills x max_entries`` distinct prefix blocks (1,024-token prompts
    that differ in their first id: 4 new entries each) and report it: it must stay within its bound."""
    router = make_router("prefix_affinity", replicas, MAX_NEW_TOKENS, AffinitySettings(max_entries=max_entries))
    prompt = np.random.default_rng(0).integers(1000, 120000, 4 * router.settings.block_tokens, dtype=np.int32)
    worst = 0
    n = int(fills * max_entries) // router.settings.prefix_blocks
    for i in range(n):
        prompt[0] = i
        router.route(i, prompt)
        router.done(i)
        if i % 1024 == 1023:
            worst = max(worst, router.map_bytes())
    out = affinity_figures(router)
    out.update(prompts=n, worst_bytes=max(worst, out["bytes"]))
    return out


def router_cost(policy: str, replicas: int, prompts: list, repeats: int = 3) -> float:
    """The routing policy alone: CPU µs per request for ``route`` + ``first`` + ``done`` (about ``2 x replicas``
    requests in flight), the best of ``repeats`` passes over ``prompts``."""
    best = math.inf
    for _ in range(repeats):
        r = make_router(policy, replicas, MAX_NEW_TOKENS)
        c0 = time.process_time()
        for i, p in enumerate(prompts):
            r.route(i, p)
            r.first(i)
            if i >= 2 * replicas:
                r.done(i - 2 * replicas)
        best = min(best, (time.process_time() - c0) / len(prompts) * 1e6)
    return best


def cases_for(policies: list, fleets: list) -> list:
    """Every policy on the cnn mix in all four (mode, scenario) pairs; ``prefix_affinity`` and ``least_loaded``
    also on the shared mix (instant/Offline for cost, step/Server for balance), ``prefix_affinity`` there once more
    with ``TIGHT_RELEASE``; per fleet ``(replicas, nodes)``."""
    out = []
    for replicas, nodes in fleets:
        for p in policies:
            for mode in ("instant", "step"):
                for scenario in ("offline", "server"):
                    out.append(Case(p, replicas, nodes, mode, scenario, "cnn"))
            if p in ("prefix_affinity", "least_loaded"):
                out += [Case(p, replicas, nodes, "instant", "offline", "shared"),
                        Case(p, replicas, nodes, "step", "server", "shared")]
            if p == "prefix_affinity":
                out.append(Case(p, replicas, nodes, "step", "server", "shared", release_tokens=TIGHT_RELEASE))
    return out


def verdicts(r: dict) -> list:
    """What a case result breaks (empty: nothing): exactly-once, the balance bound of step cases, the map bound."""
    bad = [] if r["exactly_once"] is None else [r["exactly_once"]]
    if r["mode"] == "step":
        if "end_of_burst" in r:
            worst, gap = r["end_of_burst"]["max_over_mean"], r["end_of_burst"]["booked_gap"]
        else:
            worst, gap = r["over_time"]["max_over_mean_avg"], r["over_time"]["booked_gap_worst"]
        if r["policy"] == "prefix_affinity" and r["mix"] == "shared":
            if gap > r["gate_bound"]:
                bad.append(f"booked load gap {gap:,.0f} tokens > {GATE_SLACK} x (release_tokens + one request) = "
                           f"{r['gate_bound']:,.0f}")
        elif worst > BALANCE_BOUND:
            bad.append(f"outstanding tokens max/mean {worst:.2f} > {BALANCE_BOUND}")
        if r["replicas_unused"]:
            bad.append(f"{r['replicas_unused']} replica(s) got no request")
    aff = r.get("affinity")
    if aff and (aff["entries"] > aff["max_entries"] or aff.get("worst_bytes", aff["bytes"]) > aff["bound_bytes"]):
        bad.append(f"affinity map {aff['entries']} entries / {aff.get('worst_bytes', aff['bytes'])} bytes over its "
                   f"bound ({aff['max_entries']} / {aff['bound_bytes']})")
    return bad


def balance_text(r: dict) -> str:
    if r["mode"] != "step":
        return f"routed max/min {r['routed_max_over_min']:.2f}"
    if "end_of_burst" in r:
        e = r["end_of_burst"]
        mn = "-" if e["max_over_min"] is None else f"{e['max_over_min']:.2f}"
        return f"end of burst max/mean {e['max_over_mean']:.2f} max/min {mn}; drain {r['drain_ticks']} ticks"
    o = r["over_time"]
    mn = "-" if o["max_over_min_median"] is None else f"{o['max_over_min_median']:.2f}"
    return (f"max/mean avg {o['max_over_mean_avg']:.2f} worst {o['max_over_mean_worst']:.2f}; "
            f"max/min median {mn}; idle-replica ticks {100 * o['idle_replica_share']:.0f} %; "
            f"booked gap {o['booked_gap_worst']:,.0f}")


def line(r: dict) -> str:
    aff = r.get("affinity")
    extra = "" if not aff else (f"  map {aff['entries']} entries {aff['bytes'] / 1e6:.2f} MB, hits {aff['hits']}, "
                                f"releases {aff['releases']}")
    ok = "ok" if not r["verdicts"] else "FAIL: " + "; ".join(r["verdicts"])
    mix = r["mix"] if r["release_tokens"] == AffinitySettings.release_tokens else f"{r['mix']}@{r['release_tokens']}"
    return (f"{r['policy']:15s} {r['replicas']:4d}/{r['nodes']:<3d} {r['mode']:7s} {r['scenario']:7s} {mix:11s} "
            f"{r['samples']:6d} {r['cpu_us_per_sample']:7.1f} µs {r['samples_per_s']:9.0f}/s  {balance_text(r)}"
            f"{extra}  [{ok}]")


def machine() -> dict:
    """Date, commit and machine of a run (for the record)."""
    try:
        git = ["git", "-C", str(REPO)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
        commit = commit and commit + ("+changes" if changed else "")
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else None
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "commit": commit, "cpu": cpu, "cores": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0], "python": platform.python_version()}


def parse_fleet(text: str) -> tuple:
    """``REPLICAS`` or ``REPLICAS:NODES`` (default nodes: one per 8 replicas, at least 1)."""
    parts = text.split(":")
    try:
        replicas = int(parts[0])
        nodes = int(parts[1]) if len(parts) == 2 else max(1, replicas // 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a fleet is REPLICAS or REPLICAS:NODES (integers), got {text!r}") from None
    if len(parts) > 2 or replicas < 1 or not 1 <= nodes <= replicas:
        raise argparse.ArgumentTypeError(f"a fleet needs replicas >= 1 and 1 <= nodes <= replicas, got {text!r}")
    return replicas, nodes


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench/bench_routing.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="64 replicas on 8 nodes and small sample counts (the test's path)")
    p.add_argument("--fleet", type=parse_fleet, nargs="+", default=None, metavar="R[:N]",
                   help="fleets to simulate, REPLICAS[:NODES] (default 64:8 256:32; --quick: 64:8)")
    p.add_argument("--policies", nargs="+", choices=sorted(ROUTERS), default=sorted(ROUTERS))
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--no-map-bound", action="store_true", help="skip filling the affinity map to its bound")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Every case of ``args``; returns ``{"machine", "sizes", "cases", "map_at_bound", "failed"}`` and prints a line
    per case."""
    sizes = QUICK if args.quick else FULL
    fleets = args.fleet or ([(64, 8)] if args.quick else [(64, 8), (256, 32)])
    out = {"machine": machine(), "sizes": sizes.__dict__, "cases": [], "map_at_bound": None, "router_us": {}}
    mixes = {"cnn": cnn_mix(sizes.pool)}
    for replicas, _ in fleets:
        costs = {p: router_cost(p, replicas, mixes["cnn"].prompts[:2000]) for p in args.policies}
        out["router_us"][str(replicas)] = costs
        print(f"routing alone, {replicas} replicas (µs a request: route + first + done): "
              + ", ".join(f"{p} {c:.1f}" for p, c in costs.items()), flush=True)
    for case in cases_for(args.policies, fleets):
        if case.mix == "shared":
            key = f"shared-{case.replicas}"
            if key not in mixes:
                mixes[key] = shared_mix(sizes.docs_per_replica * case.replicas, sizes.questions)
            wl = mixes[key]
        else:
            wl = mixes["cnn"]
        r = run_case(case, wl, sizes)
        r["verdicts"] = verdicts(r)
        print(line(r), flush=True)
        out["cases"].append(r)
    if "prefix_affinity" in args.policies and not args.no_map_bound:
        m = map_at_bound(fleets[-1][0], sizes.map_entries)
        m["verdicts"] = verdicts({"exactly_once": None, "mode": "map", "affinity": m})
        print(f"prefix_affinity map at its bound: {m['entries']} entries (max {m['max_entries']}), "
              f"{m['worst_bytes'] / 1e6:.2f} MB worst ({m['bytes'] / m['entries']:.0f} B/entry), bound "
              f"{m['bound_bytes'] / 1e6:.2f} MB, {m['evictions']} evictions", flush=True)
        out["map_at_bound"] = m
    out["failed"] = [r for r in out["cases"] + [out["map_at_bound"] or {}] if r.get("verdicts")]
    return out


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        print(f"bench_routing: --json {args.json}: folder {args.json.parent} does not exist", file=sys.stderr)
        return 2
    out = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=float) + "\n")
    if out["failed"]:
        print(f"{len(out['failed'])} case(s) failed a verdict", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
