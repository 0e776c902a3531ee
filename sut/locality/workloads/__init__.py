"""The workloads after the study: five trace presets a serving engineer asks about next, run through the
study's pair protocol (``sut.locality.pairs``: fresh engines per case, shifted warm-ups, every request
validated, pairs in alternating order, medians and per-pair ratios, the figure), Flame vs standalone.

One module per preset, each with its algorithm and knobs in its header:

* ``arrivals`` (``arrivals.py``): Poisson arrivals at fractions of the burst capacity measured on the same
  card; per-request TTFT / TPOT p50 / p99 and goodput against stated targets;
* ``variable-answers`` (``answers.py``): answer lengths drawn log-uniform between 16 and 512 tokens;
* ``hot-prefixes`` (``hot_prefixes.py``): Zipf popularity of documents; per-replica load, and the affinity
  router with and without its release;
* ``eviction`` (``eviction.py``): a working set a multiple of one replica's KV cache, sized from the KV
  blocks the engines report;
* ``replica-loss`` (``replica_loss.py``): one replica killed mid-trace; what happened to every request.

The knobs of all five are ``WorkloadSettings`` fields (flags of ``python -m sut.locality run`` and
``describe``); each preset sets the ones it needs, and any of them may be given with any trace, but a knob
that acts only while its workload is on (``--capacity`` without ``--load-levels``, ...) is refused without it
(``cli_args._inert``). A knob at its default changes nothing, so the study's presets run as before. Presets
(``WORKLOAD_PRESETS``) have the parts of the study's (``trace``, ``run``, ``routing``) plus ``workload``;
explicit flags override them.

Policy variants (``POLICY_VARIANTS``): a name of the locality entry point for a routing policy of
``sut.core.routing`` with other router settings: ``prefix_affinity_never`` = ``prefix_affinity`` with the
release gate ``never`` (the study's router, next to ``prefix_affinity`` with the run's release gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sut.locality import knob

#: Locality policy names -> (routing policy of ``sut.core.routing``, router settings it overrides).
POLICY_VARIANTS = {"prefix_affinity_never": ("prefix_affinity", {"release_gate": "never"})}
#: Goodput targets (seconds): Dynamo's gate in AIPerf's goodput, TTFT <= 5,000 ms and ITL <= 100 ms
#: (../shared/research/routing_anchors_2026-12.md, section 2).
TTFT_TARGET_S, TPOT_TARGET_S = 5.0, 0.1


@dataclass(frozen=True)
class WorkloadSettings:
    """The knobs of the five workloads (see each preset's module); the defaults switch every one off.

    Attributes:
        load_levels: arrivals: Poisson rates as fractions of the burst capacity, each in (0, 2], distinct
            (kept in increasing order: the order they run in every case, whatever order they were given in).
        capacity: arrivals: the burst capacity, requests/s; 0 = measured first by one calibration case. Every
            level x capacity must be at least 0.0001 requests/s (the rates' resolution; ``arrivals.level_rate``).
        capacity_policy: arrivals: the routing policy of the calibration case.
        ttft_target_s / tpot_target_s: goodput targets, seconds (> 0).
        working_set: eviction: distinct document tokens as a multiple of one replica's KV-cache tokens
            (0 = off; the documents count is sized from it).
        kv_tokens: eviction: one replica's KV-cache tokens to size against (0 = start the first system's
            replicas once and read what they report).
        kv_blocks: every engine's KV-cache blocks (vLLM ``num_gpu_blocks_override``; 0 = what memory allows).
        kill_after: replica-loss: when to kill the replica, a fraction in (0, 1) (0 = off): of the case's
            last warm-up wall time into the timed burst (``kill_when`` ``time``), or of the timed requests
            routed to it that it has answered (``answers``).
        kill_when: replica-loss: what fires the kill: ``time`` (``kill_after`` x the case's last warm-up wall
            time after the timed burst starts, or, if that comes first, once every request is routed and the
            replica has answered (1 + ``kill_after``) / 2 of those routed to it while it still holds some) or
            ``answers`` (the replica has answered ``kill_after`` of its requests).
        kill_replica: replica-loss: which replica.
        retries: replica-loss: re-routes a lost replica's request gets (0 = it fails at once).
        loss_timeout_s: replica-loss: after the kill, this long without an answer fails what is left.
    """

    load_levels: tuple = knob((), "arrivals: Poisson arrival rates as fractions of the burst capacity, e.g. 0.5 "
                                  "0.8 0.95 (each level a timed burst of the trace, in increasing order)",
                              nargs="+", type=float)
    capacity: float = knob(0.0, "arrivals: the burst capacity in requests/s that --load-levels multiply; 0 = "
                                "measured by one calibration case before the pairs (fresh engines, warm-ups, "
                                "the trace as one burst; give the value of an earlier run to resume it)")
    capacity_policy: str = knob("round_robin", "arrivals: routing policy of the calibration case")
    ttft_target_s: float = knob(TTFT_TARGET_S, "goodput: a request is good when its time to first token "
                                               "(from its arrival) is at most this, seconds")
    tpot_target_s: float = knob(TPOT_TARGET_S, "goodput: ... and its time per output token after the first "
                                               "at most this, seconds")
    working_set: float = knob(0.0, "eviction: the trace's distinct document tokens as a multiple of one replica's "
                                   "KV-cache tokens (e.g. 3); the documents count is sized from it; 0 = off")
    kv_tokens: int = knob(0, "eviction: one replica's KV-cache tokens to size against; 0 = start the first "
                             "system's replicas once and read the KV blocks they report")
    kv_blocks: int = knob(0, "every engine's KV-cache blocks instead of what memory allows (vLLM "
                             "num_gpu_blocks_override): a small cache on a CPU (eviction on CPU needs it), or the "
                             "same capacity on any GPU; 0 = what memory allows")
    kill_after: float = knob(0.0, "replica-loss: when to kill --kill-replica, a fraction in (0, 1): of the last "
                                  "warm-up's wall time into the timed burst (--kill-when time), or of the timed "
                                  "requests routed to it that it has answered (--kill-when answers); 0 = off")
    kill_when: str = knob("time", "replica-loss: what fires the kill: time (--kill-after x the case's last warm-up "
                                  "wall time after the timed burst starts: mid-work on every system, however it "
                                  "delivers answers; or earlier, once every request is routed and the replica has "
                                  "answered (1 + --kill-after) / 2 of those routed to it while it still holds some) or "
                                  "answers (once the replica has answered --kill-after of the requests routed to it)",
                          choices=("time", "answers"))
    kill_replica: int = knob(0, "replica-loss: the replica to kill")
    retries: int = knob(1, "replica-loss: re-routes of a lost replica's request (0 = it fails at once)")
    loss_timeout_s: float = knob(60.0, "replica-loss: after the kill, this many seconds without an answer fail the "
                                       "requests still outstanding")

    def __post_init__(self):
        levels = tuple(sorted(float(x) for x in self.load_levels))  # the order they run in, also in the record
        object.__setattr__(self, "load_levels", levels)
        if any(not (math.isfinite(x) and 0 < x <= 2) for x in levels) or len(set(levels)) != len(levels):
            raise ValueError(f"load_levels must be distinct fractions in (0, 2], got {list(levels)}")
        for name in ("capacity", "working_set", "ttft_target_s", "tpot_target_s", "loss_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0) or (name.endswith("_s") and v <= 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if name.endswith('_s') else '>= 0'}, got {v}")
        if self.capacity and self.load_levels:  # a given capacity: every level's rate is known before the run
            from sut.locality.workloads.arrivals import level_rate

            level_rate(min(self.load_levels), self.capacity)
        if self.working_set and self.working_set < 1:
            raise ValueError(f"working_set must be 0 (off) or >= 1 (a multiple of one replica's KV cache), "
                             f"got {self.working_set}")
        for name in ("kv_tokens", "kv_blocks", "kill_replica", "retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.kill_after) and (self.kill_after == 0 or 0 < self.kill_after < 1)):
            raise ValueError(f"kill_after must be 0 (off) or in (0, 1), got {self.kill_after}")
        if self.kill_when not in ("time", "answers"):
            raise ValueError(f"kill_when must be time or answers, got {self.kill_when!r}")

    @property
    def active(self) -> list[str]:
        """The workloads these settings switch on (``arrivals``, ``eviction``, ``replica-loss``)."""
        return [name for name, on in (("arrivals", bool(self.load_levels)), ("eviction", self.working_set > 0),
                                      ("replica-loss", self.kill_after > 0)) if on]

    @property
    def targets(self) -> tuple[float, float]:
        return self.ttft_target_s, self.tpot_target_s


def _presets() -> dict:
    from sut.locality.workloads import answers, arrivals, eviction, hot_prefixes, replica_loss

    return {m.NAME: m.PRESET for m in (arrivals, answers, hot_prefixes, eviction, replica_loss)}


#: The five presets by name: ``{"trace", "run", "routing", "workload"}`` parts (module docstring).
WORKLOAD_PRESETS = _presets()
