"""The study's pair protocol (``../shared/research/study.md`` §4) over the dispatch core.

Algorithm
---------
A *case* is one system x routing policy in one pair. For pair ``p`` the cases run policy by policy
(the policy list rotated by ``p``) and, for each policy, system by system (the system list rotated
by ``p``: two systems alternate their order from pair to pair, and the two runs a pair ratio
compares run back to back). Every case:

1. builds a **fresh** transport of its system (``sut.locality.systems``: new engines; for Flame new
   sessions) with prefix caching on and per-request detail, and starts it (not timed: model load,
   session set-up). Each replica must report prefix caching on, and its placement (device kind and
   GPU UUID, else the device slot) must equal replica r's placement in every other case: shards
   are pinned to the same GPU on every system, checked against the replicas' own records. The first
   case's engines size their KV cache by memory profiling; later cases get that size
   (``sut.locality.kv_pin``; ``PairSettings.kv_sizing``);
2. runs the **warm-ups** (not timed): the trace with ids shifted inside the vocabulary
   (``trace.warmup_traces``: same lengths and prefix relations, none of the measured prefixes), each
   through a fresh router of the case's policy, validated like the timed burst;
3. runs the **timed burst** (``sut.locality.burst.run_burst``: routing, send, compression, inference,
   completion) through a fresh router, validates every request against the trace's recorded input
   hashes and keeps its metrics, output-id hashes, routing counters and the transport's stats;
4. stops the transport and records the cleanup: seconds, error, and child processes of this
   process that the case started and that are still alive afterwards (none expected).

Between bursts an idle sink is attached: a result or fatal event outside any burst fails the case.
A failing case ends the run (``RunFailed`` names pair, system, policy and the cause); the cases
done so far stay in the record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from sut.constants import MAX_STALL_TIMEOUT_S
from sut.core.routing import AffinitySettings, make_router
from sut.core.transport import Transport, TransportSpec
from sut.engine import EngineSettings, GenerationSettings
from sut.errors import EngineError, RunFailed
from sut.locality import knob
from sut.locality.burst import BurstSettings, run_burst
from sut.locality.kv_pin import KV_SIZINGS, KvPinState, check_pinned, pinned_engine
from sut.locality.systems import System, build_transport
from sut.locality.trace import TraceRequest
from sut.locality.workloads import POLICY_VARIANTS, WorkloadSettings
from sut.messages import FatalEvent, ReplicaRecord

log = logging.getLogger(__name__)

#: Request ids of warm-up ``k`` start at ``(k + 1) x WARMUP_ID_STRIDE``; the timed burst's are the trace rids.
WARMUP_ID_STRIDE = 1_000_000


#: Most pairs one run takes: every pair starts fresh engines for each system and policy (minutes each on a GPU).
MAX_PAIRS = 1000
#: Most warm-up bursts before a timed one (each needs its own id shift that keeps it apart from the trace).
MAX_WARMUPS = 20


@dataclass(frozen=True)
class PairSettings:
    """The protocol's knobs.

    Attributes:
        policies: routing policies run per system (``sut.core.routing``), distinct.
        pairs: fresh pairs (>= 1; the study: 5).
        warmups: id-shifted warm-up bursts before each timed burst (the study: 2).
        rate: arrivals per second (Poisson, ``arrival_seed``); 0 = one burst (the study).
        stall_timeout_s: a burst fails when no request completes for this long.
        progress: progress bar of each timed burst.
    """

    policies: tuple = ("round_robin", "least_loaded", "prefix_affinity")
    pairs: int = knob(5, "fresh pairs: every system x policy starts fresh engines (Flame: fresh sessions) in every "
                         "pair; systems alternate their order from pair to pair")
    warmups: int = knob(2, "warm-up bursts before each timed burst (not timed): the trace with token ids shifted "
                           "inside the vocabulary (same lengths and prefix relations, none of the measured prefixes)")
    rate: float = knob(0.0, "arrivals per second, Poisson; 0 = every request at once (one burst, the study's)")
    arrival_seed: int = knob(0, "seed of the Poisson arrival times")
    stall_timeout_s: float = knob(900.0, "fail the run when no request finishes for this many seconds (a Flame "
                                         "system's executor warm-up has its own limit: --system-option "
                                         "flame.warmup_timeout_s=S)")
    kv_sizing: str = knob("first-case", "first-case = the run's first case with fresh engines sizes their KV cache "
                          "as usual (GPU: vLLM's memory profiling; CPU: --cpu-kvcache-gib) and every later case's "
                          "fresh engines get that cache, recorded as the case's kv_pinned (no profiling, so engines "
                          "sharing a GPU start together; a replica that reports other blocks fails the run; running "
                          "servers, --server-url, are never given it); each-case = every case sizes its own (engines "
                          "sharing a GPU start one after the other)", choices=KV_SIZINGS)
    progress: bool = True

    def __post_init__(self):
        if self.kv_sizing not in KV_SIZINGS:
            raise ValueError(f"kv_sizing must be one of {', '.join(KV_SIZINGS)}, got {self.kv_sizing!r}")
        if not self.policies:
            raise ValueError("at least one policy is needed")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct (use --pairs to repeat them), got {list(self.policies)}")
        if not 1 <= self.pairs <= MAX_PAIRS:
            raise ValueError(f"pairs must be in [1, {MAX_PAIRS}] (each pair starts fresh engines for every system "
                             f"and policy; the study: 5), got {self.pairs}")
        if self.arrival_seed < 0:
            raise ValueError(f"arrival_seed must be >= 0 (numpy's generator takes no negative seed), got "
                             f"{self.arrival_seed}")
        if not 0 <= self.warmups <= MAX_WARMUPS:
            raise ValueError(f"warmups must be in [0, {MAX_WARMUPS}] (the study: 2), got {self.warmups}")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0 (arrivals/s; 0 = all at once), got {self.rate}")
        if not (math.isfinite(self.stall_timeout_s) and 0 < self.stall_timeout_s <= MAX_STALL_TIMEOUT_S):
            raise ValueError(f"stall_timeout_s must be a number of seconds in (0, {MAX_STALL_TIMEOUT_S:g}], got "
                             f"{self.stall_timeout_s}")
        if self.rate > 0 and 1.0 / self.rate > self.stall_timeout_s:  # nothing outstanding: no stall ends the wait
            raise ValueError(f"rate {self.rate:g} arrivals/s means one every {1.0 / self.rate:.3g} s on average, "
                             f"longer than the stall timeout {self.stall_timeout_s:g} s; use at least "
                             f"{1.0 / self.stall_timeout_s:.2g} (or 0: all at once)")


@dataclass(frozen=True)
class Case:
    """One system x policy in one pair; ``order`` is its position in the whole run; ``label``: the folder
    name of a case outside the pairs (the ``arrivals`` calibration)."""

    pair: int
    system: str
    policy: str
    order: int
    label: Optional[str] = None

    @property
    def name(self) -> str:
        return self.label or f"pair{self.pair}-{self.system}-{self.policy}"


@dataclass
class StudyContext:
    """What every case shares: the trace (``expected_hashes`` recorded when it was built), its
    warm-ups, engine and generation settings, routing knobs (with the model revision), the run
    folder (each case logs into ``run_dir/<case name>/``; ``log_to_console``: engines log to the
    console instead), and ``max_tokens`` (output tokens asked per request); the workloads' knobs
    (``sut.locality.workloads``), the ``arrivals`` load levels (``workloads.arrivals.Level``; empty: one
    timed burst), the ``eviction`` sizing record and ``vocab_size`` (the model's: every generated id must
    be below it; 0: not checked)."""

    trace: Sequence[TraceRequest]
    warmups: Sequence[Sequence[TraceRequest]]
    expected_hashes: Sequence[str]
    engine: EngineSettings
    generation: GenerationSettings
    affinity: AffinitySettings
    run_dir: Path
    max_tokens: int
    log_to_console: bool = False
    chunk: int = 512
    placement: dict = field(default_factory=dict)  # replica -> (key, case name) of its first record
    replica_count: Optional[tuple] = None  # (replicas, case name) of the first case
    vocab_size: int = 0
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    levels: Sequence = ()
    sizing: Optional[dict] = None
    kv: KvPinState = field(default_factory=KvPinState)  # the run's KV-cache pin, shared by the context's copies


def _rotate(seq: Sequence, k: int) -> list:
    k %= len(seq)
    return list(seq[k:]) + list(seq[:k])


def case_order(systems: Sequence[str], policies: Sequence[str], pairs: int) -> list[Case]:
    """Every case of the run in the order it runs (module docstring)."""
    out = []
    for p in range(pairs):
        for po in _rotate(policies, p):
            for s in _rotate(systems, p):
                out.append(Case(p, s, po, len(out)))
    return out


class _IdleSink:
    """The transport's sink between bursts: anything that arrives there is an error."""

    def __init__(self):
        self.errors: list[str] = []

    def on_first(self, replica, firsts) -> None:
        pass

    def on_results(self, replica, results) -> None:
        self.errors.append(f"replica {replica} answered request(s) {[c.rid for c in results][:5]} outside any burst "
                           "(answered twice?)")

    def on_fatal(self, event: FatalEvent) -> None:
        self.errors.append(event.message)

    def check(self) -> None:
        if self.errors:
            raise RunFailed(self.errors[0])


def placement(records: Sequence[ReplicaRecord], replicas: int, required: bool = True) -> list[dict]:
    """Each replica's device as its own record reports it: ``{"replica", "key", "kind", "slot", "uuid",
    "name", "pid", "node", "gpu_uuid"}``; ``key`` is ``kind:uuid`` (GPU) or ``kind:slot`` (CPU core group);
    ``node`` and ``gpu_uuid`` as run.json's ``flame.shards`` name them: the node the replica's engine runs on
    (Flame: its executor manager's host name; None where the record does not say) and its GPU UUID (None on CPU).

    Raises:
        RunFailed: the records are not one per replica in replica order, or (``required``) a record
            has no device.
    """
    if [r.index for r in records] != list(range(replicas)):
        raise RunFailed(f"the transport returned replica records {[r.index for r in records]}, expected 0..{replicas - 1}")
    out = []
    for r in records:
        dev = r.info.get("device") or {}
        if not dev and required:
            raise RunFailed(f"replica {r.index} reported no device record; its placement cannot be checked")
        ident = dev.get("uuid") or dev.get("slot")
        out.append({"replica": r.index, "key": f"{dev.get('kind')}:{ident}" if dev else None,
                    "kind": dev.get("kind"), "slot": dev.get("slot"), "uuid": dev.get("uuid"), "name": dev.get("name"),
                    "pid": r.info.get("pid"), "node": dev.get("node") or r.info.get("node"),
                    "gpu_uuid": dev.get("uuid") if dev.get("kind") == "cuda" else None})
    return out


def check_placement(ctx: StudyContext, case: Case, places: list[dict]) -> None:
    """Every case has the first case's replica count, and replica r sits where replica r of the first
    case did (``RunFailed`` naming both cases)."""
    count = ctx.replica_count = ctx.replica_count or (len(places), case.name)
    if count[0] != len(places):
        raise RunFailed(f"{case.name} has {len(places)} replica(s), {count[1]} had {count[0]} (every system must run "
                        "the same replicas)")
    for p in places:
        if p["key"] is None:
            continue
        first = ctx.placement.setdefault(p["replica"], (p["key"], case.name))
        if first[0] != p["key"]:
            raise RunFailed(f"placement differs: {case.name} has replica {p['replica']} on {p['key']}, "
                            f"{first[1]} had it on {first[0]} (shards must be pinned to the same device on every system)")


def _check_prefix_caching(records: Sequence[ReplicaRecord], system: System) -> None:
    for r in records:
        on = r.enable_prefix_caching
        if on is False:
            raise RunFailed(f"replica {r.index} reports prefix caching off; the locality experiment needs it on")
        if on is None and system.spec.fresh:
            raise RunFailed(f"replica {r.index}: prefix caching could not be read back")


#: Helper processes of Python's multiprocessing that live as long as this process (not a case's).
_PROCESS_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _children() -> dict:
    """This process's descendants that are not multiprocessing helpers: pid -> command line."""
    import psutil

    out = {}
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if not any(h in cmd for h in _PROCESS_HELPERS):
            out[p.pid] = cmd[:200]
    return out


def _stop(t: Transport, before: dict, wait_s: float = 10.0) -> dict:
    """Stop the transport; the cleanup record (seconds, error, processes this case started that are
    still alive ``wait_s`` after ``stop`` returned: none expected)."""
    t0 = time.monotonic()
    err = None
    try:
        t.stop()
    except Exception as e:  # noqa: BLE001 - recorded; the caller decides
        err = repr(e)
        log.error("stopping the transport failed: %s", err)
    stop_s = time.monotonic() - t0
    deadline = time.monotonic() + wait_s
    left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    if left:
        log.error("processes left after stopping the transport: %s", left)
    return {"stopped": err is None, "stop_s": round(stop_s, 3), "error": err,
            "processes_left": [{"pid": pid, "cmdline": cmd} for pid, cmd in sorted(left.items())]}


def make_policy_router(policy: str, replicas: int, ctx: StudyContext):
    """The router of ``policy``: a routing policy of ``sut.core.routing`` or a ``POLICY_VARIANTS`` name (the
    base policy with its router settings over the run's)."""
    base, over = POLICY_VARIANTS.get(policy, (policy, {}))
    return make_router(base, replicas, ctx.max_tokens, dataclasses.replace(ctx.affinity, **over))


def _burst(t: Transport, ctx: StudyContext, policy: str, trace, first_id: int, progress: bool, rate: float,
           seed: int, stall_s: float, expected=None, targets=None, kill=None):
    router = make_policy_router(policy, t.replicas, ctx)
    chunk = int(getattr(t.spec.options, "dispatch_chunk", None) or ctx.chunk)
    bs = BurstSettings(max_tokens=ctx.max_tokens, rate=rate, arrival_seed=seed, stall_timeout_s=stall_s,
                       chunk=chunk, first_id=first_id, progress=progress, targets=targets, kill=kill,
                       vocab_size=ctx.vocab_size)
    return run_burst(t, router, trace, bs, expected)


def _start(t: Transport, system: System, ctx: StudyContext, ps: PairSettings, case: Case, rec: dict,
           idle: "_IdleSink") -> None:
    """Start the case's transport (not timed) and check its replicas: prefix caching, placement, KV sizing."""
    t0 = time.monotonic()
    log.info("%s: starting %d replica(s)%s%s", case.name, t.replicas, " (fresh engines)" if system.spec.fresh else "",
             " and a Flame session" if system.name == "flame" else "")
    records = t.start(idle)
    rec["start_s"] = round(time.monotonic() - t0, 3)
    log.info("%s: replicas ready in %.1f s", case.name, rec["start_s"])
    rec["replicas"] = [r.info for r in records]
    _check_prefix_caching(records, system)
    rec["placement"] = placement(records, t.replicas, required=system.spec.fresh)
    check_placement(ctx, case, rec["placement"])
    if rec.get("kv_pinned"):
        unconfirmed = check_pinned(rec["replicas"], rec["kv_pinned"], case.name)
        if unconfirmed:
            rec["kv_pin_unconfirmed"] = unconfirmed
    else:
        ctx.kv.decide(rec["replicas"], case.name, system.spec.fresh, ps.kv_sizing)
    if ctx.sizing:
        from sut.locality.workloads.eviction import case_record

        rec["working_set"] = case_record(rec["replicas"], ctx.sizing)


def _measure(t: Transport, system: System, ctx: StudyContext, ps: PairSettings, case: Case, rec: dict) -> None:
    """Start, check, warm up and time one case into ``rec`` (the transport is stopped by the caller)."""
    idle = _IdleSink()
    _start(t, system, ctx, ps, case, rec, idle)
    warm_rate = 0.0 if ctx.levels else ps.rate  # arrivals: the warm-ups are bursts; the levels have their rates
    for k, warm in enumerate(ctx.warmups):
        idle.check()
        log.info("%s: warm-up %d of %d (%d requests, not timed)", case.name, k + 1, len(ctx.warmups), len(warm))
        res = _burst(t, ctx, case.policy, warm, (k + 1) * WARMUP_ID_STRIDE, False, warm_rate, ps.arrival_seed,
                     ps.stall_timeout_s)
        t.attach(idle)
        rec["warmups"].append({k2: res.metrics[k2] for k2 in ("requests", "wall_s", "requests_per_s", "cached_share")})
    idle.check()
    t.mark_timed()
    if ctx.levels:
        _timed_levels(t, ctx, ps, case, rec, idle)
    else:
        _timed(t, ctx, ps, case, rec, idle)
    rec["transport_stats"] = t.stats()


def _timed(t: Transport, ctx: StudyContext, ps: PairSettings, case: Case, rec: dict, idle: "_IdleSink") -> None:
    """The timed burst (with a kill: the ``replica-loss`` workload, whose transport has a lost replica after)."""
    from sut.locality.workloads.replica_loss import check_killable, kill_plan, kill_words

    kill = kill_plan(ctx.workload, rec["warmups"])
    if kill is not None:
        check_killable(t, kill.replica)
    log.info("%s: timed burst of %d requests%s", case.name, len(ctx.trace), kill_words(kill) if kill else "")
    res = _burst(t, ctx, case.policy, ctx.trace, 0, ps.progress, ps.rate, ps.arrival_seed, ps.stall_timeout_s,
                 ctx.expected_hashes, kill=kill)
    if kill is None:  # a transport that lost a replica takes no new sink: nothing more is sent to it
        t.attach(idle)
    rec["timed"], rec["routing"] = res.metrics, res.routing
    if kill is not None:
        rec["failover"] = rec["timed"].pop("failover")
    rec["validation"] = {"requests_checked": len(res.results), "failures": 0}
    rec["output_hashes"] = [res.output_hashes[i] for i in range(len(ctx.trace))]
    if kill is None:
        idle.check()


def _timed_levels(t: Transport, ctx: StudyContext, ps: PairSettings, case: Case, rec: dict, idle: "_IdleSink") -> None:
    """The ``arrivals`` levels in increasing order, each a validated timed burst (``workloads.arrivals``)."""
    rec["levels"] = []
    for lv in ctx.levels:
        log.info("%s: level %s, %d requests at %.3f/s (Poisson)", case.name, lv.label, len(lv.trace), lv.rate)
        res = _burst(t, ctx, case.policy, lv.trace, lv.first_id, ps.progress, lv.rate, ps.arrival_seed,
                     ps.stall_timeout_s, lv.hashes, targets=ctx.workload.targets)
        t.attach(idle)
        idle.check()
        rec["levels"].append({"level": lv.level, "rate": lv.rate, "timed": res.metrics, "routing": res.routing,
                              "validation": {"requests_checked": len(res.results), "failures": 0},
                              "output_hashes": [res.output_hashes[i] for i in range(len(lv.trace))]})
    top = rec["levels"][-1]
    rec["timed"], rec["routing"], rec["validation"] = top["timed"], top["routing"], top["validation"]


def run_case(system: System, ctx: StudyContext, ps: PairSettings, case: Case) -> dict:
    """One case (module docstring, steps 1-4): its record, with ``error`` (naming the case) when it
    failed. The transport is stopped in every case (also on Ctrl-C, which propagates)."""
    d = ctx.run_dir / case.name
    d.mkdir(parents=True, exist_ok=True)
    pin = ctx.kv.for_case(system.spec.fresh, ps.kv_sizing)
    spec = TransportSpec(engine=pinned_engine(ctx.engine, pin), generation=ctx.generation,
                         log_dir=None if ctx.log_to_console else str(d), run_dir=str(d),
                         stall_timeout_s=ps.stall_timeout_s)
    rec: dict = dataclasses.asdict(case)
    rec.update(transport=system.transport, fresh_engines=system.spec.fresh, warmups=[], kv_pinned=pin)
    before = _children()
    try:
        t = build_transport(system, spec)
    except (RunFailed, EngineError) as e:
        rec["error"] = f"{case.name}: {e}"
        return rec
    try:
        _measure(t, system, ctx, ps, case, rec)
    except (RunFailed, EngineError) as e:
        rec["error"] = f"{case.name}: {e}"
    finally:
        rec["cleanup"] = _stop(t, before)
    return rec


def run_pairs(systems: Sequence[System], ctx: StudyContext, ps: PairSettings,
              on_case: Optional[Callable[[dict], None]] = None) -> tuple[list[dict], Optional[str]]:
    """Every case in ``case_order``; returns ``(case records, error)``. The first failing case ends
    the run: its record (with ``error``) is the last one and ``error`` names it. ``on_case`` sees
    each finished record (progress logging)."""
    by_name = {s.name: s for s in systems}
    cases: list[dict] = []
    for case in case_order([s.name for s in systems], ps.policies, ps.pairs):
        log.info("case %d: pair %d, system %s, policy %s", case.order, case.pair, case.system, case.policy)
        rec = run_case(by_name[case.system], ctx, ps, case)
        cases.append(rec)
        if "error" in rec:
            return cases, rec["error"]
        if on_case is not None:
            on_case(rec)
    return cases, None


def run_records(cases: Sequence[dict]) -> list[dict]:
    """The per-run records ``sut.locality.study.pair_report`` reads, from finished case records: one per case,
    or one per case and load level (``arrivals``: ``workloads.arrivals.level_records``)."""
    from sut.locality.workloads.arrivals import level_records

    out = []
    for c in cases:
        if "timed" not in c or "error" in c:
            continue
        if c.get("levels"):
            out += level_records(c)
            continue
        out.append({"system": c["system"], "policy": c["policy"], "pair": c["pair"],
                    **{m: c["timed"].get(m) for m in ("requests_per_s", "output_tokens_per_s", "cached_share")}})
    return out
