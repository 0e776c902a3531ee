"""``locality.png``'s workload panels (``sut/locality/workloads/figure.py``): drawn from the recorded GPU runs under
``docs/results/`` (eviction, hot-prefixes, replica-loss: the values of the bars are the medians of the record's own
fields) and from small made-up records (arrivals, variable answers); a study run keeps its three panels."""

import json
from pathlib import Path
from statistics import median

import pytest
from matplotlib.patches import Rectangle

from sut.locality.study import pair_figure
from sut.locality.workloads.figure import workload_panels

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def load(path):
    return json.loads((RESULTS / path).read_text())


def figure_of(record):
    return pair_figure(record["runs"], record.get("report_metric") or "requests_per_s", record=record)


def workload_axes(fig):
    top, bottom = fig.subfigs
    assert len(top.axes) == 3
    return bottom.axes


def bar_heights(ax):
    return [round(p.get_height(), 6) for p in ax.patches if isinstance(p, Rectangle)]


def groups(record):
    """The recorded cases by (system, policy), sorted as the pair panels sort them (every pair here is complete)."""
    out = {}
    for c in record["cases"]:
        out.setdefault((c["system"], c["policy"]), []).append(c)
    return dict(sorted(out.items()))


def test_eviction_panel_shows_the_engines_and_the_routers_cached_share():
    rec = load("h100_2026-12-06e/eviction/locality.json")
    (ax,) = workload_axes(figure_of(rec))
    g = groups(rec)
    want = [round(100 * median(c["timed"][f] for c in cases), 6)
            for f in ("cached_share", "router_cached_share") for cases in g.values()]
    assert bar_heights(ax) == want
    assert want[:4] == [35.04, 10.1, 35.04, 10.1] and "3.0139x" in ax.get_title() and "65,514" in ax.get_title()


def test_hot_prefixes_panel_shows_each_replicas_uncached_prefill():
    rec = load("h100_2026-12-06c/hot-prefixes/locality.json")
    (ax,) = workload_axes(figure_of(rec))
    g = groups(rec)
    want = [round(median(c["timed"]["per_replica"][r]["uncached_tokens"] for c in cases) / 1000, 6)
            for r in (0, 1) for cases in g.values()]
    assert bar_heights(ax) == want and len(want) == 12 and "s = 1.1" in ax.get_title()


def test_replica_loss_panel_stacks_every_requests_outcome_and_names_a_kill_that_cost_nothing():
    rec = load("h100_2026-12-06b/replica-loss/locality.json")
    (ax,) = workload_axes(figure_of(rec))
    keys = list(groups(rec))
    heights = bar_heights(ax)
    n = len(keys)
    answered, rerouted, failed = heights[:n], heights[n:2 * n], heights[2 * n:]
    assert all(a + r + f == 128 for a, r, f in zip(answered, rerouted, failed))
    assert dict(zip(keys, rerouted)) == {("standalone", "prefix_affinity"): 15, ("flame", "prefix_affinity"): 0,
                                         ("standalone", "round_robin"): 32, ("flame", "round_robin"): 0}
    notes = sorted(t.get_text() for t in ax.texts)
    assert notes == ["no loss measured", "no loss measured", "recovery 4.3 s", "recovery 6.5 s"]


def made_up(**extra):
    """Two pairs of two systems, one policy; ``extra`` merged into every case's record."""
    cases = []
    for pair in (0, 1):
        for k, s in enumerate(("standalone", "flame")):
            t = {"latency_s": {"p50": 1.0 + k + pair, "p99": 4.0 + k}}
            levels = [{"level": lv, "rate": 10 * lv + 0.2 * pair, "timed": {"goodput_per_s": 10 * lv - k - pair}}
                      for lv in (0.5, 0.8, 0.95)]
            cases.append({"pair": pair, "system": s, "policy": "round_robin", "timed": t,
                          **({"levels": levels} if extra.get("levels") else {})})
    return {"cases": cases, "trace_settings": extra.get("trace_settings", {}),
            "workload": {"settings": {"ttft_target_s": 5.0, "tpot_target_s": 0.1}}}


def test_arrivals_panel_draws_the_median_goodput_per_level_and_the_offered_rate():
    import matplotlib.figure

    rec = made_up(levels=True)
    assert [n for n, _ in workload_panels(rec)] == ["arrivals"]
    fig = matplotlib.figure.Figure()
    ax = fig.subplots()
    from sut.locality.workloads.figure import draw
    assert draw([ax], rec) == ["arrivals"]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert lines["standalone, round_robin"] == pytest.approx([4.5, 7.5, 9.0])  # median of pairs 0 and 1
    assert lines["flame, round_robin"] == pytest.approx([3.5, 6.5, 8.0])
    assert lines["offered rate"] == pytest.approx([5.1, 8.1, 9.6])
    assert "TTFT <= 5.0 s" in ax.get_title()


def test_variable_answers_panel_draws_client_latency_p50_and_p99():
    rec = made_up(trace_settings={"answers": "log_uniform"})
    import matplotlib.figure

    from sut.locality.workloads.figure import draw
    ax = matplotlib.figure.Figure().subplots()
    assert draw([ax], rec) == ["variable-answers"]
    assert bar_heights(ax) == [2.5, 1.5, 5.0, 4.0]  # p50 flame, standalone; p99 flame, standalone


def test_a_run_of_the_studys_traces_keeps_three_panels_and_a_failed_case_draws_nothing():
    rec = load("h100_2026-12-06e/eviction/locality.json")
    study = dict(rec, workload={}, trace_settings=dict(rec["trace_settings"], zipf_s=0.0))
    fig = figure_of(study)
    assert not fig.subfigs and len(fig.axes) == 3
    failed = dict(rec, cases=[dict(c, timed=None) for c in rec["cases"]])
    assert workload_panels(failed) == []


def test_a_record_the_panels_cannot_read_leaves_a_note_in_the_row_not_an_error(monkeypatch, caplog):
    """A figure error never fails a run that measured fine: the row says what went wrong, a warning is logged."""
    import sut.locality.workloads.figure as wfig

    def broken(ax, record, g):
        raise KeyError("some_field")

    monkeypatch.setattr(wfig, "_eviction", broken)
    rec = load("h100_2026-12-06e/eviction/locality.json")
    notes = list(rec["notes"])
    fig = figure_of(rec)
    top, bottom = fig.subfigs
    assert len(top.axes) == 3 and not bottom.axes
    assert [t.get_text() for t in bottom.texts] == ["workload panels not drawn: KeyError: 'some_field'"]
    assert "workload panels were not drawn" in caplog.text
    assert rec["notes"] == notes + ["locality.png: workload panels not drawn: KeyError: 'some_field'"]
    monkeypatch.setattr(wfig, "workload_panels", lambda record: 1 / 0)
    rec = load("h100_2026-12-06e/eviction/locality.json")
    note = figure_of(rec).subfigs[1].texts[0].get_text()
    assert "ZeroDivisionError" in note and rec["notes"][len(notes):] == [f"locality.png: {note}"]  # once


def test_a_field_no_case_records_is_marked_n_a_not_drawn_as_zero():
    rec = load("h100_2026-12-06e/eviction/locality.json")
    for c in rec["cases"]:
        del c["timed"]["router_cached_share"]
    (ax,) = workload_axes(figure_of(rec))
    heights = bar_heights(ax)
    assert heights[:4] == [35.04, 10.1, 35.04, 10.1] and all(h != h for h in heights[4:])  # NaN: no bar
    assert [t.get_text() for t in ax.texts] == ["n/a"] * 4
    import matplotlib.figure

    from sut.locality.workloads.figure import draw
    rec = made_up(trace_settings={"answers": "log_uniform"})
    for c in rec["cases"]:
        c["timed"] = {"requests": 24}  # a finished case without latency_s
    ax = matplotlib.figure.Figure().subplots()
    assert draw([ax], rec) == ["variable-answers"]
    assert len(ax.patches) == 4 and all(p.get_height() != p.get_height() for p in ax.patches) and len(ax.texts) == 4


def test_hot_prefixes_panel_reads_older_and_sparser_per_replica_records():
    """A run before ``uncached_tokens`` (prompt - cached), a case without per-replica counts, and a replica that
    answered nothing (no entry: the other replica keeps its own bar, the idle one shows 0)."""
    rec = load("h100_2026-12-06c/hot-prefixes/locality.json")
    want = bar_heights(workload_axes(figure_of(rec))[0])
    for c in rec["cases"]:
        for p in c["timed"]["per_replica"]:
            del p["uncached_tokens"]
    assert bar_heights(workload_axes(figure_of(rec))[0]) == want
    rec["cases"][0]["timed"]["per_replica"] = None  # one pair of six cases: the median of the other two pairs
    assert len(bar_heights(workload_axes(figure_of(rec))[0])) == 12
    for c in rec["cases"]:
        if c["system"] == "flame" and c["policy"] == "round_robin":
            c["timed"]["per_replica"] = c["timed"]["per_replica"][1:]  # replica 0 answered nothing
    (ax,) = workload_axes(figure_of(rec))
    keys = list(groups(rec))
    j = keys.index(("flame", "round_robin"))
    heights = bar_heights(ax)
    assert heights[j] == 0 and heights[len(keys) + j] == want[len(keys) + j]  # replica 0: 0; replica 1: as before


def test_replica_loss_bars_add_up_to_the_requests_when_pairs_differ():
    """The median of each outcome apart would give 100 of 128 requests here; the median pair's outcomes add up."""
    import matplotlib.figure

    from sut.locality.workloads.figure import draw
    outcomes = [(100, 28, 0), (128, 0, 0), (90, 0, 38)]
    cases = [{"pair": i, "system": "standalone", "policy": "round_robin", "timed": {"requests": 128},
              "failover": {"answered": a, "rerouted": r, "failed": f, "recovery_s": 1.0 if r else None}}
             for i, (a, r, f) in enumerate(outcomes)]
    fig = matplotlib.figure.Figure(layout="constrained")
    ax = fig.subplots()
    assert draw([ax], {"cases": cases}) == ["replica-loss"]
    assert bar_heights(ax) == [100, 28, 0]
    fig.canvas.draw()
    leg, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert leg.x0 >= box.x1  # the legend sits beside the axes, over no bar


def test_many_series_put_the_legend_under_the_panel_and_arrivals_keep_the_systems_colours():
    """Arrivals name a policy per load level (12 series for 2 systems x 2 policies x 3 levels): a legend inside the
    panel would hide the points; the workload panel colours each system as the pair panels do."""
    from matplotlib.colors import to_hex

    runs = [{"system": s, "policy": f"{po}@{lv}%", "pair": p, "goodput_per_s": 1.0 + p, "cached_share": 0.1,
             "requests_per_s": 2.0, "output_tokens_per_s": 9.0}
            for s in ("flame", "standalone") for po in ("prefix_affinity", "round_robin") for lv in (50, 80, 95)
            for p in (0, 1)]
    rec = made_up(levels=True)
    rec["cases"] += [dict(c, policy="prefix_affinity") for c in rec["cases"]]
    fig = pair_figure(runs, "goodput_per_s", record=rec)
    fig.canvas.draw()
    ax1 = fig.subfigs[0].axes[0]
    assert ax1.get_legend().get_window_extent().y1 <= ax1.get_window_extent().y0  # under the panel
    few = pair_figure([r for r in runs if r["policy"].endswith("@50%")], "goodput_per_s")
    few.canvas.draw()
    a = few.axes[0]
    assert a.get_window_extent().contains(*a.get_legend().get_window_extent().get_points()[0])  # inside
    top = {ln.get_label().split(",")[0]: to_hex(ln.get_color()) for ln in ax1.get_lines()}
    (wax,) = workload_axes(fig)
    bottom = {tuple(ln.get_label().split(", ")): (to_hex(ln.get_color()), ln.get_linestyle())
              for ln in wax.get_lines() if "," in ln.get_label()}
    assert len(bottom) == 4 and all(colour == top[s] for (s, _), (colour, _) in bottom.items())
    assert len({style for _, style in bottom.values()}) == 2 and top["flame"] != top["standalone"]


def test_a_pair_the_merge_dropped_draws_no_bar():
    """A pair whose policy lacks a system's finished case is left out whole, as the merged medians leave it out:
    no ``standalone / round_robin`` bar from pairs whose ``flame / round_robin`` case never finished, and a pair
    missing one system's cases keeps the other pairs only."""
    from sut.locality.workloads.figure import groups as fig_groups
    rec = load("h100_2026-12-06c/hot-prefixes/locality.json")
    full = list(groups(rec))
    n = len(full)
    heights = bar_heights(workload_axes(figure_of(rec))[0])
    cut = dict(rec, cases=[c for c in rec["cases"] if (c["system"], c["policy"]) != ("flame", "round_robin")])
    kept = list(fig_groups(cut))
    assert ("standalone", "round_robin") not in kept and len(kept) == n - 2
    (ax,) = workload_axes(figure_of(cut))
    idx = [full.index(k) for k in kept]
    assert bar_heights(ax) == [heights[i] for i in idx] + [heights[n + i] for i in idx]  # replica 0, then 1
    one_pair = dict(rec, cases=[c for c in rec["cases"] if not (c["pair"] == 1 and c["system"] == "flame")])
    assert {k: sorted(c["pair"] for c in v) for k, v in fig_groups(one_pair).items()} == {k: [0, 2] for k in full}
