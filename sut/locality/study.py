"""The study's checks and arithmetic (``../shared/research/study.md``), as pure functions: no engines.

* :func:`validate_results`: every timed request of a trace was answered exactly once, with the input
  the trace holds (sha256 of the int32 ids), the asked number of output tokens, by the replica it was
  routed to. Returns one line per failure, naming the request; :func:`raise_for_failures` turns them
  into ``RunFailed`` (exit 1).
* :func:`pair_report`: per-run records of the paired protocol (one record per system x policy x
  pair) -> medians / min / max per system and policy, per-pair ratios ``flame / standalone`` per
  policy with their median, min and max and the pairs below the 99 % line, and
  ``prefix_affinity / round_robin`` per system (ratio of the medians, and per pair).
  :func:`report_lines` prints it; :func:`plot_pair_report` draws it (PNG).

The pair protocol that produces the records and calls these is ``sut.locality.pairs``.

A per-run record is a mapping with ``system`` (``standalone`` | ``flame`` | ...), ``policy``, ``pair``
(int), ``requests_per_s``, ``output_tokens_per_s`` and ``cached_share`` (cached prompt tokens /
prompt tokens, from the engines' counts, in ``[0, 1]``; None where the transport cannot tell: then
its stats are None and the figure leaves its bar out).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from sut.errors import RunFailed
from sut.locality.trace import TraceRequest, input_hash

METRICS = ("requests_per_s", "output_tokens_per_s", "cached_share")
FLOOR = 0.99  # the study's line: Flame reaches at least 99 % of standalone


@dataclass(frozen=True)
class RequestResult:
    """One answered request as a transport reports it.

    Attributes:
        rid: the request id (``TraceRequest.rid``).
        served: the replica whose engine produced the output (from the worker's own record).
        routed: the replica the router chose.
        output_ids: the generated token ids.
        input_hash: hex sha256 of the prompt ids as sent (``trace.input_hash``).
    """

    rid: int
    served: int
    routed: int
    output_ids: Sequence[int]
    input_hash: str


def validate_results(trace: Sequence[TraceRequest], results: Sequence[RequestResult], max_tokens: int,
                     expected_hashes: Optional[Sequence[str]] = None,
                     failed: Optional[Mapping[int, str]] = None) -> list[str]:
    """Check the results of one timed burst against its trace.

    Args:
        max_tokens: output tokens asked per request (a request's own ``TraceRequest.max_tokens`` wins).
        expected_hashes: the trace's input hashes in trace order, as recorded when it was built
            (default: ``input_hash`` of each prompt now).
        failed: requests the run gave up on, with the reason it recorded (a lost replica: the
            ``replica-loss`` workload); each must have been answered exactly once, empty.

    Returns:
        one line per failure, each starting ``request RID:`` (empty list: all good): unknown id, input
        hash mismatch, output length != the asked length, served replica != routed replica, answered more
        than once, never answered, a failed request without a reason or with output.
    """
    if expected_hashes is not None and len(expected_hashes) != len(trace):
        raise ValueError(f"{len(expected_hashes)} expected input hashes for a trace of {len(trace)} requests")
    want = {r.rid: (expected_hashes[i] if expected_hashes is not None else input_hash(r.prompt))
            for i, r in enumerate(trace)}
    asked = {r.rid: r.max_tokens or max_tokens for r in trace}
    failed = failed or {}
    seen: Counter = Counter()
    failures = []
    for res in results:
        seen[res.rid] += 1
        if res.rid not in want:
            failures.append(f"request {res.rid}: not in the trace")
            continue
        if seen[res.rid] > 1:
            continue  # counted below
        if res.rid in failed:
            if not failed[res.rid] or len(res.output_ids):
                failures.append(f"request {res.rid}: recorded as failed, but with {len(res.output_ids)} output tokens "
                                f"and reason {failed[res.rid]!r}")
            continue
        if res.input_hash != want[res.rid]:
            failures.append(f"request {res.rid}: input hash {res.input_hash[:12]} != the trace's {want[res.rid][:12]}")
        if len(res.output_ids) != asked[res.rid]:
            failures.append(f"request {res.rid}: {len(res.output_ids)} output tokens, {asked[res.rid]} asked")
        if res.served != res.routed:
            failures.append(f"request {res.rid}: served by replica {res.served}, routed to replica {res.routed}")
    failures += [f"request {rid}: answered {n} times (exactly once required)"
                 for rid, n in seen.items() if n > 1 and rid in want]
    failures += [f"request {rid}: never answered" for rid in want if seen[rid] == 0]
    return failures


def raise_for_failures(failures: Sequence[str], what: str = "validation", shown: int = 10) -> None:
    """``RunFailed`` naming the first ``shown`` failures (and how many in all); nothing if none."""
    if failures:
        more = f" (and {len(failures) - shown} more)" if len(failures) > shown else ""
        raise RunFailed(f"{what} failed for {len(failures)} check(s): " + "; ".join(failures[:shown]) + more)


# --------------------------------------------------------------------------------------- arithmetic
def stats(values: Sequence[float]) -> dict:
    """``{"n", "median", "min", "max"}`` of ``values`` (``ValueError`` when empty)."""
    if not values:
        raise ValueError("no values")
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def _metrics(metric: str) -> tuple:
    """The metrics a report summarises: ``METRICS`` and the report's own ``metric`` (e.g. ``goodput_per_s``)."""
    return METRICS if metric in METRICS else (*METRICS, metric)


def _index(records: Sequence[Mapping], metric: str = "requests_per_s") -> dict:
    """``{(system, policy, pair): record}``; ``ValueError`` naming a bad or repeated record."""
    out = {}
    for i, r in enumerate(records):
        missing = [k for k in ("system", "policy", "pair", *_metrics(metric)) if k not in r]
        if missing:
            raise ValueError(f"run record {i}: missing {missing}")
        key = (r["system"], r["policy"], int(r["pair"]))
        if key in out:
            raise ValueError(f"run record {i}: system {key[0]}, policy {key[1]}, pair {key[2]} appears twice")
        for m in _metrics(metric):
            if m == "cached_share" and r[m] is None:
                continue
            if not (isinstance(r[m], (int, float)) and r[m] >= 0):
                raise ValueError(f"run record {i}: {m} must be a number >= 0, got {r[m]!r}")
        out[key] = r
    return out


def ratios_by_pair(records: Sequence[Mapping], num: tuple, den: tuple, metric: str = "requests_per_s",
                   skip_zero: bool = False) -> dict:
    """``{pair: num / den}`` where ``num``, ``den`` are ``(system, policy)``; every pair that has either
    must have both (``ValueError`` naming the pair), and ``den`` must be > 0 (``skip_zero``: a pair whose
    ``den`` is 0, e.g. no request met the goodput targets, is left out instead)."""
    idx = _index(records, metric)
    pairs = sorted({p for (s, po, p) in idx if (s, po) in (num, den)})
    out = {}
    for p in pairs:
        a, b = idx.get((*num, p)), idx.get((*den, p))
        if a is None or b is None:
            lack = num if a is None else den
            raise ValueError(f"pair {p}: no run of system {lack[0]} with policy {lack[1]}")
        if b[metric] <= 0 and skip_zero:
            continue
        if b[metric] <= 0:
            raise ValueError(f"pair {p}: {den[0]} / {den[1]} has {metric} 0; no ratio")
        out[p] = a[metric] / b[metric]
    return out


def pair_report(records: Sequence[Mapping], metric: str = "requests_per_s", num: str = "flame",
                den: str = "standalone", floor: float = FLOOR) -> dict:
    """The study's numbers from per-run records (JSON-ready; pair numbers as ints in lists).

    Returns:
        ``runs[system][policy][metric]``: :func:`stats` over pairs; ``pair_ratios[policy]`` (when both
        ``num`` and ``den`` systems ran): ``per_pair`` ``[{"pair", "ratio"}]``, ``median``, ``min``,
        ``max``, ``below_floor`` (pairs under ``floor``); ``policy_ratios[system]`` (when it ran
        ``prefix_affinity`` and ``round_robin``): ``ratio_of_medians`` and ``per_pair`` (the pairs that
        ran both: merged runs may hold pairs of one policy only).

    Raises:
        ValueError: a bad or repeated record, a pair missing one side (named).
    """
    idx = _index(records, metric)
    systems = sorted({s for s, _, _ in idx})
    runs = {}
    for s in systems:
        runs[s] = {}
        for po in sorted({po for s2, po, _ in idx if s2 == s}):
            rs = [r for (s2, po2, _), r in sorted(idx.items()) if (s2, po2) == (s, po)]
            runs[s][po] = {m: (None if any(r[m] is None for r in rs) else stats([float(r[m]) for r in rs]))
                           for m in _metrics(metric)}
    report = {"metric": metric, "floor": floor, "runs": runs, "pair_ratios": {}, "policy_ratios": {}}
    zero_ok = metric not in METRICS  # a metric that may be 0 in a pair (goodput): that pair has no ratio
    if num in runs and den in runs:
        for po in sorted(set(runs[num]) & set(runs[den])):
            by_pair = ratios_by_pair(records, (num, po), (den, po), metric, skip_zero=zero_ok)
            pairs = sorted({p for (s2, po2, p) in idx if (s2, po2) == (den, po)})
            undefined = [p for p in pairs if p not in by_pair]
            if not by_pair:
                report["pair_ratios"][po] = {"name": f"{num} / {den}", "n": 0, "per_pair": [], "below_floor": [],
                                             "undefined": undefined}
                continue
            report["pair_ratios"][po] = dict(
                stats(list(by_pair.values())), name=f"{num} / {den}",
                per_pair=[{"pair": p, "ratio": v} for p, v in by_pair.items()],
                below_floor=[p for p, v in by_pair.items() if v < floor],
                **({"undefined": undefined} if undefined else {}))
    for s in systems:
        for suffix in sorted({po[len("prefix_affinity"):] for po in runs[s] if po.startswith("prefix_affinity")}):
            aff, rr = "prefix_affinity" + suffix, "round_robin" + suffix  # suffix "" or a load level ("@80%")
            if suffix[:1] not in ("", "@") or rr not in runs[s]:
                continue
            med = runs[s]
            both = {p for (s2, po, p) in idx if s2 == s and po == aff} & \
                {p for (s2, po, p) in idx if s2 == s and po == rr}
            by_pair = ratios_by_pair([r for r in records if int(r["pair"]) in both], (s, aff), (s, rr), metric,
                                     skip_zero=zero_ok)
            base = med[rr][metric]["median"]
            report["policy_ratios"][s + suffix] = {
                "name": f"{aff} / {rr}", "ratio_of_medians": med[aff][metric]["median"] / base if base else None,
                "per_pair": [{"pair": p, "ratio": v} for p, v in by_pair.items()],
                "pairs": {aff: med[aff][metric]["n"], rr: med[rr][metric]["n"], "both": len(both)}}
    return report


def _share(st: Optional[dict]) -> str:
    return f"{st['median']:>12.2%}" if st else f"{'-':>12}"


def _pct_down(x: float) -> str:
    """``x`` as a percentage with 2 decimals, rounded down: a ratio just under the 99 % line never prints as 99.00 %."""
    return f"{math.floor(x * 10000 + 1e-6) / 100:.2f}%"  # + 1e-6: 0.9838 stays 98.38 (binary 9837.99...)


def report_lines(report: dict) -> list[str]:
    """The report as console lines (medians with min-max, ratios as percentages)."""
    m = report["metric"]
    w = max([16, *(len(po) for pols in report["runs"].values() for po in pols)])
    lines = [f"{'system':<12} {'policy':<{w}} {'pairs':>5} {m + ' median (min-max)':>34} {'cached share':>13}"]
    for s, pols in report["runs"].items():
        for po, st in pols.items():
            x = st[m]
            lines.append(f"{s:<12} {po:<{w}} {x['n']:>5} {x['median']:>14.3f} ({x['min']:.3f}-{x['max']:.3f})"
                         f"{'':>2} {_share(st['cached_share'])}")
    for po, r in report["pair_ratios"].items():
        if not r["per_pair"]:
            lines.append(f"{r['name']}, {po}: no ratio ({m} of {r['name'].split(' / ')[1]} is 0 in every pair)")
            continue
        ratio = {x["pair"]: x["ratio"] for x in r["per_pair"]}
        below = r["below_floor"]
        which = f"{len(below)} (" + ", ".join(f"pair {p}: {_pct_down(ratio[p])}" for p in below) + ")" if below \
            else "none"
        lines.append(f"{r['name']}, {po}: median {r['median']:.2%}, pairs {_pct_down(r['min'])}-{r['max']:.2%}; "
                     f"pairs below {report['floor']:.0%}: {which}")
    for s, r in report["policy_ratios"].items():
        if r["ratio_of_medians"] is not None:
            lines.append(f"{s}: {r['name']} = {r['ratio_of_medians']:.3f}x (ratio of medians){_pair_sets(r)}")
    return lines


def _pair_sets(r: dict) -> str:
    """For a policy ratio whose two medians are over different pairs (merged runs, a cut-off run): how many each
    has and the median of the per-pair ratios over the pairs that ran both; "" when the sets are the same."""
    counts = r.get("pairs") or {}
    both = counts.get("both")
    aff, rr = r["name"].split(" / ")
    if both is None or counts.get(aff) == counts.get(rr) == both:
        return ""
    per = sorted(x["ratio"] for x in r["per_pair"])
    paired = f"{statistics.median(per):.3f}x per pair over the {both} that ran both" if per else "no pair ran both"
    return f"; medians over {counts.get(aff)} and {counts.get(rr)} pairs, {paired}"


# ------------------------------------------------------------------------------------------- figure
def plot_pair_report(records: Sequence[Mapping], path: str | Path, metric: str = "requests_per_s",
                     num: str = "flame", den: str = "standalone", floor: float = FLOOR,
                     title: Optional[str] = None, record: Optional[Mapping] = None) -> Path:
    """Write a PNG with three panels: ``metric`` per pair for each system x policy; the per-pair ratios
    ``num / den`` per policy with the ``floor`` line (and 100 %); the median cached share per policy and
    system (bars, min-max whiskers). With the run's ``record`` (``locality.json``'s fields), a second row
    holds a panel per workload beyond the study its cases show (``sut.locality.workloads.figure``). Uses
    matplotlib's Agg canvas (no display, no global backend).

    Returns:
        ``path``. Raises ``ValueError`` as :func:`pair_report` does.
    """
    fig = pair_figure(records, metric, num, den, floor, title, record)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


#: The pair-ratio panel's colour per policy: none of the first two systems' (C0, C1) nor the floor's red (C3).
RATIO_COLOURS = ("C2", "C4", "C5", "C8", "C9", "C6")


def pair_figure(records: Sequence[Mapping], metric: str = "requests_per_s", num: str = "flame",
                den: str = "standalone", floor: float = FLOOR, title: Optional[str] = None,
                record: Optional[Mapping] = None):
    """The matplotlib ``Figure`` that :func:`plot_pair_report` writes (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from sut.locality.workloads import figure as wfig

    report = pair_report(records, metric, num, den, floor)
    idx = _index(records, metric)
    panels = wfig.row_panels(record)
    fig = Figure(figsize=(15, 9.2 if panels else 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subfigures(2, 1) if panels else (fig, None)
    ax1, ax2, ax3 = top.subplots(1, 3)
    if bottom is not None:
        wfig.draw_row(bottom, record, len(panels))
    policies = sorted({po for pols in report["runs"].values() for po in pols})
    styles = ["-", "--", ":", "-."]
    series = [(i, s, po) for i, (s, pols) in enumerate(report["runs"].items()) for po in pols]
    for i, s, po in series:  # a colour per system (as in the third panel), a marker and line style per policy:
        j = policies.index(po)  # one pair (one point per line) must still tell the policies apart
        pts = sorted((p, r[metric]) for (s2, po2, p), r in idx.items() if (s2, po2) == (s, po))
        dx = (j - (len(policies) - 1) / 2) * 0.06  # policies side by side: near-equal values must not hide one
        ax1.plot([int(p) + dx for p, _ in pts], [v for _, v in pts], color=f"C{i}", marker="os^D"[j % 4],
                 linestyle=styles[j % 4], label=f"{s}, {po}")
    pairs = sorted({int(p) for *_, p in idx})
    ax1.set(xlabel="pair", ylabel=metric.replace("_", " ").replace(" per s", "/s"), title=f"{metric} per pair")
    top = max((r[metric] for r in idx.values()), default=0.0)
    # from 0, so that levels compare by eye (ratios are the second panel's), with room above the highest point
    ax1.set_ylim(0, top * 1.12 if top > 0 else 1)
    _legend(ax1, len(series))
    if any(r["per_pair"] for r in report["pair_ratios"].values()):
        for po, r in report["pair_ratios"].items():
            if not r["per_pair"]:
                continue
            j = policies.index(po) if po in policies else len(policies)  # the policy's marker and line style;
            ax2.plot([x["pair"] for x in r["per_pair"]], [100 * x["ratio"] for x in r["per_pair"]],  # colours
                     marker="os^D"[j % 4], linestyle=styles[j % 4], color=RATIO_COLOURS[j % len(RATIO_COLOURS)],
                     label=f"{po}: median {r['median']:.2%}")  # of neither a system nor the red floor
        ax2.axhline(100 * floor, color="red", linestyle=":", label=f"{floor:.0%}")
        ax2.axhline(100, color="grey", linewidth=0.8)
        _legend(ax2, 1 + sum(1 for r in report["pair_ratios"].values() if r["per_pair"]))
    else:
        ax2.text(0.5, 0.5, f"no pair ratios: only {', '.join(report['runs'])} ran\n(they need both {num} and {den})",
                 ha="center", va="center", transform=ax2.transAxes)
        ax2.set_yticks([])
    ax2.set(xlabel="pair", ylabel=f"{num} / {den}, %", title=f"pair ratios ({metric})")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if pairs:
            ax.set_xlim(pairs[0] - 0.5, pairs[-1] + 0.5)  # whole pairs, also for one pair
            if len(pairs) <= 20:
                ax.set_xticks(pairs)
    _cached_panel(ax3, report, policies)
    fig.suptitle(title or "synthetic-locality pairs (NOT an MLPerf result)")
    return fig


def _legend(ax, entries: int) -> None:
    """Inside the panel for a few entries; under it in two columns for many (arrivals: a policy per load level),
    where it cannot hide the points."""
    if entries <= 6:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))


def _cached_panel(ax, report: dict, policies: Sequence[str]) -> None:
    """The figure's third panel: median cached share per policy and system, min-max whiskers."""
    systems = list(report["runs"])
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        have = [po for po in policies if (report["runs"][s].get(po) or {}).get("cached_share") is not None]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j, po in enumerate(policies) if po in have]
        st = [report["runs"][s][po]["cached_share"] for po in have]
        med = [100 * x["median"] for x in st]
        err = [[m - 100 * x["min"] for m, x in zip(med, st)], [100 * x["max"] - m for m, x in zip(med, st)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=s, color=f"C{i}")
    many = len(policies) > 3  # e.g. a policy per load level: slanted names stay apart
    ax.set_xticks(range(len(policies)), policies, rotation=30 if many else 0, ha="right" if many else "center",
                  fontsize=8 if many else None)
    ax.set(ylabel="cached share of input tokens, %", title="cached share per policy (median, min-max)")
    ax.legend(fontsize=8)
