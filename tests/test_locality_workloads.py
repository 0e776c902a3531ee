"""The workloads beyond the study (``sut/locality/workloads``), without engines: each preset through ``describe`` and
through the whole pair protocol over the fake transport of ``tests/transport_doubles.py`` (calibration, load
levels and goodput; per-request answer lengths; Zipf popularity, per-replica load and the router's release;
working set sized from the KV cache the replicas report; a replica killed mid-trace, every request accounted
for), the report's new fields, merging such runs, and bad workload input that exits 2 before anything starts.
The same presets on real CPU engines: ``tests/test_locality_workloads_cpu.py`` (slow)."""

import dataclasses
import json
import logging
import math
import re
import threading
import time

import numpy as np
import pytest
import transport_doubles  # noqa: F401 - registers the "fake" transport
from conftest import TINY_MODEL
from transport_doubles import FakeTransport

from sut.core.transport import register_transport
from sut.locality.__main__ import main
from sut.locality.systems import SYSTEMS, SystemSpec
from sut.locality.trace import TraceSettings, make_trace, trace_hash
from sut.locality.workloads import WORKLOAD_PRESETS, WorkloadSettings

PRESETS = ("arrivals", "variable-answers", "hot-prefixes", "eviction", "replica-loss")
SHAPE = ["--text", "random", "--documents", "6", "--doc-tokens", "100"]
SMALL = [*SHAPE, "--max-tokens", "4"]


@register_transport("fake-fixed-length")
class FixedLengthTransport(FakeTransport):
    """A transport that cannot ask a request its own length (``vllm serve`` over HTTP here)."""

    per_request_max_tokens = False


@register_transport("fake-ignores-length")
class IgnoresLengthTransport(FakeTransport):
    """Claims per-request lengths but answers every request ``out_len`` ids."""

    def submit(self, replica, requests):
        super().submit(replica, [r._replace(max_tokens=0) for r in requests])


def fake(transport="fake", **opts):
    return SystemSpec(transport, dict({"out_len": 4, "prefix_caching_on": True, "kv_tokens": 400}, **opts),
                      replicas_field="replicas")


@pytest.fixture
def systems(monkeypatch):
    """'standalone' as the fake transport; 'flame' as one that stops serving everything when a replica is killed."""
    log = []
    monkeypatch.setitem(SYSTEMS, "standalone", fake(log=log))
    monkeypatch.setitem(SYSTEMS, "flame", fake(log=log, step_s=0.002, halt_on_kill=True))
    return log


def run(tmp_path, *args, name="w"):
    """``python -m sut.locality run`` in-process on the fake systems; returns (exit code, locality.json or None)."""
    rc = main(["run", "--model", str(TINY_MODEL), "--device", "cpu", "--engines-per-device", "2", *SMALL,
               "--output-dir", str(tmp_path / "out"), "--no-progress", "--block-tokens", "16", "--systems",
               "standalone", "flame", "--pairs", "1", "--warmups", "1", "--run-name", name, *args])
    rec = tmp_path / "out" / f"{name}-SYNTHETIC-LOCALITY-NOT-MLPERF" / "locality.json"
    return rc, (json.loads(rec.read_text()) if rec.is_file() else None)


def cases_of(rec, system=None):
    return [c for c in rec["cases"] if system is None or c["system"] == system]


# ------------------------------------------------------------------------------------------- describe
@pytest.mark.parametrize("preset, row, field", [
    ("arrivals", "load levels", "arrivals"), ("variable-answers", "answer tokens", "answers"),
    ("hot-prefixes", "Zipf popularity", "popularity"), ("eviction", "working set", "eviction"),
    ("replica-loss", "replica loss", "replica_loss")])
def test_every_preset_is_described_with_its_workload(preset, row, field, capsys):
    assert main(["describe", "--trace-preset", preset, *SHAPE]) == 0
    table = capsys.readouterr().out
    assert f"preset {preset}" in table and row in table
    assert main(["describe", "--trace-preset", preset, *SHAPE, "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)
    assert shape["preset"] == preset and field in shape["workload"]
    assert set(WORKLOAD_PRESETS) == set(PRESETS)
    with pytest.raises(SystemExit):  # `run --help` names every preset
        main(["run", "--help"])
    text = re.sub(r"-\s+", "-", capsys.readouterr().out)  # argparse wraps lines after a hyphen
    assert all(p in text for p in PRESETS)


def test_describe_refuses_a_flag_its_workload_would_ignore(capsys):
    assert main(["describe", *SHAPE, "--kv-tokens", "200"]) == 2
    assert "--kv-tokens applies to eviction only" in capsys.readouterr().err


def test_describe_states_levels_targets_zipf_sizing_and_the_kill(capsys):
    main(["describe", "--trace-preset", "arrivals", *SHAPE, "--json"])
    a = json.loads(capsys.readouterr().out)["workload"]["arrivals"]
    assert a["load_levels"] == [0.5, 0.8, 0.95] and a["goodput_targets"] == {"ttft_s": 5.0, "tpot_s": 0.1}
    main(["describe", "--trace-preset", "hot-prefixes", *SHAPE, "--json"])
    shape = json.loads(capsys.readouterr().out)
    hot = shape["workload"]["popularity"]
    assert hot["zipf_s"] == 1.1 and hot["hottest"][0]["share"] == shape["hot_document_share"] > 1 / 6
    main(["describe", "--trace-preset", "eviction", *SHAPE, "--kv-tokens", "200", "--json"])
    ev = json.loads(capsys.readouterr().out)
    assert ev["documents"] == math.ceil(3 * 200 / 101) and ev["workload"]["eviction"]["ratio"] == pytest.approx(
        ev["document_tokens"] / 200)
    main(["describe", "--trace-preset", "replica-loss", *SHAPE, "--json"])
    assert json.loads(capsys.readouterr().out)["workload"]["replica_loss"]["kill_when"] == "time"
    main(["describe", "--trace-preset", "replica-loss", *SHAPE])
    assert "killed 50% of the last warm-up's wall time into the burst" in capsys.readouterr().out
    main(["describe", "--trace-preset", "variable-answers", *SHAPE])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "output tokens per request" in ln)
    assert "the longest answer; each request asks its own (log_uniform" in row and "(exactly:" not in row
    main(["describe", *SHAPE])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "output tokens per request" in ln)
    assert "(exactly: EOS is ignored" in row


# ------------------------------------------------------------------------------------------- arrivals
def test_arrivals_measure_capacity_then_run_each_level_on_its_own_copy(systems, tmp_path, capsys):
    rc, rec = run(tmp_path, "--trace-preset", "arrivals", "--policies", "prefix_affinity", "round_robin")
    assert rc == 0 and rec["report_metric"] == "goodput_per_s"
    w = rec["workload"]
    cal = w["calibration"]
    assert (cal["system"], cal["policy"]) == ("standalone", "round_robin") and cal["case"]["timed"]["requests"] == 24
    cap = w["capacity"]["requests_per_s"]
    assert cap == cal["requests_per_s"] > 0 and w["capacity"]["source"].startswith("measured")
    assert [lv["rate"] for lv in w["levels"]] == [round(x * cap, 4) for x in (0.5, 0.8, 0.95)]
    copies = [c["shift"] for c in rec["level_copies"]]  # levels 1, 2: their own shifted copies of the trace
    assert [lv["shift"] for lv in w["levels"]] == [None, *copies] and not set(copies) & {
        x["shift"] for x in rec["warmups"]}
    assert len({c["trace_hash"] for c in rec["level_copies"]} | {rec["trace_hash"]}) == 3
    for c in cases_of(rec):
        levels = c["levels"]
        assert [lv["level"] for lv in levels] == [0.5, 0.8, 0.95] and c["timed"] == levels[-1]["timed"]
        for lv in levels:
            t = lv["timed"]
            assert t["goodput_targets"]["ttft_s"] == 5.0 and t["goodput_targets"]["ttft_from"].startswith("client")
            assert t["good_requests"] == 24 and t["goodput_share"] == 1.0  # the fake answers in milliseconds
            assert t["goodput_per_s"] == pytest.approx(t["requests_per_s"], rel=1e-3)  # all 24 good
            assert set(t["client_ttft_s"]) == {"p50", "p90", "p99"} and t["tpot_s"]["p99"] is not None
    ratios = rec["report"]["pair_ratios"]
    assert rec["report"]["metric"] == "goodput_per_s" and set(ratios) == {
        f"{p}@{x}%" for p in ("prefix_affinity", "round_robin") for x in (50, 80, 95)}
    assert "standalone@95%" in rec["report"]["policy_ratios"]
    out = capsys.readouterr().out
    assert "arrivals: capacity" in out and "TTFT p99" in out and "calibration: standalone, round_robin" in out
    assert (tmp_path / "out" / "w-SYNTHETIC-LOCALITY-NOT-MLPERF" / "calibration-standalone-round_robin").is_dir()


def test_the_capacity_calibration_is_the_first_case_that_sizes_the_kv_cache(monkeypatch, tmp_path):
    """--kv-sizing first-case: the calibration case is the run's first case with fresh engines; every case of the
    pairs gets its KV cache (before, its pin was set on a copy of the context and lost: the first case of the
    pairs profiled again, and the calibration's capacity was measured on another cache than the pairs')."""
    seen = []
    for name in ("standalone", "flame"):
        monkeypatch.setitem(SYSTEMS, name, fake(kv_tokens=1600, kv_bytes_per_block=4096, engines=seen))
    rc, rec = run(tmp_path, "--trace-preset", "arrivals", "--policies", "round_robin", "--load-levels", "0.5")
    assert rc == 0
    cal = rec["workload"]["calibration"]["case"]
    pin = {"blocks": 100, "bytes_per_block": 4096, "bytes": 409600, "case": "calibration-standalone-round_robin"}
    assert cal["kv_pinned"] is None and [c["kv_pinned"] for c in cases_of(rec)] == [pin, pin]
    assert [e.kv_cache_memory_bytes for e in seen] == [None, 409600, 409600]


def test_arrivals_goodput_counts_only_requests_within_both_targets(systems, tmp_path):
    rc, rec = run(tmp_path, "--trace-preset", "arrivals", "--policies", "round_robin", "--capacity", "500",
                  "--load-levels", "0.5", "--ttft-target-s", "1e-9")
    assert rc == 0 and rec["workload"]["capacity"] == {"requests_per_s": 500.0, "source": "--capacity"}
    assert "calibration" not in rec["workload"]
    for c in cases_of(rec):
        t = c["levels"][0]["timed"]
        assert c["levels"][0]["rate"] == 250.0 and t["good_requests"] == 0 and t["goodput_per_s"] == 0
    assert rec["report"]["pair_ratios"]["round_robin@50%"]["per_pair"] == []  # no ratio of two zeros


# ------------------------------------------------------------------------------------ variable answers
def test_variable_answers_ask_and_check_each_requests_own_length(systems, tmp_path, capsys):
    rc, rec = run(tmp_path, "--trace-preset", "variable-answers", "--max-tokens", "40", "--min-answer-tokens", "2")
    assert rc == 0
    asked = make_trace(TraceSettings(**{k: v for k, v in rec["trace_settings"].items()}))
    lengths = [r.max_tokens for r in asked]
    assert min(lengths) >= 2 and max(lengths) <= 40 and len(set(lengths)) > 5
    assert rec["trace"]["answer_tokens"]["total"] == sum(lengths)
    for c in cases_of(rec):
        assert c["timed"]["output_tokens"] == sum(lengths) and c["validation"]["requests_checked"] == 24
        assert c["timed"]["tpot_s"] is not None
    out = capsys.readouterr().out
    assert "variable answers: " in out and "req p50   req p99" in out  # each case's request latency, client side
    c = cases_of(rec)[0]
    assert f"{c['timed']['latency_s']['p50']:.4f}" in out, out
    from matplotlib.image import imread  # the figure's second row: the workload's panel (tests/test_locality_figure.py)
    png = tmp_path / "out" / "w-SYNTHETIC-LOCALITY-NOT-MLPERF" / rec["figure"]
    assert imread(png).shape[0] > imread(png).shape[1] / 2  # one row: 506 x 1650 px, two: 1012 x 1650



def test_a_workload_panel_that_fails_never_fails_the_run(systems, tmp_path, monkeypatch):
    """The figure is drawn from the in-memory record before locality.json is written: a panel's error leaves a
    note in the figure, and the run that measured fine keeps its exit code and its record."""
    def broken(ax, record, g):
        raise TypeError("a field the panel did not expect")

    monkeypatch.setattr("sut.locality.workloads.figure._answers", broken)
    rc, rec = run(tmp_path, "--trace-preset", "variable-answers", "--policies", "round_robin", "--max-tokens", "40")
    assert rc == 0 and rec["status"] == "ok" and rec["figure"] == "locality.png"
    assert (tmp_path / "out" / "w-SYNTHETIC-LOCALITY-NOT-MLPERF" / "locality.png").is_file()


def test_a_figure_that_cannot_be_drawn_at_all_leaves_the_run_and_its_record(systems, tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise ValueError("no canvas")

    monkeypatch.setattr("sut.locality.runner.plot_pair_report", broken)
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "12", "--policies", "round_robin")
    assert rc == 0 and rec["status"] == "ok" and rec["figure"] is None and rec["report"]
    assert any("locality.png not drawn (ValueError: no canvas)" in n for n in rec["notes"])
    assert not (tmp_path / "out" / "w-SYNTHETIC-LOCALITY-NOT-MLPERF" / "locality.png").exists()
    assert "note: locality.png not drawn" in capsys.readouterr().out

def test_a_transport_without_per_request_lengths_is_refused_and_one_that_ignores_them_fails(monkeypatch, tmp_path,
                                                                                          capsys):
    monkeypatch.setitem(SYSTEMS, "standalone", fake("fake-fixed-length"))
    monkeypatch.setitem(SYSTEMS, "flame", fake())
    rc, _ = run(tmp_path, "--trace-preset", "variable-answers", "--max-tokens", "40")
    assert rc == 2 and "system standalone's transport (fake-fixed-length) cannot ask each request" in \
        capsys.readouterr().err and not (tmp_path / "out").exists()
    monkeypatch.setitem(SYSTEMS, "standalone", fake("fake-ignores-length"))
    rc, rec = run(tmp_path, "--trace-preset", "variable-answers", "--max-tokens", "40", "--systems", "standalone")
    assert rc == 1 and "generated ids, the generation settings ask for exactly" in rec["error"]


def test_answer_lengths_keep_the_prompts_and_fixed_traces_hash_as_before():
    fixed = make_trace(TraceSettings(documents=5, doc_tokens=50, questions=3, max_tokens=512, seed=4))
    varied = make_trace(TraceSettings(documents=5, doc_tokens=50, questions=3, max_tokens=512, seed=4,
                                      answers="log_uniform", min_answer_tokens=16))
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(fixed, varied))
    assert all(r.max_tokens == 0 for r in fixed) and all(16 <= r.max_tokens <= 512 for r in varied)
    assert trace_hash(fixed) != trace_hash(varied)
    import hashlib
    import struct

    from sut.locality.trace import input_hash
    h = hashlib.sha256()
    for r in fixed:  # the study's hash: no length in it
        h.update(struct.pack("<4q", r.rid, r.document, r.question, r.prefix_tokens))
        h.update(bytes.fromhex(input_hash(r.prompt)))
    assert trace_hash(fixed) == h.hexdigest()
    many = make_trace(TraceSettings(documents=50, doc_tokens=10, questions=40, max_tokens=512, answers="log_uniform"))
    lengths = np.array([r.max_tokens for r in many])
    assert 80 < np.median(lengths) < 100  # log-uniform on [16, 512]: median sqrt(16 x 512) = 90.5
    assert np.mean(lengths < 32) == pytest.approx(0.2, abs=0.04)  # each doubling draws 1/5 of the requests


# -------------------------------------------------------------------------------------- hot prefixes
def test_hot_prefixes_record_zipf_per_replica_load_and_the_release(systems, tmp_path, capsys):
    rc, rec = run(tmp_path, "--trace-preset", "hot-prefixes", "--release-tokens", "20", "--systems", "standalone",
                  "--documents", "8")
    assert rc == 0 and rec["trace_settings"]["zipf_s"] == 1.1 and rec["router_settings"]["release_gate"] == "excess"
    hot = rec["trace"]["popularity"]["hottest"]
    assert hot[0]["share"] > hot[-1]["share"] and hot[0]["share"] == rec["trace"]["hot_document_share"]
    by = {c["policy"]: c for c in cases_of(rec)}
    assert set(by) == {"prefix_affinity", "prefix_affinity_never", "round_robin"}
    assert by["prefix_affinity"]["routing"]["releases"] > 0 == by["prefix_affinity_never"]["routing"]["releases"]
    for c in by.values():
        per, bal = c["timed"]["per_replica"], c["timed"]["balance"]
        assert sum(p["requests"] for p in per) == 32 and all(p["done_s"] > 0 for p in per)
        assert all(p["uncached_tokens"] == p["prompt_tokens"] - p["cached_tokens"] for p in per)
        assert bal["requests_max_over_min"] == pytest.approx(max(p["requests"] for p in per) /
                                                              min(p["requests"] for p in per), abs=1e-4)
    out = capsys.readouterr().out
    assert "hot prefixes: Zipf s = 1.1" in out and "max/min req" in out


# ------------------------------------------------------------------------------------------- eviction
def test_eviction_logs_its_sized_trace_and_notes_that_documents_went_unused(systems, tmp_path, caplog):
    """The trace the cases run is logged before them; --documents, which eviction's sizing replaces, is noted as
    not used (not as a changed preset value)."""
    caplog.set_level(logging.INFO, logger="sut.locality")
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "25", "--documents", "3")
    assert rc == 0 and rec["trace"]["documents"] == math.ceil(3 * 400 / 101) == 12
    assert "--documents 3 given, not used: eviction sizes the documents from the KV cache (--working-set)" in rec["notes"]
    assert not any("documents 3 given instead" in n for n in rec["notes"])
    rc, rec = run(tmp_path, "--working-set", "3", "--kv-blocks", "25", "--documents", "3", name="nopreset")
    assert rc == 0 and rec["trace"]["documents"] == 12 and rec["notes"] == [
        "--documents 3 given, not used: eviction sizes the documents from the KV cache (--working-set)"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "eviction: one replica's KV cache 400 tokens (the smallest KV cache system standalone's replicas " \
           "reported at start) -> 12 documents x 2 questions = 24 requests" in logged


def test_a_run_folder_without_run_name_names_its_preset_and_systems(systems, tmp_path):
    rc = main(["run", "--model", str(TINY_MODEL), "--device", "cpu", "--engines-per-device", "2", *SMALL,
               "--output-dir", str(tmp_path / "out"), "--no-progress", "--systems", "standalone", "--pairs", "1",
               "--warmups", "0", "--trace-preset", "hot-prefixes", "--policies", "round_robin"])
    (d,) = (tmp_path / "out").iterdir()
    assert rc == 0 and re.fullmatch(r"\d{8}-\d{6}-hot-prefixes-standalone-SYNTHETIC-LOCALITY-NOT-MLPERF", d.name)


def test_the_kv_probe_gives_every_case_its_kv_cache(monkeypatch, tmp_path):
    """The probe is the run's first start: every case (the first one too) gets its cache, so the trace is sized
    for the cache every case has; --kv-sizing each-case leaves every case to size its own."""
    seen = []
    for name in ("standalone", "flame"):
        monkeypatch.setitem(SYSTEMS, name, fake(kv_tokens=1600, kv_bytes_per_block=4096, engines=seen))
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "100")  # CPU engines need a block count
    assert rc == 0 and rec["workload"]["working_set"]["replica_kv_tokens"] == 1600
    assert seen[0].kv_cache_memory_bytes is None and len(seen) == 1 + len(cases_of(rec))
    assert {(e.num_gpu_blocks_override, e.kv_cache_memory_bytes) for e in seen[1:]} == {(100, 409600)}
    assert {c["kv_pinned"]["case"] for c in cases_of(rec)} == {"kv-probe"}
    seen.clear()
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "100", "--kv-sizing", "each-case", name="each")
    assert rc == 0 and {e.kv_cache_memory_bytes for e in seen} == {None}


def test_eviction_sizes_the_working_set_from_the_reported_kv_cache(systems, tmp_path, capsys):
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "25")
    assert rc == 0 and rec["engine_settings"]["num_gpu_blocks_override"] == 25
    ws = rec["workload"]["working_set"]
    assert ws["replica_kv_tokens"] == 400 and "reported" in ws["kv_tokens_from"] and ws["probe"]["cleanup"]["stopped"]
    assert ws["documents"] == rec["trace"]["documents"] == math.ceil(3 * 400 / 101)
    assert ws["ratio"] == pytest.approx(rec["trace"]["document_tokens"] / 400, abs=1e-4) and 2.5 < ws["ratio"] < 3.5
    assert (tmp_path / "out" / "w-SYNTHETIC-LOCALITY-NOT-MLPERF" / "kv-probe").is_dir()
    for c in cases_of(rec):
        assert c["working_set"]["replica_kv_tokens"] == [400, 400] and "note" not in c["working_set"]
        assert c["timed"]["router_cached_share"] is not None and c["timed"]["cached_share"] is not None
    assert "eviction: 12 documents" in capsys.readouterr().out
    assert all(c["kv_pinned"] is None for c in cases_of(rec))  # these fakes report no bytes per block
    rc, rec = run(tmp_path, "--trace-preset", "eviction", "--kv-blocks", "25", "--kv-tokens", "200", name="given")
    assert rc == 0 and rec["workload"]["working_set"]["kv_tokens_from"] == "--kv-tokens"
    assert rec["trace"]["documents"] == 6 and "probe" not in rec["workload"]["working_set"]
    assert "note" in cases_of(rec)[0]["working_set"]  # the replicas report 400, the trace was sized for 200


# --------------------------------------------------------------------------------------- replica loss
def test_replica_loss_reroutes_or_fails_every_request_of_the_lost_replica(systems, tmp_path, capsys):
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--documents", "10", "--loss-timeout-s", "0.5",
                  "--kill-when", "answers")
    assert rc == 0 and ("kill", 0) in systems
    for c in cases_of(rec):
        f, t = c["failover"], c["timed"]
        assert f["answered"] + f["rerouted"] + f["failed"] == f["requests"] == t["requests"] == 40
        assert t["answered"] == f["answered"] + f["rerouted"] and t["failed"] == f["failed"]
        k = f["killed"]
        assert k["trigger"] == {"when": "answers", "after": 0.5} and k["fired"] and f["loss_seen"]
        assert k["replica"] == 0 and k["replica_answered"] == math.ceil(k["replica_routed"] / 2) > 1
        assert k["burst_answered"] >= k["replica_answered"] and "killed" in f["detected_how"]
        assert len(f["requests_failed"]) == f["failed"] and all(f["requests_failed"].values())
        assert t["requests_per_s"] == pytest.approx(t["answered"] / t["wall_s"], rel=1e-2)  # wall_s rounded
        assert sum(p["requests"] for p in t["per_replica"]) == t["answered"]
        routed = c["routing"]["routed_prompt_tokens"]  # every route decision, re-routes included
        assert routed >= t["prompt_tokens"] and 0 <= t["router_cached_share"] == pytest.approx(
            1 - c["routing"]["estimated_uncached_tokens"] / routed, abs=1e-4)
        if c["system"] == "standalone":  # the other replica serves on: re-routed, nothing failed
            assert f["rerouted"] > 0 and f["failed"] == 0 and f["recovery_s"] <= f["drained_s"]
            assert len(f["requests_rerouted"]) == f["rerouted"]
        else:  # a transport that halts on any loss: its re-routes are refused, what replica 1 held times out
            assert f["failed"] > 0 and f["recovery_s"] is None
            assert [x["kind"] for x in f["losses"]] == ["fatal event", "submit refused"]
            why = set(f["requests_failed"].values())
            assert any(w.startswith("replica 1 refused it (submit to replica 1 failed") for w in why), why
            assert any(w.startswith("no answer within 0.5 s after replica 0 was killed") for w in why), why
    assert rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 1
    assert "how detected" in capsys.readouterr().out


def test_a_kill_nobody_reports_ends_by_the_loss_timeout(monkeypatch, tmp_path):
    monkeypatch.setitem(SYSTEMS, "standalone", fake(silent_kill=True))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--loss-timeout-s", "0.3", "--kill-when", "answers")
    f = cases_of(rec)[0]["failover"]
    assert rc == 0 and f["detected_after_s"] is None and f["failed"] > 0 and f["answered"] + f["failed"] == 40
    assert all("no answer within 0.3 s after replica 0 was killed" in why for why in f["requests_failed"].values())


def test_a_replica_lost_before_the_kill_fails_the_run(monkeypatch, tmp_path):
    monkeypatch.setitem(SYSTEMS, "standalone", fake(die_after={1: 2}))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--kill-after", "0.9", "--warmups", "0", "--kill-when", "answers")
    assert rc == 1 and "replica 1 failed before the planned kill: fake replica 1 died" in rec["error"]


def test_the_kill_fires_mid_work_at_a_share_of_the_warm_up_time(monkeypatch, tmp_path):
    """The default trigger: --kill-after x the last warm-up's wall time into the timed burst, while the replica
    still holds work (a system that returns a batch's answers together is still killed mid-work)."""
    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.01))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--loss-timeout-s", "0.5")
    assert rc == 0
    c = cases_of(rec)[0]
    f, k = c["failover"], c["failover"]["killed"]
    planned = 0.5 * c["warmups"][-1]["wall_s"]
    assert k["trigger"] == {"when": "time", "at_s": pytest.approx(planned, abs=1e-3), "after": 0.5} and k["fired"]
    assert k["fired_by"] == "time"
    assert planned - 0.01 <= k["at_s"] <= planned + 0.5 and k["replica_outstanding"] > 0
    assert f["loss_seen"] and f["rerouted"] > 0 and f["answered"] + f["rerouted"] + f["failed"] == 40


def test_a_kill_that_lands_after_the_work_is_reported_as_measuring_no_loss(monkeypatch, tmp_path, capsys):
    """--kill-when answers on a system that answers a replica's share in one piece: the kill fires once half
    is back, when nothing is left to lose; the report says so instead of passing it off as a recovery."""
    monkeypatch.setitem(SYSTEMS, "standalone", fake())
    monkeypatch.setattr("sut.locality.failover.kill_replica", lambda transport, replica: "nothing (test)")
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--kill-when", "answers")
    f = cases_of(rec)[0]["failover"]
    assert rc == 0 and f["killed"]["fired"] and not f["loss_seen"] and f["answered"] == 40
    assert "note: 1 case(s) killed the replica after it had done its work" in capsys.readouterr().out


def test_workload_runs_merge_with_their_metric_and_measured_values(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(SYSTEMS, "standalone", fake())  # no log in the options: the runs' settings are equal
    monkeypatch.setitem(SYSTEMS, "flame", fake(step_s=0.002, halt_on_kill=True))
    for name in "ab":  # the answers trigger: these instant fakes may finish a burst before a time trigger fires
        assert run(tmp_path, "--trace-preset", "replica-loss", "--documents", "10", "--loss-timeout-s", "0.3",
                   "--kill-when", "answers", name=name)[0] == 0
    out = tmp_path / "out"
    runs = [str(out / f"{n}-SYNTHETIC-LOCALITY-NOT-MLPERF") for n in "ab"]
    assert main(["report", *runs, "--output-dir", str(out), "--run-name", "m"]) == 0
    merged = json.loads((out / "m-SYNTHETIC-LOCALITY-NOT-MLPERF" / "locality.json").read_text())
    assert merged["report"]["pair_ratios"]["prefix_affinity"]["n"] == 2 and "rerouted" in capsys.readouterr().out
    rc, _ = run(tmp_path, "--trace-preset", "arrivals", "--policies", "round_robin", "--capacity", "400",
                "--load-levels", "0.5", name="c")
    rc2, _ = run(tmp_path, "--trace-preset", "arrivals", "--policies", "round_robin", "--capacity", "300",
                 "--load-levels", "0.5", name="d")
    assert rc == rc2 == 0
    runs = [str(out / f"{n}-SYNTHETIC-LOCALITY-NOT-MLPERF") for n in "cd"]
    assert main(["report", *runs, "--output-dir", str(out), "--run-name", "n"]) == 2
    assert "workload.capacity.requests_per_s differs" in capsys.readouterr().err


@pytest.fixture(scope="module")
def workload_runs(tmp_path_factory):
    """Two finished runs each of replica-loss (``a``, ``b``) and arrivals (``c``, ``d``) on the fake transport."""
    tmp = tmp_path_factory.mktemp("workload_runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SYSTEMS, "standalone", fake())
        for name, args in (("a", ["--trace-preset", "replica-loss", "--kill-when", "answers"]),
                           ("b", ["--trace-preset", "replica-loss", "--kill-when", "answers"]),
                           ("c", ["--trace-preset", "arrivals", "--capacity", "400"]),
                           ("d", ["--trace-preset", "arrivals", "--capacity", "400"])):
            assert run(tmp, "--systems", "standalone", "--policies", "round_robin", *args, name=name)[0] == 0
    return tmp / "out"


def _edit_first_case(src, dst, edit):
    """A copy of run folder ``src`` at ``dst`` whose first case went through ``edit`` (a dict -> None)."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "cases.jsonl"
    lines = path.read_text().splitlines()
    case = json.loads(lines[0])
    edit(case)
    path.write_text("\n".join([json.dumps(case), *lines[1:]]) + "\n")


@pytest.mark.parametrize("runs, edit, said", [
    ("ab", lambda c: c["failover"].update(killed=None), "lacks ['failover.killed']"),
    ("ab", lambda c: c["failover"].update(recovery_s="soon"), "field failover.recovery_s is 'soon', not null or"),
    ("ab", lambda c: c["failover"].update(answered=None), "lacks ['failover.answered']"),
    ("ab", lambda c: c["failover"].update(requests_failed={"1": 5}), "field failover.requests_failed is {'1': 5}"),
    ("ab", lambda c: c["failover"].update(failed=3), "field failover counts"),
    ("ab", lambda c: c.pop("failover"), "no failover record, but the run killed a replica"),
    ("cd", lambda c: c["levels"][0].update(level="half"), "field levels.0.level is 'half', not a fraction"),
    ("cd", lambda c: c["levels"][1]["timed"].update(tpot_s={"p50": "x"}), "field levels.1.timed.tpot_s is"),
    ("cd", lambda c: c.update(levels=c["levels"][:1]), "levels [0.5] are not the run's load levels [0.5, 0.8, 0.95]"),
    ("cd", lambda c: c.update(levels=c["levels"][::-1]), "not distinct ones in increasing order"),
    ("cd", lambda c: c.pop("levels"), "levels [] are not the run's load levels"),
])
def test_a_hand_edited_workload_case_exits_2_naming_the_field_without_a_folder(workload_runs, tmp_path, capsys, runs,
                                                                               edit, said):
    """A replica-loss case's failover and an arrivals case's levels are checked like the rest of a case: before,
    such a case crashed the report's console table after the merged folder was written, or merged silently."""
    first, second = (workload_runs / f"{n}-SYNTHETIC-LOCALITY-NOT-MLPERF" for n in runs)
    _edit_first_case(second, tmp_path / "edited", edit)
    out = tmp_path / "merged"
    assert main(["report", str(first), str(tmp_path / "edited"), "--output-dir", str(out)]) == 2
    assert said in capsys.readouterr().err and not out.exists()
    assert main(["report", str(first), str(second), "--output-dir", str(out)]) == 0  # the runs as written merge


@pytest.mark.parametrize("args, message", [
    (["--trace-preset", "arrivals", "--load-levels", "0"], "load_levels must be distinct fractions in (0, 2]"),
    (["--trace-preset", "arrivals", "--load-levels", "0.5", "0.5"], "load_levels must be distinct"),
    (["--trace-preset", "arrivals", "--capacity-policy", "nope"], "--capacity-policy 'nope': unknown policy"),
    (["--trace-preset", "arrivals", "--rate", "3"], "--rate 3 and --load-levels: the levels set the arrival rates"),
    (["--trace-preset", "arrivals", "--capacity", "1e-9"], "capacity 1e-09 requests/s x load level 0.5 is below "
                                                           "0.0001 requests/s"),
    (["--trace-preset", "replica-loss", "--kill-after", "1.5"], "kill_after must be 0 (off) or in (0, 1)"),
    (["--trace-preset", "replica-loss", "--kill-replica", "2"], "--kill-replica 2: the systems have replicas 0..1"),
    (["--trace-preset", "replica-loss", "--warmups", "0"], "--kill-when time fires the kill at --kill-after x the last"),
    (["--trace-preset", "replica-loss", "--engines-per-device", "1"], "replica-loss needs at least 2 replicas"),
    (["--trace-preset", "eviction", "--working-set", "0.5"], "working_set must be 0 (off) or >= 1"),
    (["--trace-preset", "eviction"], "eviction on CPU engines needs --kv-blocks N"),
    (["--trace-preset", "eviction", "--kv-tokens", "1536"], "one sized by --kv-tokens evicts nothing"),
    (["--policies", "prefix_affinity_sometimes"], "unknown policy"),
    (["--answers", "log_uniform", "--min-answer-tokens", "0"], "min_answer_tokens must be in [1, max_tokens=4]"),
    (["--ttft-target-s", "0"], "ttft_target_s must be a finite number > 0"),
    (["--kv-tokens", "500"], "--kv-tokens applies to eviction only, which --working-set switches on (here off)"),
    (["--trace-preset", "arrivals", "--kv-tokens", "500"], "--kv-tokens applies to eviction only"),
    (["--capacity", "5"], "--capacity applies to arrivals only, which --load-levels switches on"),
    (["--trace-preset", "hot-prefixes", "--ttft-target-s", "1"], "--ttft-target-s applies to arrivals only"),
    (["--kill-when", "answers"], "--kill-when applies to replica-loss only, which --kill-after switches on"),
    (["--trace-preset", "replica-loss", "--kill-after", "0", "--retries", "2"], "--retries applies to replica-loss"),
    (["--min-answer-tokens", "2"], "--min-answer-tokens applies to --answers log_uniform only"),
])
def test_bad_workload_input_exits_2_before_anything_starts(systems, tmp_path, capsys, args, message):
    rc, _ = run(tmp_path, *args)
    assert rc == 2 and message in capsys.readouterr().err
    assert systems == [] and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ units
def test_load_levels_given_in_any_order_are_recorded_in_the_order_they_run():
    """Runs of ``--load-levels 0.8 0.5`` and ``0.5 0.8`` are the same experiment: their headers must merge."""
    assert WorkloadSettings(load_levels=(0.8, 0.5)) == WorkloadSettings(load_levels=(0.5, 0.8))
    assert WorkloadSettings(load_levels=[0.95, 0.5]).load_levels == (0.5, 0.95)


def test_a_measured_capacity_too_small_for_a_rate_is_refused_not_sent_as_a_burst():
    """A level whose rate rounds to 0 would be sent all at once (rate 0 = one burst) while recorded as a level."""
    from sut.locality.runner import prepare_trace
    from sut.locality.workloads.arrivals import make_levels

    prepared = prepare_trace(TraceSettings(documents=2, doc_tokens=20, questions=1), 0, extra=1)
    assert [lv.rate for lv in make_levels(prepared, (0.5, 1.0), 0.0002)] == [0.0001, 0.0002]
    with pytest.raises(ValueError, match="x load level 0.5 is below 0.0001 requests/s"):
        make_levels(prepared, (0.5, 1.0), 0.00005)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "least_pending", "prefix_affinity"])
def test_a_replica_marked_down_gets_no_request_and_all_down_is_an_error(policy):
    from sut.core.routing import AffinitySettings, make_router

    r = make_router(policy, 3, 4, AffinitySettings(block_tokens=4, prefix_blocks=1))
    doc = np.arange(8, dtype=np.int32)
    first = [r.route(i, doc + 100 * i) for i in range(6)]
    assert set(first) == {0, 1, 2}
    r.mark_down(1)
    later = [r.route(10 + i, doc + 100 * (i % 6)) for i in range(12)]
    assert 1 not in later and set(later) == {0, 2} and r.stats()["down"] == [1]
    r.mark_down(0)
    r.mark_down(2)
    with pytest.raises(ValueError, match="every replica is down"):
        r.route(99, doc)
    with pytest.raises(ValueError, match="no replica 3"):
        r.mark_down(3)


def test_prefix_affinity_gives_a_lost_owners_documents_one_new_owner():
    from sut.core.routing import AffinitySettings, make_router

    r = make_router("prefix_affinity", 3, 4, AffinitySettings(block_tokens=4, prefix_blocks=1, release_gate="never"))
    doc = np.arange(8, dtype=np.int32)
    owner = r.route(0, doc)
    r.mark_down(owner)
    moved = {r.route(i, doc) for i in range(1, 6)}
    assert len(moved) == 1 and owner not in moved and r.stats()["reowned"] == 1
    assert r.stats()["estimated_uncached_tokens"] == 8 * 2 + 4 * 4  # two misses, four hits of 4 matched tokens


def test_the_dispatcher_checks_each_requests_own_length():
    from sut.core.dispatcher import Dispatcher
    from sut.core.routing import make_router
    from sut.core.transport import TransportSpec
    from sut.engine import EngineSettings, GenerationSettings
    from sut.messages import Completion, Request

    gen = GenerationSettings(max_tokens=8, ignore_eos=True)
    assert gen.lengths_for(3) == (3, 3) and gen.lengths_for(0) == (8, 8)
    assert GenerationSettings(max_tokens=8, min_tokens=5).lengths_for(3) == (3, 3)

    class Ledger:
        error = None

        def __init__(self):
            self.done, self.failed = [], []

        def complete(self, results):
            self.done += results

        def fail(self, message):
            self.failed.append(message)

    spec = TransportSpec(engine=EngineSettings(model=str(TINY_MODEL)), generation=gen)
    t = FakeTransport(dataclass_replace_spec(spec))
    led = Ledger()
    d = Dispatcher(t, make_router("round_robin", 2, 8), led)
    d.dispatch([Request(1, np.arange(4, dtype=np.int32), 1, 3), Request(2, np.arange(4, dtype=np.int32), 2)])
    d.on_results(0, [Completion(1, np.zeros(3, np.int32))])
    d.on_results(1, [Completion(2, np.zeros(3, np.int32))])
    assert [c.rid for c in led.done] == [1] and "request 2: replica 1 answered 3 generated ids" in led.failed[0]
    assert "exactly 8" in led.failed[0]


def dataclass_replace_spec(spec):
    """The spec with fake options that start no thread (the dispatcher test drives the sink by hand)."""
    import dataclasses

    from transport_doubles import FakeOptions
    return dataclasses.replace(spec, options=FakeOptions())


def test_the_engine_worker_asks_a_request_its_own_length():
    from sut.engine.worker import _params_for
    from sut.messages import Request

    class Params:  # the fields of vLLM's SamplingParams that _params_for reads and sets
        def __init__(self, max_tokens, min_tokens, ignore_eos):
            self.max_tokens, self.min_tokens, self.ignore_eos = max_tokens, min_tokens, ignore_eos

        def clone(self):
            return Params(self.max_tokens, self.min_tokens, self.ignore_eos)

    fixed = Params(512, 512, True)
    prompt = np.arange(3, dtype=np.int32)
    assert _params_for(fixed, Request(1, prompt)) is fixed and _params_for(fixed, (1, prompt)) is fixed
    p = _params_for(fixed, Request(2, prompt, -1, 40))
    assert (p.max_tokens, p.min_tokens) == (40, 40) and _params_for(fixed, Request(3, prompt, -1, 40)) is p
    free = _params_for(Params(512, 1, False), Request(4, prompt, -1, 40))
    assert (free.max_tokens, free.min_tokens) == (40, 1)


def test_goodput_counts_requests_within_both_targets():
    from sut.locality.latency import latency_metrics

    times = {0: {"client_ttft": 0.5, "ttft": 0.1, "tpot": 0.05, "latency": 1.0},
             1: {"client_ttft": 2.0, "ttft": 0.1, "tpot": 0.05, "latency": 3.0},  # TTFT over
             2: {"client_ttft": 0.5, "ttft": 0.1, "tpot": 0.2, "latency": 9.0},  # TPOT over
             3: {"client_ttft": 1.0, "ttft": 0.1, "tpot": None, "latency": 1.0}}  # one token: no TPOT
    m = latency_metrics(times, wall_s=2.0, requests=5, targets=(1.0, 0.1))
    assert m["good_requests"] == 2 and m["goodput_per_s"] == 1.0 and m["goodput_share"] == 0.4
    assert m["client_ttft_s"]["p50"] == 0.75 and m["goodput_targets"]["ttft_from"].startswith("client")
    times[0]["client_ttft"] = -0.1  # clocks of two hosts: the engine-side TTFT counts instead, and the record says so
    m = latency_metrics(times, wall_s=2.0, requests=5, targets=(1.0, 0.1))
    assert m["client_ttft_s"] is None and m["good_requests"] == 3
    assert m["goodput_targets"]["ttft_from"].startswith("engine")


def test_every_request_needs_exactly_one_outcome():
    from sut.errors import RunFailed
    from sut.locality.failover import FailoverDispatcher

    d = FailoverDispatcher.__new__(FailoverDispatcher)
    d.failed, d.reroutes = {3: "lost"}, {2: 1}
    assert d.outcome([1, 2, 3], [1, 2]) == {1: "answered", 2: "rerouted", 3: "failed"}
    with pytest.raises(RunFailed, match="request 4: no outcome"):
        d.outcome([1, 2, 3, 4], [1, 2])
    with pytest.raises(RunFailed, match="request 3: answered and failed"):
        d.outcome([1, 2, 3], [1, 2, 3])


# ------------------------------------------------------------------------------------------ the GPU step
STANDIN = """#!/usr/bin/env bash
# python3 of scripts/bench/gpu_runs.sh's workloads step: a Flame cluster that only prints its endpoint, locality runs
# that record their flags and leave a locality.json; anything else runs for real
case "$*" in
  "-m sut.flame cluster"*) echo "FLAME_ENDPOINT=http://127.0.0.1:9"; exec sleep 60 ;;
  "-m sut.locality run"*) echo "$*" >> "$CALLS"; n=
    for a in "$@"; do [ "$n" = 1 ] && name=$a; n=; [ "$a" = --run-name ] && n=1; done
    d="$JOB/workloads/$name-SYNTHETIC-LOCALITY-NOT-MLPERF"; mkdir -p "$d"; echo '{}' > "$d/locality.json"
    [ "$name" = "${FAIL:-}" ] && exit 1; exit 0 ;;
esac
exec {real} "$@"
"""


def test_the_gpu_step_runs_every_preset_with_three_pairs_on_one_card(tmp_path):
    import os
    import subprocess

    from conftest import REPO, standin_python3

    (tmp_path / "job").mkdir()
    env = dict(os.environ, **standin_python3(tmp_path, STANDIN), CALLS=str(tmp_path / "calls"),
               JOB=str(tmp_path / "job"), OUT=str(tmp_path / "out"), FAIL="hot-prefixes", WL_ARGS="--warmups 2")
    out = subprocess.run(["bash", "scripts/bench/gpu_runs.sh", "workloads"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    calls = [c.split() for c in (tmp_path / "calls").read_text().splitlines()]
    assert [c[c.index("--trace-preset") + 1] for c in calls] == list(PRESETS)
    for c in calls:
        assert c[c.index("--pairs") + 1] == "3" and c[c.index("--engines-per-device") + 1] == "2"
        assert c[c.index("--systems") + 1: c.index("--systems") + 3] == ["standalone", "flame"]
        assert c[-2:] == ["--warmups", "2"] and ("--kv-blocks" in c) == (c[c.index("--trace-preset") + 1] == "eviction")
    assert calls[3][calls[3].index("--kv-blocks") + 1] == "4096"
    assert out.returncode == 1 and "workloads hot-prefixes: rc=1" in out.stdout  # the other presets still ran
    assert all((tmp_path / "job" / f"locality_{p}.json").is_file() for p in PRESETS)


def test_a_kill_timer_due_while_the_burst_closes_never_fires(monkeypatch, tmp_path):
    """The burst is over once every request is answered: a kill due while it closes (here: a slow ledger close)
    kills nothing, and the case says the kill never fired."""
    from sut.locality import burst

    class SlowClose(burst.SampleLedger):
        def close(self, timeout=None):
            time.sleep(0.3)
            return super().close(timeout=timeout)

    from sut.locality.workloads import replica_loss

    def due_while_closing(ws, warmups=()):  # the fake burst takes a few ms; its close 0.3 s
        return dataclasses.replace(planned(ws, warmups), at_s=0.15)

    killed, planned = [], replica_loss.kill_plan
    monkeypatch.setitem(SYSTEMS, "standalone", fake())
    monkeypatch.setattr(burst, "SampleLedger", SlowClose)
    monkeypatch.setattr(replica_loss, "kill_plan", due_while_closing)
    monkeypatch.setattr("sut.locality.failover.kill_replica", lambda transport, replica: killed.append(replica))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--kill-after", "0.99")
    f = cases_of(rec)[0]["failover"]
    assert f["killed"]["trigger"] == {"when": "time", "at_s": 0.15, "after": 0.99} and f["killed"]["fired_by"] is None
    assert rc == 0 and killed == [] and f["killed"]["fired"] is False and f["answered"] == 40, f["killed"]


def test_a_kill_time_after_the_burst_falls_back_to_the_answers_share(monkeypatch, tmp_path, capsys):
    """A warm-up slowed by something else puts the kill time after the timed burst: the kill fires once the
    replica has answered its share instead, while it still holds work, and the report says so."""
    from sut.locality.workloads import replica_loss

    def late(ws, warmups=()):  # as if the last warm-up had taken 200 s
        return dataclasses.replace(planned(ws, warmups), at_s=100.0)

    planned = replica_loss.kill_plan
    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.01))
    monkeypatch.setattr(replica_loss, "kill_plan", late)
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--loss-timeout-s", "0.5")
    f = cases_of(rec)[0]["failover"]
    k = f["killed"]
    assert rc == 0 and k["fired"] and k["fired_by"] == "answers" and k["at_s"] < 100
    assert k["replica_answered"] == 15 and k["replica_outstanding"] == 5 and f["rerouted"] > 0  # 3/4 of 20
    assert "note: 1 case(s) killed the replica when it had answered its share, before the kill time" in \
        capsys.readouterr().out


def test_the_kill_timer_never_fires_after_stop_and_leaves_no_thread():
    from sut.locality.failover import Killer, KillPlan

    killed = []
    transport = type("T", (), {"name": "t", "kill_replica": lambda self, r: killed.append(r),
                               "planned_losses": set()})()  # as every Transport has
    k = Killer(KillPlan(0, 0.5, at_s=0.05), transport, lambda: 4)
    k.start()
    k.stop()
    k._on_time()  # a timer thread that had woken just before the stop
    k.join()
    assert killed == [] and k.killed_at is None
    assert not [t for t in threading.enumerate() if t.name in ("replica-loss-timer", "replica-loss-kill")]


def _killer(at_s, routed):
    from sut.locality.failover import Killer, KillPlan

    killed = []
    transport = type("T", (), {"name": "t", "kill_replica": lambda self, r: killed.append(r),
                               "planned_losses": set()})()  # as every Transport has
    return Killer(KillPlan(0, 0.5, at_s=at_s), transport, lambda: routed[0]), killed


def test_the_answers_fallback_of_a_time_trigger_waits_until_every_request_is_routed():
    """With arrivals (--rate) the replica's routed count grows through the burst: 3 of the 4 routed so far is no
    sign that the kill time lies after the burst (before, the fallback fired then, long before the kill time)."""
    routed = [4]
    k, killed = _killer(100.0, routed)
    k.start()
    for _ in range(3):
        k.on_answer(0)
    assert k.fired_by is None and killed == []
    routed[0] = 20
    k.all_routed()  # the burst's last request is routed: 3/4 of 20 = 15 answers fire it
    for _ in range(11):
        k.on_answer(0)
    assert k.fired_by is None
    k.on_answer(0)
    k.join()
    assert k.fired_by == "answers" and killed == [0] and k.at["replica_answered"] == 15
    k.stop()


def test_a_kill_decided_by_an_answer_is_started_before_the_burst_can_close():
    """The kill thread starts while the decision's lock is held: a stop and join that come in between (the burst
    ending on an error) never meet a thread that is not started yet (before: RuntimeError from join, and the kill
    ran after the burst had ended)."""
    k, killed = _killer(None, [4])
    real = k._lock

    class StopOnRelease:  # the burst closes right after on_answer released the lock
        def __enter__(self):
            return real.__enter__()

        def __exit__(self, *exc):
            real.__exit__(*exc)
            if k.at is not None and not k._stopped:
                k._lock = real
                k.stop()
                k.join()

    k._lock = StopOnRelease()
    k.on_answer(0)
    k.on_answer(0)  # 2 of 4 = --kill-after 0.5: fires
    k.join()
    assert killed == [0] and k.fired_by == "answers"


def test_a_kill_whose_loss_was_seen_but_cost_nothing_is_reported_as_measuring_no_loss(monkeypatch, tmp_path, capsys):
    """The kill fires on the replica's last answer: its loss reaches the harness, but nothing was left to re-route
    or fail; the report says the case measures no loss."""
    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.005))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--kill-when", "answers", "--kill-after", "0.9999")
    f = cases_of(rec)[0]["failover"]
    assert rc == 0 and f["killed"]["fired"] and f["killed"]["replica_outstanding"] == 0 and f["loss_seen"]
    assert f["answered"] == 40 and not f["rerouted"] and not f["failed"]
    assert "note: 1 case(s) killed the replica after it had done its work" in capsys.readouterr().out


def test_a_kill_before_any_answer_on_a_system_that_stops_serving_fails_every_request(monkeypatch, tmp_path):
    """The kill at once (--kill-after near 0) on a system that stops serving everything: no request is answered,
    all fail by the loss timeout, and the case is recorded (no answer to time the burst by: it ends when settled).
    A step of 50 ms: the kill's thread lands well before the first answer even on a loaded host (with 5 ms, a kill
    thread scheduled late let a replica answer first, as it may)."""
    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.05, halt_on_kill=True))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--loss-timeout-s", "0.3", "--kill-after", "0.0001")
    assert rc == 0, rec and rec.get("error")
    c = cases_of(rec)[0]
    f = c["failover"]
    assert f["killed"]["fired"] and f["answered"] == f["rerouted"] == 0 and f["failed"] == 40
    assert c["timed"]["wall_s"] >= 0.3 and c["timed"]["requests_per_s"] == 0 and c["timed"]["answered"] == 0
    # the kill came after the requests were handed over (never before t0, nor before the first submit): the killed
    # replica's requests are refused by the halted other one, the other's own fail by the loss timeout
    k = f["killed"]
    assert k["at_s"] >= 0 and k["replica_routed"] == 20 and k["replica_outstanding"] == 20
    reasons = list(f["requests_failed"].values())
    assert sum("no answer within 0.3 s" in r for r in reasons) == 20
    assert sum("replica 1 refused it" in r for r in reasons) == 20


def test_a_kill_due_before_the_first_requests_are_sent_waits_for_them(monkeypatch, tmp_path):
    """The kill time (--kill-after near 0) comes while the first dispatch is still handing its requests over (here
    slowed on purpose, as a loaded host does): the kill waits for them. Before, the timer started before the burst's
    t0 and fired first: every request was refused at once ("every replica is down"), the burst ended after 1 ms,
    and the record put the kill before the burst (negative at_s)."""
    from sut.locality import failover

    real = failover.FailoverDispatcher.dispatch

    def slow(self, items):
        time.sleep(0.05)  # the kill's timer (~0 s) comes due before anything is submitted
        real(self, items)

    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.05, halt_on_kill=True))
    monkeypatch.setattr(failover.FailoverDispatcher, "dispatch", slow)
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10", "--loss-timeout-s", "0.3", "--kill-after", "0.0001")
    assert rc == 0, rec and rec.get("error")
    c = cases_of(rec)[0]
    f, k = c["failover"], c["failover"]["killed"]
    assert k["fired_by"] == "time" and k["at_s"] >= 0.05 and k["replica_routed"] == 20
    assert f["answered"] == f["rerouted"] == 0 and f["failed"] == 40
    assert not any("every replica is down" in r for r in f["requests_failed"].values())
    assert c["timed"]["wall_s"] >= 0.05 + 0.3


def test_a_kill_timer_due_before_the_release_fires_at_the_release():
    k, killed = _killer(0.0001, [4])
    k.start()
    time.sleep(0.05)
    assert k.fired_by is None and killed == []  # due, but nothing was sent yet
    k.released()
    k.join()
    assert k.fired_by == "time" and killed == [0]
    k.stop()


def test_a_burst_that_raises_leaves_no_kill_timer_behind(monkeypatch, tmp_path):
    """A burst cut short by an error (here: the dispatch raises) stops its kill timer: nothing is killed later."""
    from sut.locality import failover

    killed = []

    def broken(self, items):
        raise RuntimeError("dispatch broke")

    monkeypatch.setitem(SYSTEMS, "standalone", fake(step_s=0.01))
    monkeypatch.setattr(failover.FailoverDispatcher, "dispatch", broken)
    monkeypatch.setattr(failover, "kill_replica", lambda transport, replica: killed.append(replica))
    rc, rec = run(tmp_path, "--trace-preset", "replica-loss", "--systems", "standalone", "--policies", "round_robin",
                  "--documents", "10")
    time.sleep(0.5)  # past the kill time (half the warm-up's)
    assert rc == 1 and "dispatch broke" in rec["error"] and killed == []
    assert not [t for t in threading.enumerate() if t.name in ("replica-loss-timer", "replica-loss-kill")]


def test_a_kill_before_the_replica_got_any_request_is_not_called_a_kill_after_its_work():
    from sut.locality.workloads.replica_loss import report_lines

    def case(routed):
        return {"pair": 0, "system": "standalone", "policy": "round_robin", "failover": {
            "killed": {"fired": True, "at_s": 0.0, "replica_routed": routed}, "answered": 40, "rerouted": 0,
            "failed": 0, "losses": [{"replica": 0}], "detected_how": "killed"}}

    lines = report_lines({"cases": [case(0), case(20)]})
    assert "note: 1 case(s) killed the replica before it was sent any request (nothing re-routed or failed): they " \
           "measure no loss (standalone)" in lines
    assert any(x.startswith("note: 1 case(s) killed the replica after it had done its work") for x in lines), lines
