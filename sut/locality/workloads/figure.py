"""The workload panels of ``locality.png``: one per workload a run's cases show, under the three pair panels.

Every panel draws the median over pairs of each system x policy (the cases that finished; a failed case has
no ``timed`` and is left out; a value no case records is left blank, marked n/a, never drawn as 0), from the
same fields the console's workload sections print:

* ``arrivals``: goodput (requests/s meeting the TTFT and TPOT targets) per load level, one line per system x
  policy, next to the offered Poisson rate (``levels[].rate``, ``levels[].timed.goodput_per_s``).
* ``variable-answers``: request latency from arrival to answer, client side, p50 and p99 (``timed.latency_s``):
  where a transport returns a batch's answers together, the short answers wait for the long ones.
* ``hot-prefixes``: uncached prompt tokens per replica (``timed.per_replica[].uncached_tokens``): the prefill each
  replica really did, so an overloaded owner of hot documents shows as one tall bar.
* ``eviction``: the engines' cached share next to the share the router expected (``timed.cached_share``,
  ``timed.router_cached_share``), with the working set's ratio to one replica's KV cache in the title.
* ``replica-loss``: each request's outcome (``failover.answered`` by its first replica, ``rerouted``,
  ``failed``) of the median pair by answered, stacked to the trace's requests, the median recovery time
  (``failover.recovery_s``) above.

:func:`workload_panels` names the panels a record has; :func:`draw` fills matplotlib axes (no pyplot, no global
state); :func:`row_panels` and :func:`draw_row` do the same for ``locality.png``'s second row, where a record the
panels cannot read leaves a note in the row and in the record's ``notes`` and a logged warning: the figure never
fails a run that measured fine.
Records from ``locality.json`` or from a run in memory (settings as dataclasses) both work.
"""

from __future__ import annotations

import logging
import math
from statistics import median
from typing import Callable, Mapping, Sequence

from sut.locality.workloads.report import plain, shown_workloads

log = logging.getLogger(__name__)

#: (system, policy) -> the finished cases of that system and policy in complete pairs, in record order.
Groups = dict


def groups(record: Mapping) -> Groups:
    """The record's finished cases of complete pairs grouped by ``(system, policy)``, keys sorted as the pair
    panels sort them. A pair whose policy lacks a finished case of some system of the record (``systems``, else
    those the cases name) is left out whole, as the merged report's medians leave it out (``dropped``)."""
    from sut.locality.merge import complete_pairs  # here: merge imports the runner, which draws this figure

    done = [c for c in record.get("cases") or [] if c.get("timed")]
    kept, _ = complete_pairs(done, list(record.get("systems") or ()) or {c["system"] for c in done})
    out: Groups = {}
    for c in sorted(kept, key=lambda c: (c["system"], c["policy"])):  # stable: record order within a group
        out.setdefault((c["system"], c["policy"]), []).append(c)
    return out


def _med(values) -> float:
    """The median of the known values; NaN (no bar, no point) when none is known, never a made-up 0."""
    vals = [v for v in values if v is not None]
    return float(median(vals)) if vals else math.nan


def _labels(ax, keys: Sequence[tuple]) -> None:
    ax.set_xticks(range(len(keys)), [f"{s}\n{po}" for s, po in keys], fontsize=8)


def _bars(ax, keys, series: Sequence[tuple[str, list]], **kw) -> None:
    """Side-by-side bars per group: ``series`` is ``(label, one value per group)``."""
    width = 0.8 / max(1, len(series))
    for i, (label, vals) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, vals, width, label=label, color=f"C{i + 2}", **kw)
        for x, v in zip(xs, vals):
            if math.isnan(v):  # a field the record lacks: said, not drawn as 0
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
    _labels(ax, keys)
    if series:
        ax.legend(fontsize=8)


def _arrivals(ax, record: Mapping, g: Groups) -> None:
    rates: dict = {}
    systems, policies = sorted({s for s, _ in g}), sorted({po for _, po in g})  # the pair panels' colours: a
    for (s, po), cases in g.items():  # colour per system (sorted, as there), a line style and marker per policy
        by_level: dict = {}
        for c in cases:
            for lv in c.get("levels") or []:
                by_level.setdefault(lv["level"], []).append(lv)
        xs = sorted(by_level)
        ax.plot([100 * x for x in xs], [_med(lv["timed"].get("goodput_per_s") for lv in by_level[x]) for x in xs],
                marker="os^D"[policies.index(po) % 4], linestyle=("-", "--", "-.", (0, (1, 1)))[policies.index(po) % 4],
                color=f"C{systems.index(s)}", label=f"{s}, {po}")
        for x in xs:
            rates.setdefault(x, []).extend(lv["rate"] for lv in by_level[x])
    xs = sorted(rates)
    ax.plot([100 * x for x in xs], [_med(rates[x]) for x in xs], color="grey", linestyle=":", label="offered rate")
    tg = plain(plain(record.get("workload")).get("settings"))
    ax.set(xlabel="load level, % of the burst capacity", ylabel="goodput, requests/s",
           title=f"arrivals: goodput (TTFT <= {tg.get('ttft_target_s')} s, TPOT <= {tg.get('tpot_target_s')} s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _answers(ax, record: Mapping, g: Groups) -> None:
    keys = list(g)
    lat = [[(c["timed"].get("latency_s") or {}) for c in g[k]] for k in keys]
    _bars(ax, keys, [(f"{p}, client side", [_med(x.get(p) for x in cases) for cases in lat]) for p in ("p50", "p99")])
    ax.set(ylabel="request latency, s", title="variable answers: arrival to answer (median of pairs)")


def _uncached(p: Mapping):
    """A replica's uncached prompt tokens; from prompt - cached in a record written before the field."""
    if "uncached_tokens" in p:
        return p["uncached_tokens"]
    known = p.get("prompt_tokens") is not None and p.get("cached_tokens") is not None
    return p["prompt_tokens"] - p["cached_tokens"] if known else None


def _hot(ax, record: Mapping, g: Groups) -> None:
    keys = list(g)
    # per case: replica -> uncached tokens; a replica that answered nothing has no entry (it did no prefill)
    per = {k: [{p.get("replica", i): _uncached(p) for i, p in enumerate(c["timed"].get("per_replica") or [])}
               for c in g[k]] for k in keys}
    reps = sorted({r for cases in per.values() for c in cases for r in c})
    vals = {r: [_med(c.get(r, 0) if c else None for c in per[k]) for k in keys] for r in reps}
    _bars(ax, keys, [(f"replica {r}", [v / 1000 for v in vals[r]]) for r in reps])
    s = plain(record.get("trace_settings")).get("zipf_s")
    ax.set(ylabel="uncached prompt tokens, thousands",
           title=f"hot prefixes (Zipf s = {s}): prefill done per replica (median of pairs)")


def _eviction(ax, record: Mapping, g: Groups) -> None:
    keys = list(g)
    _bars(ax, keys, [(label, [100 * _med(c["timed"].get(f) for c in g[k]) for k in keys])
                     for label, f in (("engines (cached)", "cached_share"),
                                      ("router (expected)", "router_cached_share"))])
    ws = plain(record.get("workload")).get("working_set") or {}
    ax.set(ylabel="share of prompt tokens, %",
           title=f"eviction: working set {ws.get('ratio')}x one replica's KV cache ({ws.get('replica_kv_tokens'):,} "
                 "tokens)" if ws.get("replica_kv_tokens") else "eviction: cached share")


def _median_outcome(fo: Sequence[Mapping]) -> Mapping:
    """The failover record of the median pair by requests answered: one pair's outcomes, which add up to the
    trace's requests (the medians of each outcome apart need not)."""
    return sorted(fo, key=lambda f: (f["answered"], -f["failed"]))[(len(fo) - 1) // 2]


def _loss(ax, record: Mapping, g: Groups) -> None:
    fos = {k: [c["failover"] for c in g[k] if c.get("failover")] for k in g}
    keys = [k for k in g if fos[k]]
    mid = [_median_outcome(fos[k]) for k in keys]
    bottom = [0.0] * len(keys)
    for i, part in enumerate(("answered", "rerouted", "failed")):
        vals = [m[part] for m in mid]
        ax.bar(range(len(keys)), vals, 0.6, bottom=bottom, label=part, color=("C2", "C1", "C3")[i])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for j, k in enumerate(keys):
        rec = [f.get("recovery_s") for f in fos[k]]
        note = (f"recovery {_med(rec):.1f} s" if any(r is not None for r in rec) else
                "no loss measured" if not any(f["rerouted"] or f["failed"] for f in fos[k]) else None)
        if note:
            ax.annotate(note, (j, bottom[j]), ha="center", va="bottom", fontsize=8)
    _labels(ax, keys)
    ax.set_ylim(0, max(bottom, default=1) * 1.15 or 1)
    ax.set(ylabel="requests", title="replica loss: each request's outcome (the median pair by answered)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never over a bar


def workload_panels(record: Mapping) -> list[tuple[str, Callable]]:
    """``(workload name, draw function)`` for each workload the record's cases show (``report.shown_workloads``:
    the console's sections, in their order); none without a finished case."""
    fns = {"arrivals": _arrivals, "variable-answers": _answers, "hot-prefixes": _hot, "eviction": _eviction,
           "replica-loss": _loss}
    return [(name, fns[name]) for name in shown_workloads(record)] if groups(record) else []


def draw(axes: Sequence, record: Mapping) -> list[str]:
    """Draw :func:`workload_panels` into ``axes`` (one each, in order); returns the workloads drawn."""
    g = groups(record)
    panels = workload_panels(record)
    for ax, (_, fn) in zip(axes, panels):
        fn(ax, record, g)
    return [name for name, _ in panels]


def _not_drawn(e: Exception, record: Mapping) -> str:
    """The row's note for error ``e``: logged as a warning and, once, added to ``record["notes"]`` when the record
    is a dict (the run's own, written to ``locality.json`` after the figure)."""
    log.warning("locality.png: the workload panels were not drawn (%s: %s)", type(e).__name__, e)
    note = f"workload panels not drawn: {type(e).__name__}: {e}"
    if isinstance(record, dict):
        notes = record.setdefault("notes", [])
        if f"locality.png: {note}" not in notes:
            notes.append(f"locality.png: {note}")
    return note


def row_panels(record: Mapping | None) -> list[str]:
    """The workloads of ``record``'s second row ([] without a record); a record they cannot read still gets the
    row, which then says so."""
    if not record:
        return []
    try:
        return [name for name, _ in workload_panels(record)]
    except Exception as e:  # a figure never fails a run
        return [_not_drawn(e, record)]


def draw_row(sub, record: Mapping, n: int) -> list[str]:
    """Draw :func:`workload_panels` into ``n`` axes of matplotlib subfigure ``sub``; on an error the row holds
    the error's text instead (and a warning is logged). Returns the workloads drawn."""
    try:
        return draw(sub.subplots(1, n, squeeze=False)[0], record)
    except Exception as e:  # a figure never fails a run
        note = _not_drawn(e, record)
    sub.clear()
    sub.text(0.5, 0.5, note, ha="center", va="center", fontsize=10, color="C3", wrap=True)
    return []
