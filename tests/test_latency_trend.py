"""sut/record/latency_trend.py: the TTFT trend that tells a growing backlog from a steady one, the streaming ledger's
``ttft_trend`` in ``latency_summary``, and how find_qps counts a VALID try whose queue was growing."""

import json
from types import SimpleNamespace as NS

import numpy as np
import pytest

import sut.ledger.sample
import sut.ledger.streaming
from sut.findqps import cli as find_qps
from sut.findqps.plot import verdict
from sut.findqps.report import fmt_bound, table
from sut.findqps.search import Try, TryLog, bounds, search
from sut.ledger.streaming import StreamingLedger
from sut.record.latency_trend import MIN_SAMPLES, describe, not_judged, queue_trend


def _arrivals(rate: float, seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1 / rate, int(rate * seconds)))


def _slot_queue(rho: float, seconds: float, seed: int, slots: int = 512, service: float = 9.0):
    """(issue times, TTFT, end-to-end) of a Server run on an engine with ``slots`` sequence slots, each query
    holding one for ``service`` s (one H200: 128 tokens x ~70 ms), Poisson arrivals at ``rho`` x capacity, FIFO."""
    rng = np.random.default_rng(seed)
    a = np.sort(rng.uniform(0, seconds, rng.poisson(rho * slots / service * seconds)))
    start = a.copy()
    for i in range(slots, len(a)):  # query i gets the slot query i - slots frees
        start[i] = max(a[i], start[i - slots] + service)
    ttft = start - a + 0.08 + rng.gamma(2, 0.025, len(a))
    return a, ttft, start - a + service


def test_a_backlog_growing_like_the_h200_server_run_at_55_is_growing_and_a_steady_one_is_not():
    t = _arrivals(55, 150)  # a 150 s try; queries live ~9 s (issue to last token): judged from 108 s on
    rng = np.random.default_rng(1)
    # the 600 s H200 run at 55 q/s: TTFT rose ~7 ms per second of run (0 -> 4.4 s); here the same rate
    ttft = 0.1 + 0.007 * t + rng.gamma(2, 0.02, len(t))
    growing = queue_trend(t, ttft, ttft + 9.0, 600, 2000)
    assert growing["judged"] and growing["growing"] is True and 6 < growing["slope_ms_per_s"] < 8
    assert growing["projected_p50_ms"] > 2000 and growing["bins"] == 8 and growing["fit_from_s"] == pytest.approx(75, abs=1)
    assert growing["issued_qps"] == pytest.approx(55, rel=0.05) and growing["needs_span_s"] == 108
    ttft = 0.1 + rng.gamma(2, 0.05, len(t))  # same noise x 2.5, no trend
    steady = queue_trend(t, ttft, ttft + 9.0, 600, 2000)
    assert steady["growing"] is False and abs(steady["slope_z"]) < 4
    assert "queue growing: TTFT p50" in describe(growing) and "at 55.6" in describe(growing)
    assert describe(steady) is None and not_judged(steady) is None
    assert describe(steady, steady_too=True).startswith("no backlog growth: ") and "from 74 s to 148 s" in describe(steady, True)


def test_a_try_shorter_than_12_end_to_end_latencies_is_not_judged_however_it_looks():
    t = _arrivals(55, 37)  # earlier Server tries: 2,040 queries, ~37 s, queries living ~9 s
    ttft = 0.1 + 0.05 * t  # even a steep rise
    trend = queue_trend(t, ttft, ttft + 9.0, 600, 2000)
    assert trend["judged"] is False and trend["growing"] is None and trend["slope_ms_per_s"] is None
    assert not_judged(trend) == "queue trend not judged: 37 s of issuing, needs >= 108 s (12 x the 9 s a query " \
                                "holds its slot after its first token, median)"
    assert describe(trend) is None


def test_on_a_slot_bound_engine_the_fill_transient_and_a_steady_queue_are_not_growth_but_overload_is():
    # the start-up fill (TTFT low until 512 slots are busy) and a steady queue at 95 % of the slots' capacity
    fill = [queue_trend(*_slot_queue(0.95, 120, seed), 600, 2000) for seed in range(10)]
    assert all(f["judged"] for f in fill) and not any(f["growing"] for f in fill)
    over = [queue_trend(*_slot_queue(1.10, 180, seed), 600, 2000) for seed in range(10)]  # 10 % past capacity
    assert sum(bool(o["growing"]) for o in over) >= 8


def test_a_burst_at_the_end_of_a_steady_run_is_not_growth():
    t = _arrivals(48, 40)
    rng = np.random.default_rng(2)
    ttft = 0.13 + rng.gamma(2, 0.03, len(t)) + 0.4 * (t > t[-1] - 2)  # the last 2 s: 400 ms slower
    trend = queue_trend(t, ttft, np.full(len(t), 2.0), 600, 2000)
    assert trend["judged"] and trend["bins"] == 10 and trend["growing"] is False  # one slow bin among ten
    # fitted to every query instead of bin medians the same data looks like strong growth
    from sut.record.latency_trend import _slope
    half = t >= t[-1] / 2
    assert _slope(t[half], ttft[half] * 1e3)[1] > 4


def test_slow_growth_that_stays_under_the_limit_within_600_s_is_not_growing():
    t = _arrivals(40, 30)
    ttft, e2e = 0.05 + 0.0005 * t, np.full(len(t), 1.0)  # 0.5 ms/s: clearly positive, ~0.35 s by 600 s
    trend = queue_trend(t, ttft, e2e, 600, 2000)
    assert trend["slope_z"] > 4 and trend["projected_p50_ms"] < 2000 and trend["growing"] is False
    assert queue_trend(t, ttft, e2e, 600, 300)["growing"] is True  # under a 300 ms limit it would fail
    assert queue_trend(t, ttft, e2e, None, 2000)["projected_p50_ms"] is None  # no horizon: no projection, no verdict
    assert queue_trend(t, ttft, e2e, 600, None)["growing"] is None
    full = queue_trend(t, ttft, e2e, 20, 30)  # a run already longer than the horizon: the TTFT it reached
    assert full["projected_p50_ms"] == full["last_quarter_p50_ms"] and "grew all run" in describe(full)


def test_too_few_samples_or_too_short_a_span_give_no_trend_bad_values_are_left_out_and_lengths_must_match():
    one = np.ones(MIN_SAMPLES - 1)
    assert queue_trend(np.arange(MIN_SAMPLES - 1) * 0.1, one, one, 600, 2000) is None
    assert queue_trend(np.arange(500) * 0.01, np.ones(500), np.ones(500), 600, 2000) is None  # 5 s span
    with pytest.raises(ValueError, match="have 3, 2 and 3 values"):
        queue_trend([0, 1, 2], [0.1, 0.2], [1, 1, 1], 600, 2000)
    flat = queue_trend(np.arange(300) * 0.1, np.full(300, 0.2), np.full(300, 1.0), 600, 2000)  # slope 0, z 0
    assert flat["slope_ms_per_s"] == 0 and flat["growing"] is False
    ttft = np.full(300, 0.2)
    ttft[::7] = np.nan
    bad = queue_trend(np.arange(300) * 0.1, ttft, np.full(300, 1.0), float("nan"), 2000)
    assert bad["samples"] == 300 - 43 and bad["horizon_s"] is None and bad["growing"] is None
    assert json.loads(json.dumps(bad, allow_nan=False)) == bad  # strict JSON: no NaN anywhere


def test_the_streaming_ledger_reports_the_trend_from_its_own_issue_and_first_token_times(monkeypatch):
    clock = NS(now=0.0)
    fake_time = NS(monotonic=lambda: clock.now)
    monkeypatch.setattr(sut.ledger.sample, "time", fake_time)
    monkeypatch.setattr(sut.ledger.streaming, "time", fake_time)
    led = StreamingLedger((128009,), progress=False, complete_fn=lambda r: None, first_fn=lambda r: None)
    for i in range(300):  # one query every 0.1 s; TTFT 50 ms + 20 ms per second of run
        clock.now = i * 0.1
        [(rid, _)] = led.issue([NS(id=i, index=0)])
        clock.now += 0.05 + 0.02 * i * 0.1
        led.first_tokens([(rid, 5)])
        led.complete([(rid, np.array([5, 6], np.int32))])
    assert led.wait_sent(5) and led.error is None
    trend = led.latency_summary(600, 2000)["ttft_trend"]
    assert trend["samples"] == 300 and trend["slope_ms_per_s"] == pytest.approx(20, rel=0.01) and trend["growing"]
    assert led.latency_summary()["ttft_trend"]["growing"] is None  # no limit (accuracy mode): no verdict


def test_find_qps_counts_a_valid_try_with_a_growing_queue_as_an_upper_bound_unless_allowed(tmp_path):
    def run(q):  # LoadGen says VALID up to 13, but from 10 on the backlog grows
        return Try(q, "VALID" if q <= 13 else "INVALID", queue_growing=q >= 10 if q <= 13 else None)

    best, tries = search(run, 4, rel_tol=0.05, max_runs=8)
    assert best is not None and best < 10 and [t.qps for t in tries][:3] == [4, 8, 16]
    assert bounds(tries) == (best, min(t.qps for t in tries if t.qps >= 10))
    best_allowed, _ = search(run, 4, rel_tol=0.05, max_runs=8, allow_growth=True)
    assert 12.5 <= best_allowed <= 13
    shown = table(tries)
    assert "GROWING" in shown and "it bounds the search from above like an INVALID try" in shown
    assert "counted as VALID here (--allow-queue-growth)" in table(tries, allow_growth=True)
    assert fmt_bound(10, tries, False) == "10 (GROWING)" and fmt_bound(10, tries, True) == "10"
    assert verdict(Try(12, "VALID", queue_growing=True)) == "VALID, queue growing" and verdict(Try(3, "VALID")) == "VALID"
    log = TryLog(tmp_path / "t.jsonl", {"scenario": "Server"})
    log.append(Try(12, "VALID", queue_growing=True))
    assert log.read()[0].queue_growing is True
    (tmp_path / "bad.jsonl").write_text(json.dumps({"qps": 5, "validity": "VALID", "queue_growing": "yes",
                                                    "settings": {"scenario": "Server"}}) + "\n")
    with pytest.raises(ValueError, match="queue_growing 'yes' is not true, false or null"):
        TryLog(tmp_path / "bad.jsonl", {"scenario": "Server"}).read()


def test_a_try_takes_queue_growing_and_the_note_from_its_run_json():
    t_ = _arrivals(55, 150)
    trend = queue_trend(t_, 0.1 + 0.007 * t_, np.full(len(t_), 9.0), 600, 2000)
    rec = {"validity": "VALID", "tokens_per_s": 7000.0, "latency": {"harness": {"ttft_trend": trend}}}
    t = find_qps.try_from_record(55.5, rec, True, "f", 160.0)
    assert t.queue_growing is True and t.valid and not t.holds() and t.holds(allow_growth=True)
    assert t.note.startswith("queue growing: TTFT p50")
    short = queue_trend(t_[:2000], 0.1 + 0.007 * t_[:2000], np.full(2000, 9.0), 600, 2000)
    t = find_qps.try_from_record(55.5, dict(rec, latency={"harness": {"ttft_trend": short}}), True, "f", 40.0)
    assert t.queue_growing is None and t.holds() and t.note.startswith("queue trend not judged: 37 s of issuing")
    old = find_qps.try_from_record(48, {"validity": "VALID"}, True, "f", 20.0)  # run.json without a trend
    assert old.queue_growing is None and old.holds() and old.note == ""


def test_the_latency_figure_is_drawn_and_never_fails_a_run(tmp_path, caplog):
    from sut.record.latency_figure import write_latency_figure

    t = _arrivals(55, 150)
    ttft = 0.1 + 0.007 * t
    trend = queue_trend(t, ttft, np.full(len(t), 9.0), 600, 2000)
    tpot = np.full(len(t), 0.07)
    tpot[3] = np.nan  # a bad value is left out, not drawn
    png = write_latency_figure(tmp_path / "latency.png", "Server, target_qps 55: VALID", (t, ttft), (t, tpot),
                               {"ttft": 2000, "tpot": 100}, trend)
    assert png == tmp_path / "latency.png" and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
    assert write_latency_figure(tmp_path / "none.png", "x", ([], []), ([], []), None, None) is None  # no samples
    assert write_latency_figure(tmp_path / "missing" / "l.png", "x", (t, ttft), (t, tpot), None, None) is None
    assert "could not draw" in caplog.text and not (tmp_path / "none.png").exists()


def test_a_stop_signal_while_the_latency_figure_is_written_leaves_no_partial_file(tmp_path, monkeypatch):
    """Ctrl-C inside ``savefig``: the stop goes on (the run records itself interrupted) and the half-written
    latency.png is removed, as after a failed write."""
    from matplotlib.figure import Figure

    from sut.record.latency_figure import write_latency_figure

    def cut_short(self, fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG partial")
        raise KeyboardInterrupt("SIGINT, Ctrl-C")

    monkeypatch.setattr(Figure, "savefig", cut_short)
    t = _arrivals(5, 20)
    with pytest.raises(KeyboardInterrupt):
        write_latency_figure(tmp_path / "latency.png", "x", (t, 0.1 + 0 * t), (t, 0.05 + 0 * t), None, None)
    assert not (tmp_path / "latency.png").exists()


def test_the_trend_line_goes_through_the_fit_and_never_below_a_tenth_of_it_on_the_log_axis():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sut.record.latency_figure import _trend_line

    t = _arrivals(55, 150)
    ttft = 0.1 + 0.007 * t + np.random.default_rng(2).gamma(2, 0.02, len(t))
    trend = queue_trend(t, ttft, ttft + 9.0, 600, 2000)
    # the fit's own point lies on the data: 100 ms + 7 ms/s x t + the noise's mean (40 ms)
    assert trend["fit_mid_ms"] == pytest.approx(140 + 7 * trend["fit_mid_s"], rel=0.05)
    fig, ax = plt.subplots()
    _trend_line(ax, trend)
    (line,) = ax.get_lines()
    xs, ys = line.get_data()
    assert np.interp(trend["fit_mid_s"], xs, ys) == pytest.approx(trend["fit_mid_ms"], rel=1e-3)
    # the newuser's 1 q/s try (no fit point recorded): the old anchor reached -150 ms at fit_from_s; now cut
    old = {"span_s": 495.06, "fit_from_s": 247.53, "slope_ms_per_s": 1.5174, "last_quarter_p50_ms": 131.381}
    ax.clear()
    _trend_line(ax, old)
    xs, ys = ax.get_lines()[0].get_data()
    assert ys.min() >= 13.1 and xs.max() == pytest.approx(495.06) and xs.min() > 247.53
    plt.close(fig)


def test_a_backlog_that_built_early_and_then_stayed_is_called_past_capacity_not_steady():
    # one H200, Interactive 44 q/s at 1,024 batched tokens a step (2026-12-02): TTFT p50 3.7 s in the first
    # quarter, then 20-30 s, flat over the second half (slope -14.7 ms/s): every sequence slot taken
    t = _arrivals(44, 600)
    rng = np.random.default_rng(2)
    ttft = np.minimum(0.1 + 0.12 * t, 25.0) + rng.gamma(2, 0.5, len(t))
    trend = queue_trend(t, ttft, ttft + 3.1, 600, 500)
    assert trend["judged"] and trend["growing"] is False and trend["saturated"] is True
    line = describe(trend, steady_too=True)
    assert line.startswith("backlog already built: TTFT p50 ") and line.endswith("past capacity")
    assert "above the TTFT limit, then flat (" in line and describe(trend) == line  # also without steady_too
    steady = queue_trend(t, 0.1 + rng.gamma(2, 0.02, len(t)), 0.1 + 3.1 + np.zeros(len(t)), 600, 500)
    assert steady["saturated"] is False and describe(steady, True).startswith("no backlog growth: ")
    assert queue_trend(t, ttft, ttft + 3.1, 600, None)["saturated"] is None


def test_a_log_axis_spanning_about_a_decade_labels_its_2x_3x_5x_ticks():
    """TPOT of 8-35 ms holds one major tick (10): 20 and 30 get labels too, other minor ticks none."""
    from sut.record.latency_figure import _minor_label

    assert [_minor_label(v, None) for v in (20.0, 30.0, 50.0, 200.0)] == ["20", "30", "50", "200"]
    assert [_minor_label(v, None) for v in (40.0, 70.0, 0.3, 0.0)] == ["", "", "", ""]
