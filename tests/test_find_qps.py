"""python -m sut find-qps's resumable search: tries appended to a JSONL file as they end, ``--resume`` going on
from the recorded bounds, a cut-off mid-try or mid-write, settings checks and the time budget. A fake run
function stands in for ``python -m sut run`` (no engines; fast)."""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
from conftest import REPO

from sut.findqps import cli as find_qps
from sut.findqps.search import Budget, Try, TryLog, search

SETTINGS = {"scenario": "Server", "min_duration_s": 30.0, "min_query_count": 1000, "run_args": ["--config", "x.toml"]}


def fake(limit=13.0, wall_s=150.0):
    """A try is VALID at or below ``limit`` qps; the calls are recorded."""
    calls = []

    def run(q):
        calls.append(q)
        return Try(q, "VALID" if q <= limit else "INVALID", 400.0, 20.0, 5000.0 * q, f"run-{q:g}", "", wall_s)
    run.calls = calls
    return run


class CutOff(Exception):
    """The device session ends mid-try."""


def test_a_search_cut_off_mid_try_resumes_from_the_log_and_ends_where_an_uncut_one_does(tmp_path):
    whole = fake()
    best_whole, tries_whole = search(whole, start=4, rel_tol=0.05, max_runs=20)

    trylog = TryLog(tmp_path / "tries.jsonl", SETTINGS)
    first = fake()

    def session1(q):
        if len(first.calls) == 3:
            raise CutOff  # the 4th try never ends
        t = first(q)
        trylog.append(t)
        return t
    with pytest.raises(CutOff):
        search(session1, start=4, rel_tol=0.05, max_runs=20)
    assert len((tmp_path / "tries.jsonl").read_text().splitlines()) == 3  # every finished try, at once

    prior = TryLog(tmp_path / "tries.jsonl", SETTINGS).read()
    assert prior == tries_whole[:3]  # the records read back as the tries were
    second = fake()
    best, tries = search(second, start=None, rel_tol=0.05, max_runs=20, prior=prior)
    assert best == best_whole and tries == tries_whole
    assert second.calls == [t.qps for t in tries_whole[3:]]  # no try made twice
    assert second.calls[0] == (8 + 16) / 2  # the bisection starts from the recorded bounds (VALID 8, INVALID 16)


def test_resume_of_a_finished_search_makes_no_try_and_bad_inputs_raise():
    done = [Try(10, "VALID"), Try(10.4, "INVALID")]
    run = fake()
    best, tries = search(run, start=None, rel_tol=0.05, prior=done)
    assert best == 10 and run.calls == [] and tries == done
    best, _ = search(run, start=None, rel_tol=0.05, prior=[Try(12, "VALID"), Try(11, "INVALID")])  # noisy: crossed
    assert best == 12 and run.calls == []
    # a failed try is no verdict (a crash, a time-out): it bounds nothing and a resumed search makes it again
    assert [t.qps for t in search(run, start=None, prior=[Try(6, None)], max_runs=1)[1]] == [6, 6]
    assert search(run, start=None, prior=[Try(20, "INVALID"), Try(10, None)], max_runs=1)[1][-1].qps == 10
    with pytest.raises(ValueError, match="start"):
        search(run, start=None)  # nothing recorded and nowhere to start
    with pytest.raises(ValueError):
        search(run, start=0)


def test_log_skips_and_trims_a_line_cut_off_while_written(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    log = TryLog(path, SETTINGS)
    log.append(Try(4, "VALID", wall_s=100.0))
    with open(path, "a") as f:
        f.write('{"qps": 8, "validity": "INV')  # killed mid-write
    assert log.read() == [Try(4, "VALID", wall_s=100.0)] and "unfinished record" in caplog.text
    log.append(Try(8, "INVALID"))
    lines = path.read_text().splitlines()
    assert [json.loads(x)["qps"] for x in lines] == [4, 8]
    assert json.loads(lines[1])["settings"] == SETTINGS and json.loads(lines[1])["finished"]


@pytest.mark.parametrize("content", [b"important data, no newline", b"line one\nimportant data, no newline",
                                     b'[{"tok_input": [1, 2]}]', bytes(range(1, 10)) * 1000])
def test_a_file_that_is_no_try_log_is_refused_never_trimmed(tmp_path, monkeypatch, capsys, content):
    """Before: --log or --resume naming a file that is no try log (a dataset given by mistake) whose last line has
    no newline took that line for a cut-off write: the first try's append trimmed it (a whole JSON dataset went)."""
    path = tmp_path / "data.json"
    path.write_bytes(content)
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    for flag in ("--log", "--resume"):
        with pytest.raises(SystemExit) as e:
            find_qps.main(["--scenario", "Server", "--start", "4", "--output-dir", str(tmp_path / "o"), flag,
                           str(path)])
        assert e.value.code == 2 and f"{flag}: {path} line " in capsys.readouterr().err
        assert path.read_bytes() == content and not (tmp_path / "o").exists()
    log = TryLog(tmp_path / "t.jsonl", SETTINGS)
    log.append(Try(4, "VALID"))  # a try log whose write was cut in its first bytes: still one
    with open(log.path, "ab") as f:
        f.write(b'{"q')
    assert log.read() == [Try(4, "VALID")]


def test_log_refuses_a_bad_line_or_tries_made_with_other_settings(tmp_path):
    path = tmp_path / "t.jsonl"
    TryLog(path, SETTINGS).append(Try(4, "VALID"))
    with pytest.raises(ValueError, match=r"t.jsonl line 1: made with min_query_count 1000, this search uses 500"):
        TryLog(path, dict(SETTINGS, min_query_count=500)).read()
    with pytest.raises(ValueError, match="made with scenario 'Server', this search uses 'Interactive'"):
        TryLog(path, dict(SETTINGS, scenario="Interactive")).read()
    path.write_text('not json\n{"qps": 4}\n')
    with pytest.raises(ValueError, match="t.jsonl line 1: not a try record"):
        TryLog(path, SETTINGS).read()


def test_budget_starts_no_try_that_would_end_after_it():
    now = [0.0]
    b = Budget(600, earlier=[Try(4, "VALID", wall_s=150.0)], clock=lambda: now[0])
    assert b.may_start()  # 0 + 150 <= 600
    now[0] = 400.0
    b.note(Try(8, "VALID", wall_s=190.0))
    assert b.may_start()  # 400 + 190
    now[0] = 420.0
    assert not b.may_start()  # 420 + 190 > 600
    assert Budget(None, clock=lambda: 1e9).may_start()
    run, clock = fake(wall_s=150.0), [0.0]
    b = Budget(400, clock=lambda: clock[0])

    def timed(q):
        clock[0] += 150.0
        return b.note(run(q))
    _, tries = search(timed, start=4, max_runs=8, may_start=b.may_start)
    assert len(tries) == 2  # 300 s used, a third try would end at 450 s


def test_budget_scales_a_try_to_a_lower_rate_while_the_search_brackets_downward():
    """A new user's CPU search: tries of 480 queries at 4 and 2 q/s, then one at 1 q/s took 498 s
    against an estimate of 379 s (the longest so far) and ended 96 s past --budget-s."""
    now = [0.0]
    b = Budget(1150, clock=lambda: now[0])
    now[0] = 747.0
    b.note(Try(4, "INVALID", wall_s=250.0))
    b.note(Try(2, "INVALID", wall_s=379.0))
    assert b.estimate() == 379.0 and b.estimate(2) == 379.0 and b.estimate(8) == 379.0  # the longest, unscaled
    assert b.estimate(3) == 379.0  # 250 s at 4 q/s -> 333 s at 3 q/s: shorter than the longest
    assert b.estimate(1) == 758.0  # the nearest try above, 379 s at 2 q/s -> 758 s at 1 q/s
    assert not b.may_start(1)  # 747 + 758 > 1,150 (the old estimate, 379 s, let it start)
    assert b.may_start(4)  # 747 + 379 <= 1,150
    run, clock = fake(limit=0.5, wall_s=0.0), [0.0]  # every try INVALID: the search shrinks by 2 each time
    b = Budget(650, clock=lambda: clock[0])

    def timed(q):
        clock[0] += 400.0 / q  # a try issues 400 queries
        return b.note(dataclasses.replace(run(q), wall_s=400.0 / q))
    _, tries = search(timed, start=4, max_runs=8, may_start=b.may_start)
    assert [t.qps for t in tries] == [4, 2]  # 100 + 200 s used; at 1 q/s a try needs 400 s: 650 would be passed
    assert clock[0] == 300.0


def test_budget_counts_the_engine_start_of_a_one_process_search_only_until_a_try_without_it():
    """On one H200: the first try took 134 s with the engine start, the next ones 23-40 s; the
    estimate stayed at 134 s and cut the search short."""
    now = [0.0]
    b = Budget(300, earlier=[Try(48, "VALID", wall_s=134.0)], clock=lambda: now[0])
    assert b.estimate() == 134.0  # recorded tries, nothing measured here yet
    b.note(Try(20, "VALID", wall_s=120.0), startup=True)
    assert b.estimate() == 120.0
    b.note(Try(40, "VALID", wall_s=35.0))
    b.note(Try(80, "INVALID", wall_s=40.0))
    assert b.estimate() == 40.0  # this process's pace, the start no longer counted
    now[0] = 255.0
    assert b.may_start()  # 255 + 40 <= 300
    now[0] = 261.0
    assert not b.may_start()
    one = find_qps.OneProcessTries(SimpleNamespace(output_dir="x"), [])
    assert not one.started_engines  # nothing run yet
    one.series = SimpleNamespace(tests=1)
    assert one.started_engines  # the first try of this process started them
    one.series.tests = 2
    assert not one.started_engines and not find_qps.FreshProcessTries.started_engines


def test_main_appends_each_try_then_resumes_from_the_file(tmp_path, monkeypatch, capsys, synthetic_small):
    run = fake()
    monkeypatch.setattr(find_qps, "sut_try", lambda scenario, q, *a: run(q))
    args = ["--scenario", "Server", "--min-duration-s", "30", "--output-dir", str(tmp_path), "--rel-tol", "0.05",
            "--fresh-process"]
    run_args = ["--config", str(REPO / "loadgen_configs" / "cpu_tiny.toml"), "--dataset", str(synthetic_small[0])]
    assert find_qps.main([*args, "--start", "4", "--max-runs", "3", "--", *run_args]) == 0
    path = tmp_path / "tries-Server.jsonl"
    out = capsys.readouterr().out
    assert "not converged (highest VALID 8, lowest INVALID 16, --rel-tol 0.05); go on with:\n  " \
           f"python -m sut find-qps --scenario Server --resume {path} " in out
    assert [json.loads(x)["qps"] for x in path.read_text().splitlines()] == [4, 8, 16]
    assert find_qps.main([*args, "--resume", str(path), "--", *run_args]) == 0
    out = capsys.readouterr().out
    assert "3 earlier tries" in out and "not converged" not in out
    assert "user.conf line: llama3_1-8b.Server.target_qps = 13\n" in out
    assert run.calls == [4, 8, 16, 12, 14, 13, 13.5]  # went on at the midpoint of the recorded bounds
    assert len(path.read_text().splitlines()) == len(run.calls)  # the resumed tries went to the same file
    png = path.with_suffix(".png")  # the search's figure, next to its log
    assert f"figure: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("extra,message", [
    (["--max-runs", "1"], "--start is needed without earlier tries"),
    (["--start", "4", "--budget-s", "0"], "--budget-s 0: must be a number of seconds > 0"),
    (["--start", "4", "--budget-s", "nan"], "--budget-s nan: must be"),
    (["--start", "4", "--budget-s", "1e-9"], "--budget-s 1e-09: below --min-duration-s 120, the least a try takes"),
    (["--start", "4", "--budget-s", "60", "--min-duration-s", "61"], "--budget-s 60: below --min-duration-s 61"),
    (["--start", "4", "--timeout-s", "-5"], "--timeout-s -5: must be"),
    (["--start", "nan"], "--start nan: must be a number > 0"),
    (["--start", "4", "--factor", "1"], "--factor 1: must be a number in (1, 100]"),
    (["--start", "4", "--factor", "1e308"], "--factor 1e+308: must be a number in (1, 100]"),
    (["--start", "4", "--rel-tol", "0"], "--rel-tol 0: must be a number > 0"),
    (["--start", "4", "--rel-tol", "1e-9"], "--rel-tol 1e-09: below 0.0001: finer bounds are below the 6 digits"),
    (["--start", "4", "--max-runs", "0"], "--max-runs 0 without earlier tries (--resume FILE) would make no try"),
    (["--resume", "missing.jsonl"], "no such file"),
    (["--resume", "FIFO"], "fifo: not a regular file"),  # not read (it would block), not "no such file"
    (["--resume", "OTHER", "--min-query-count", "500"], "made with min_query_count 1000, this search uses 500"),
    (["--start", "4", "--", "--output-dir", "D"], "--output-dir after --: find-qps sets it for every try"),
    (["--start", "4", "--", "--target-qps=5", "--scenario", "Offline"], "--scenario, --target-qps after --: find-qps "
                                                                       "sets them"),
    (["--start", "4", "--", "--output", "D"], "--output-dir after --: find-qps sets it"),  # argparse's abbreviation
    (["--start", "4", "--", "--run-name", "mine"], "--run-name after --: find-qps sets it"),
    (["--start", "4", "--", "--target=5", "--min-dur", "3"], "--min-duration-s, --target-qps after --"),
    (["--start", "4", "--", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_main_bad_resume_or_no_start_exits_2_before_any_try(tmp_path, monkeypatch, capsys, extra, message):
    other = tmp_path / "other.jsonl"
    TryLog(other, dict(SETTINGS, min_duration_s=120.0, run_args=[])).append(Try(4, "VALID"))  # the default
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    os.mkfifo(tmp_path / "fifo")
    extra = [{"OTHER": str(other), "FIFO": str(tmp_path / "fifo")}.get(x, x) for x in extra]
    with pytest.raises(SystemExit) as e:
        find_qps.main(["--scenario", "Server", "--output-dir", str(tmp_path / "o"), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("run_args", [
    [], ["--max-samples", "16", "--option=note=--output-dir"], ["--option", "tag=--scenario=Offline", "--quick"],
])
def test_run_flags_find_qps_does_not_set_are_not_taken_for_its_own(run_args):
    assert find_qps.own_run_flags_given(run_args) == []


def test_main_says_when_a_valid_try_lies_above_an_invalid_one(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    settings = {"scenario": "Server", "min_duration_s": 120.0, "min_query_count": 1000, "run_args": []}
    for t in (Try(8, "VALID"), Try(7, "INVALID")):
        TryLog(path, settings).append(t)
    assert find_qps.main(["--scenario", "Server", "--resume", str(path), "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: VALID at 8 above INVALID at 7 (noisy tries)" in out and "0 new" in out


def test_a_too_deeply_nested_line_in_a_try_log_is_a_value_error_not_a_recursion_error(tmp_path):
    path = tmp_path / "tries.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")  # a whole line (not a cut-off write)
    with pytest.raises(ValueError):
        TryLog(path, SETTINGS).read()


@pytest.mark.parametrize("tty", [True, False])
def test_one_process_tries_draw_the_run_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, synthetic_small, tty):
    """A try lasts minutes: on a terminal its progress bar shows it moving; redirected, no bar (a log file
    would hold its redraws). The fresh-process mode's runs never draw one (their stderr is captured)."""
    monkeypatch.setattr(find_qps.sys.stderr, "isatty", lambda: tty)
    a = SimpleNamespace(output_dir=str(tmp_path), scenario="Server", min_duration_s=5.0, min_query_count=100)
    run_args = ["--config", str(REPO / "loadgen_configs" / "cpu_tiny.toml"), "--dataset", str(synthetic_small[0])]
    one = find_qps.OneProcessTries(a, run_args)
    rs, _ = one.prepare()
    try:
        assert rs.progress is tty
        assert find_qps.FreshProcessTries(a, run_args).prepare()[0].progress is False
        assert find_qps.sut_run_settings("Server", tmp_path, [*run_args, "--no-progress"], 5, 100,
                                         progress=True)[0].progress is False  # the user's --no-progress wins
    finally:
        one.close()
    assert not any(tmp_path.iterdir()), "prepare() starts nothing and writes nothing"


def test_a_result_from_tries_too_short_to_judge_says_so_and_a_judged_one_does_not(tmp_path, capsys):
    """Two short-try results failed over 600 s on one H200 (2026-12-01/02): the search's last word says when its
    result rests on tries whose queue was not judged (``queue_growing`` null)."""
    settings = {"scenario": "Interactive", "min_duration_s": 20.0, "min_query_count": 1000, "run_args": []}
    for judged, said in ((None, True), (False, False)):
        path = tmp_path / f"t_{judged}.jsonl"
        for t in (Try(40, "VALID", queue_growing=judged), Try(41, "INVALID")):
            TryLog(path, settings).append(t)
        assert find_qps.main(["--scenario", "Interactive", "--resume", str(path), "--min-duration-s", "20",
                              "--output-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "highest VALID target_qps: 40 queries/s" in out
        assert ("note: no try at 40 was long enough to judge its queue" in out) is said, out
        assert ("--min-duration-s 120 or more" in out) is said


def _es_record(perf_met, more, done=320):
    text = f" * Run unsuccessful.  * Processed {done} queries.  * Would need to run at least {more} more queries,  with"
    return {"validity": "INVALID", "tokens_per_s": 100.0,
            "loadgen": {"result_perf_constraints_met": perf_met, "early_stopping_met": False,
                        "result_min_duration_met": True, "result_first_token_99.00_percentile_latency_ns": 8.7e8,
                        "early_stopping_ttft_result": text, "early_stopping_tpot_result": " * Run successful."}}


def test_an_invalid_try_says_why_and_too_few_queries_for_early_stopping_is_no_verdict():
    """A new user's find: --min-query-count 320 made a try INVALID on early stopping alone (p99s far under the
    limits) and the search took it as the upper bound, without a word of why."""
    from sut.findqps.attempt import try_from_record

    t = try_from_record(2.0, _es_record(True, 139), True, "f", 1.0)
    assert t.validity is None and t.ttft_p99_ms == 870.0  # bounds nothing: the search stops as after a failed try
    assert "INVALID only on LoadGen's early stopping, every p99 under its limit: 320 queries were too few (it " \
           "needs at least 139 more); search again with --min-query-count 600 or more and a new --log" in t.note
    few = try_from_record(2.0, _es_record(True, 267, done=192), True, "f", 1.0)  # a recheck's case: 459 in all
    assert few.validity is None and "--min-query-count 600 or more" in few.note
    near = try_from_record(2.0, _es_record(True, 5000), True, "f", 1.0)
    assert near.validity == "INVALID" and "it needs at least 5000 more queries: near the bound" in near.note
    over = try_from_record(2.0, _es_record(False, 139), True, "f", 1.0)
    assert over.validity == "INVALID" and over.note.startswith("INVALID: latency constraints, early stopping")


def test_a_search_stops_at_a_try_without_a_verdict_and_says_what_to_change(tmp_path, monkeypatch, caplog,
                                                                          synthetic_small):
    from sut.findqps.attempt import try_from_record

    monkeypatch.setattr(find_qps, "sut_try", lambda scenario, q, *a: try_from_record(q, _es_record(True, 139), True,
                                                                                    "f", 1.0))
    run_args = ["--config", str(REPO / "loadgen_configs" / "cpu_tiny.toml"), "--dataset", str(synthetic_small[0])]
    rc = find_qps.main(["--scenario", "Server", "--start", "4", "--output-dir", str(tmp_path), "--fresh-process",
                        "--min-query-count", "320", "--", *run_args])
    assert rc == 1 and "search again with --min-query-count 600 or more and a new --log" in caplog.text
    assert "go on with" not in caplog.text  # resuming this log would repeat the same try
    (t,) = [json.loads(x) for x in (tmp_path / "tries-Server.jsonl").read_text().splitlines()]
    assert t["validity"] is None and t["qps"] == 4  # recorded, bounding nothing
