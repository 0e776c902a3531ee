"""python -m sut find-qps as a new user meets it: each try logged as it starts and ends, a resume hint that is
the whole command, ``--help`` with every default, and the warning that LoadGen's equal issue makes every try
at least the dataset's sample count of queries. A fake ``sut_try`` stands in for ``python -m sut run``."""

import argparse
import logging
import re
import shlex

import pytest
from conftest import REPO

from sut.findqps import cli as find_qps
from sut.findqps.search import Try
from sut.settings.run import RunSettings


def _fake(monkeypatch, events: list, limit=13.0):
    """``find_qps.sut_try`` replaced: VALID at or below ``limit`` qps; each call appends ("run", qps) to
    ``events``; the qps asked are in ``run.calls``."""
    calls = []

    def run(scenario, q, *a):
        calls.append(q)
        events.append(("run", q))
        return Try(q, "VALID" if q <= limit else "INVALID", 400.0, 20.0, 5000.0 * q, f"run-{q:g}", "", 150.0)
    monkeypatch.setattr(find_qps, "sut_try", run)
    run.calls = calls
    return run


class _Events(logging.Handler):
    """Appends ("log", level, message) of the find_qps logger to a list, in order with the fake's calls."""

    def __init__(self, events):
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record):
        self.events.append(("log", record.levelname, record.getMessage()))


@pytest.fixture
def events():
    out: list = []
    handler = _Events(out)
    logger = logging.getLogger("find_qps")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(old)


def _run_args(data, *extra):
    return ["--config", str(REPO / "loadgen_configs" / "cpu_tiny.toml"), "--dataset", str(data), *extra]


def test_each_try_is_logged_when_it_starts_and_as_soon_as_it_ends(tmp_path, monkeypatch, synthetic_small, events):
    data, _ = synthetic_small
    _fake(monkeypatch, events)
    assert find_qps.main(["--scenario", "Server", "--start", "8", "--max-runs", "2", "--min-query-count", "64",
                          "--output-dir", str(tmp_path), "--fresh-process", "--", *_run_args(data)]) == 0
    seq = [e if e[0] == "run" else e[2] for e in events]
    assert seq[0].startswith("try 1: target_qps 8 queries/s (highest VALID none, lowest INVALID none")
    assert seq[1] == ("run", 8)
    assert seq[2] == "try 1: target_qps 8: VALID, TTFT p99 400.0 ms, TPOT p99 20.0 ms, 40,000.0 tokens/s, " \
                     "wall 150 s, run-8"  # logged before the next try starts
    assert seq[3].startswith("try 2: target_qps 16 queries/s (highest VALID 8, lowest INVALID none")
    assert seq[4:] == [("run", 16), "try 2: target_qps 16: INVALID, TTFT p99 400.0 ms, TPOT p99 20.0 ms, "
                                    "80,000.0 tokens/s, wall 150 s, run-16"]
    assert all(e[1] == "INFO" for e in events if e[0] == "log")


def test_the_resume_hint_is_the_whole_command_and_following_it_goes_on(tmp_path, monkeypatch, synthetic_small,
                                                                       capsys):
    data, _ = synthetic_small
    run = _fake(monkeypatch, [])
    out_dir = tmp_path / "my runs"
    args = ["--scenario", "Server", "--start", "4", "--max-runs", "3", "--min-duration-s", "12.345678",
            "--min-query-count", "700", "--rel-tol", "0.04", "--output-dir", str(out_dir), "--fresh-process",
            "--budget-s", "5000", "--", *_run_args(data, "--max-samples", "32")]
    assert find_qps.main(args) == 0
    out = capsys.readouterr().out
    hint = re.search(r"not converged \(highest VALID 8, lowest INVALID 16, --rel-tol 0.04\); go on with:\n  (.*)\n",
                     out)
    assert hint, out
    cmd = shlex.split(hint.group(1))
    assert cmd[:4] == ["python", "-m", "sut", "find-qps"] and "--start" not in cmd
    assert cmd[cmd.index("--resume") + 1] == str(out_dir / "tries-Server.jsonl")
    assert cmd[cmd.index("--") + 1:] == _run_args(data, "--max-samples", "32")
    assert find_qps.main(cmd[4:]) == 0  # the same settings: the recorded tries are accepted
    out = capsys.readouterr().out
    assert "3 earlier tries, 3 new" in out and "user.conf line: llama3_1-8b.Server.target_qps = 13\n" in out
    assert run.calls == [4, 8, 16, 12, 14, 13]  # went on from the recorded bounds (--max-runs 3 again)


def test_help_shows_every_default_and_no_issue_number(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    p = find_qps._parser()
    text = " ".join(p.format_help().split())
    assert "issue 14" not in text
    assert "--output-dir OUTPUT_DIR where the tries' run folders go (default: results/find_qps)" in text
    # --timeout-s is for --fresh-process only (the help did not say what one-process mode does)
    assert "--timeout-s TIMEOUT_S --fresh-process only: stop a try after this many seconds (SIGTERM; SIGKILL of " \
           "its process group 60 s later); one-process mode ignores it (there a try fails when no sample completes " \
           "for the run's stall timeout, RunSettings.stall_timeout_s) (default: 3600.0)" in text
    with_default = [a for a in p._actions if a.option_strings and a.default not in (None, argparse.SUPPRESS)
                    and a.nargs != 0]
    assert {a.dest for a in with_default} == {"factor", "rel_tol", "max_runs", "min_duration_s", "min_query_count",
                                              "timeout_s", "output_dir"}
    for a in with_default:
        assert f"(default: {a.default})" in text, a.dest
    assert "(default: None)" not in text and "(default: False)" not in text


def _rs(**kw):
    return RunSettings(sut="vllm", dataset="d.json", scenario="Server", **kw)


def test_equal_issue_warning_names_the_queries_per_try_and_the_fix():
    w = find_qps.equal_issue_warning(_rs(), 13368, 1000, 40)
    assert w.startswith("every try will issue at least 13,368 queries, not --min-query-count 1,000 (>= 334 s a try "
                        "at target_qps 40)")
    assert "sample_concatenate_permutation" in w and "pass --max-samples 1000 after --" in w
    assert "at least 13,368" in find_qps.equal_issue_warning(_rs(), 20000, 1000, 40)  # mlperf.conf's count at most
    assert find_qps.equal_issue_warning(_rs(), 1999, 1000, 40) is None  # < 2 x: rounding up costs little
    assert find_qps.equal_issue_warning(_rs(), 2000, 1000, None).startswith("every try will issue at least 2,000 "
                                                                            "queries, not --min-query-count 1,000:")
    assert find_qps.equal_issue_warning(_rs(quick=True), 13368, 1, 4) is not None  # 8 >= 2 x 1
    assert find_qps.equal_issue_warning(_rs(quick=True), 13368, 100, 4) is None  # --quick loads 8 samples


@pytest.mark.parametrize("extra,warned", [([], True), (["--max-samples", "16"], False)])
def test_search_warns_before_the_first_try_when_the_dataset_is_far_above_min_query_count(
        tmp_path, monkeypatch, synthetic_small, events, extra, warned):
    data, _ = synthetic_small  # 64 samples
    _fake(monkeypatch, events)
    assert find_qps.main(["--scenario", "Interactive", "--start", "4", "--max-runs", "1", "--min-query-count", "16",
                          "--output-dir", str(tmp_path), "--fresh-process", "--", *_run_args(data, *extra)]) == 0
    warnings = [i for i, e in enumerate(events) if e[0] == "log" and e[1] == "WARNING"]
    if warned:
        assert len(warnings) == 1 and warnings[0] < events.index(("run", 4))
        assert events[warnings[0]][2].startswith("every try will issue at least 64 queries, not --min-query-count "
                                                 "16 (>= 16 s a try at target_qps 4)")
    else:
        assert warnings == []


def test_a_dataset_that_cannot_be_read_exits_2_before_any_try(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(find_qps, "sut_try", lambda *a: pytest.fail("a try started"))
    rc = find_qps.main(["--scenario", "Server", "--start", "4", "--output-dir", str(tmp_path / "o"), "--fresh-process",
                        "--", *_run_args(tmp_path / "none.json")])
    assert rc == 2 and "none.json" in capsys.readouterr().err and not (tmp_path / "o").exists()
