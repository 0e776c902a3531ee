"""Per-request latencies, goodput and per-replica load of one validated burst (pure arithmetic, no engines).

Inputs per answered request: ``sent`` (``time.monotonic()`` when the harness handed it to the dispatcher:
its arrival), the ``Completion``'s engine timestamps ``t_queued`` / ``t_first`` / ``t_done`` (monotonic
seconds on the host that ran the engine; ``sut.messages``) and ``arrived`` (monotonic, when its completion
reached the harness). Definitions (seconds):

* ``client_ttft_s``: ``t_first - sent``, the first token from the request's arrival, queueing in the
  router, batching (Flame's batch-formation window) and the engine's queue included. It compares clocks of
  the harness and the engine host, valid on one host (``time.monotonic`` is system-wide on Linux): where any
  ``t_first`` precedes its ``sent`` the clocks are not comparable and it is None (then goodput uses the
  engine-side TTFT, and says so);
* ``ttft_s`` (engine-side, the record's older field): ``t_first - t_queued``;
* ``tpot_s``: ``(t_done - t_first) / (output tokens - 1)``, time per output token after the first
  (requests of one token have none);
* ``latency_s``: ``arrived - sent``, client-side end to end;
* goodput (``targets`` given): a request is *good* when its TTFT (client-side where valid) is at most
  ``ttft_s`` and its TPOT at most ``tpot_s``; ``goodput_per_s`` = good requests / the burst's wall time,
  ``goodput_share`` = good / requests (vLLM ``bench serve --goodput``'s definition with TTFT and TPOT).

Percentiles are numpy's linear ones (p50, p90, p99). Per replica: requests, prompt, cached, uncached and
output tokens, and ``done_s`` (its last completion after the burst's start); ``balance``: max / min over
the replicas that served requests of requests, uncached prompt tokens and ``done_s`` (None with one
replica, or a minimum of 0).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np


def pct(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile, rounded to 0.1 ms; None for no values."""
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def spread(values: Sequence[float]) -> Optional[dict]:
    """``{"p50", "p90", "p99"}`` of ``values``; None for no values."""
    return {"p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99)} if len(values) else None


def request_times(seen: Mapping[int, tuple], sent: Mapping[int, float]) -> dict:
    """Per request id: ``{"client_ttft", "ttft", "tpot", "latency"}`` (seconds, None where unknown).

    Args:
        seen: rid -> ``(replica, Completion, arrived)`` (answered requests only).
        sent: rid -> monotonic time the request was handed to the dispatcher.
    """
    out = {}
    for rid, (_, c, arrived) in seen.items():
        first, done, queued, t0 = c.t_first, c.t_done, c.t_queued, sent.get(rid)
        n = len(c.token_ids)
        out[rid] = {"client_ttft": None if first is None or t0 is None else first - t0,
                    "ttft": None if first is None or queued is None else first - queued,
                    "tpot": (done - first) / (n - 1) if first is not None and done is not None and n > 1 else None,
                    "latency": None if t0 is None else arrived - t0}
    return out


def latency_metrics(times: Mapping[int, dict], wall_s: float, requests: int,
                    targets: Optional[tuple[float, float]] = None) -> dict:
    """``client_ttft_s``, ``tpot_s``, ``latency_s`` spreads and, with ``targets = (ttft_s, tpot_s)``, the goodput
    fields (module docstring) from ``request_times``' output; ``requests`` counts every request of the
    burst (a failed one is never good)."""
    col = {k: [t[k] for t in times.values()] for k in ("client_ttft", "ttft", "tpot", "latency")}
    client_ok = bool(col["client_ttft"]) and all(x is not None and x >= 0 for x in col["client_ttft"])
    out = {"client_ttft_s": spread(col["client_ttft"]) if client_ok else None,
           "tpot_s": spread([x for x in col["tpot"] if x is not None]),
           "latency_s": spread([x for x in col["latency"] if x is not None])}
    if targets is None:
        return out
    ttft_max, tpot_max = targets
    key = "client_ttft" if client_ok else "ttft"
    good = sum(1 for t in times.values() if t[key] is not None and t[key] <= ttft_max
               and (t["tpot"] is None or t["tpot"] <= tpot_max))
    out.update(goodput_targets={"ttft_s": ttft_max, "tpot_s": tpot_max,
                                "ttft_from": "client (arrival to first token)" if client_ok else
                                "engine (queued to first token: the clocks were not comparable)"},
               good_requests=good, goodput_per_s=round(good / wall_s, 4) if wall_s > 0 else 0.0,
               goodput_share=round(good / max(1, requests), 4))
    return out


def replica_load(trace, seen: Mapping[int, tuple], t0: float) -> list[dict]:
    """One record per replica that answered: requests, prompt / cached / uncached / output tokens, ``done_s``
    (cached counts None where the transport cannot tell)."""
    per: dict[int, dict] = {}
    for rid, (rep, c, arrived) in sorted(seen.items()):
        p = per.setdefault(rep, {"replica": rep, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                 "uncached_tokens": 0, "output_tokens": 0, "done_s": 0.0})
        n = len(trace[rid].prompt)
        p["requests"] += 1
        p["prompt_tokens"] += n
        p["output_tokens"] += len(c.token_ids)
        p["done_s"] = round(max(p["done_s"], arrived - t0), 4)
        if c.cached_tokens is None or p["cached_tokens"] is None:
            p["cached_tokens"] = p["uncached_tokens"] = None
        else:
            p["cached_tokens"] += int(c.cached_tokens)
            p["uncached_tokens"] += n - int(c.cached_tokens)
    return [per[r] for r in sorted(per)]


def balance(per_replica: Sequence[dict]) -> Optional[dict]:
    """max / min across replicas of ``requests``, ``uncached_tokens`` and ``done_s`` (module docstring)."""
    if len(per_replica) < 2:
        return None

    def ratio(key: str) -> Optional[float]:
        vals = [p.get(key) for p in per_replica]
        if any(v is None for v in vals) or min(vals) <= 0:
            return None
        return round(max(vals) / min(vals), 4)

    return {"requests_max_over_min": ratio("requests"), "uncached_max_over_min": ratio("uncached_tokens"),
            "done_max_over_min": ratio("done_s")}
