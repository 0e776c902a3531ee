"""What ``describe`` and the run report add for the workloads beyond the study (plain text and dicts).

``workload_shape``: the workload part of ``describe`` (also its ``--json``): answer lengths, popularity,
load levels and goodput targets, the working-set sizing, the kill plan. ``workload_rows``: the same as
labelled rows for the describe table. ``workload_lines``: the report sections of a run's record, one per
workload its cases show (levels, variable answers, Zipf popularity, working set, failover).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sut.locality.workloads import WorkloadSettings, answers, arrivals, eviction, hot_prefixes, replica_loss


def workload_shape(ts, ws: WorkloadSettings, shape: dict) -> dict:
    """The workload facts of a trace and its knobs (module docstring); empty for the study's traces."""
    out: dict = {}
    if ts.answers != "fixed":
        out["answers"] = {"distribution": f"{ts.answers} in [{ts.min_answer_tokens}, {ts.max_tokens}]",
                          **(shape.get("answer_tokens") or {})}
    if ts.zipf_s > 0:
        out["popularity"] = {"zipf_s": ts.zipf_s, **(shape.get("popularity") or {})}
    if ws.load_levels:
        out["arrivals"] = {"load_levels": list(ws.load_levels),
                           "capacity": ws.capacity or "measured by a calibration case "
                                                      f"(policy {ws.capacity_policy})",
                           "goodput_targets": {"ttft_s": ws.ttft_target_s, "tpot_s": ws.tpot_target_s}}
    if ws.working_set:
        out["eviction"] = {"working_set": ws.working_set, "kv_blocks": ws.kv_blocks or None,
                           **({"replica_kv_tokens": ws.kv_tokens, "documents": shape["documents"],
                               "ratio": round(shape["document_tokens"] / ws.kv_tokens, 4)} if ws.kv_tokens else
                              {"documents": f"sized at run time: ceil({ws.working_set:g} x one replica's KV tokens / "
                                            f"{ts.doc_tokens + 1}); the rows above are the unsized trace "
                                            "(--kv-tokens N shows the trace a run would make)"})}
    if ws.kill_after:
        out["replica_loss"] = {"kill_replica": ws.kill_replica, "kill_after": ws.kill_after,
                               "kill_when": ws.kill_when, "retries": ws.retries,
                               "loss_timeout_s": ws.loss_timeout_s}
    return out


def workload_rows(ts, ws: WorkloadSettings, shape: dict) -> list[tuple[str, str, str]]:
    """``(label, value, note)`` rows of the describe table."""
    w = workload_shape(ts, ws, shape)
    rows = []
    if "answers" in w:
        a = w["answers"]
        rows.append(("answer tokens", f"{a.get('total', 0):,}", f"{a['distribution']}: min {a.get('min')}, median "
                     f"{a.get('p50')}, mean {a.get('mean')}, p99 {a.get('p99')}, max {a.get('max')}"))
    if "popularity" in w:
        p = w["popularity"]
        hot = ", ".join(f"{x['share']:.1%}" for x in p.get("hottest", []))
        rows.append(("Zipf popularity", f"s = {p['zipf_s']}", f"the hottest documents' shares of requests: {hot}"))
    if "arrivals" in w:
        a = w["arrivals"]
        rows.append(("load levels", " ".join(f"{x:.0%}" for x in a["load_levels"]),
                     f"Poisson arrivals, of the burst capacity: {a['capacity']}"))
        rows.append(("goodput targets", f"{ws.ttft_target_s:g} s / {ws.tpot_target_s:g} s",
                     "TTFT from arrival / TPOT after the first token"))
    if "eviction" in w:
        e = w["eviction"]
        sized = (f"{e['documents']} documents = {e['ratio']}x {e['replica_kv_tokens']:,} KV tokens"
                 if ws.kv_tokens else f"documents {e['documents']}")
        rows.append(("working set", f"{ws.working_set:g}x", f"one replica's KV cache; {sized}"
                     + (f"; every engine capped at {ws.kv_blocks:,} KV blocks" if ws.kv_blocks else "")))
    if "replica_loss" in w:
        r = w["replica_loss"]
        when = (f"killed {r['kill_after']:.0%} of the last warm-up's wall time into the burst"
                if r.get("kill_when", "answers") == "time" else
                f"killed once it answered {r['kill_after']:.0%} of the requests routed to it")
        rows.append(("replica loss", f"replica {r['kill_replica']}", f"{when}; {r['retries']} re-route(s) each; "
                     f"{r['loss_timeout_s']:g} s without an answer fail the rest"))
    return rows


def plain(v):
    """A settings dataclass as the dict ``locality.json`` holds (records in memory keep the objects); ``{}`` for
    None. Also ``figure.py``'s."""
    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) else (v or {})


def shown_workloads(record) -> list[str]:
    """The workloads a record's cases show, in the report's order (its sections, the figure's panels): levels
    (``arrivals``), per-request lengths (``variable-answers``), Zipf popularity (``hot-prefixes``), a sized working
    set (``eviction``), a failover record (``replica-loss``)."""
    cases = record.get("cases") or []
    ts = plain(record.get("trace_settings"))
    return [name for name, on in (
        ("arrivals", any(c.get("levels") for c in cases)),
        ("variable-answers", ts.get("answers", "fixed") != "fixed"),
        ("hot-prefixes", (ts.get("zipf_s") or 0) > 0),
        ("eviction", bool(plain(record.get("workload")).get("working_set"))),
        ("replica-loss", any(c.get("failover") for c in cases))) if on]


def workload_lines(record: dict) -> list[str]:
    """The report sections of the workloads the record's cases show (module docstring)."""
    w = dict(plain(record.get("workload")))
    if w:
        w["settings"] = plain(w.get("settings"))
    record = dict(record, workload=w, trace_settings=plain(record.get("trace_settings")))
    modules = {"arrivals": arrivals, "variable-answers": answers, "hot-prefixes": hot_prefixes,
               "eviction": eviction, "replica-loss": replica_loss}
    out: list[str] = []
    for name in shown_workloads(record):
        out += ["", *modules[name].report_lines(record)]
    return out


def calibration_line(record: dict) -> Optional[str]:
    cal = (record.get("workload") or {}).get("calibration")
    return None if not cal else (f"calibration: {cal['system']}, {cal['policy']}: {cal['requests_per_s']} requests/s "
                                 f"(one burst of the trace, fresh engines; its case record: workload.calibration.case)")
