"""``python -m sut.locality report``: one report from the finished cases of several runs
(``sut/locality/merge.py``): pairs renumbered, incomplete pairs dropped, runs of other settings or
without cases.jsonl refused (exit 2); ``run`` writes its header first; the benchmark script checks
merged reports and cut-off runs; the real H200 run that was cut off after 9 cases."""

import importlib.util
import json
import shutil
import statistics
from pathlib import Path

import pytest
import transport_doubles  # noqa: F401 - registers the "fake" transport
from conftest import REPO
from test_locality_pairs import context, fake

from sut.locality import RUN_SUFFIX
from sut.locality.__main__ import main
from sut.locality.runner import HEADER, deviation_notes, run_study
from sut.locality.systems import SYSTEMS

REAL = REPO / "tests" / "data" / "locality_h200_cut_off"


def case(pair, system, rps, policy="prefix_affinity"):
    """A finished case as ``cases.jsonl`` holds it (the fields the report reads); its latencies differ by pair, as
    those of two real cases do (equal timings would make one a copy of the other)."""
    lat = {"p50": 1.0 + pair / 10, "p90": 1.5 + pair / 10, "p99": 2.0 + pair / 10}
    done = {"p50": 6 / rps, "p90": 10 / rps, "p99": 12 / rps}  # completions: the last one ends the burst
    timed = {"requests": 12, "wall_s": 12 / rps, "requests_per_s": rps, "output_tokens_per_s": 16 * rps,
             "cached_share": 0.7, "ttft_s": lat, "e2e_s": lat, "completion_s": done,
             "per_replica": [{"replica": 0, "requests": 6}, {"replica": 1, "requests": 6}]}
    return {"pair": pair, "system": system, "policy": policy, "order": 0, "transport": "fake", "fresh_engines": True,
            "placement": [{"replica": r, "key": f"fake:{r}"} for r in (0, 1)], "timed": timed, "routing": {},
            "validation": {"requests_checked": 12, "failures": 0}}


def header(**over):
    h = {"trace_preset": "study-reuse", "trace_hash": "abc", "trace": {"requests": 12},
         "model": {"revision": "rev1", "path": "/m"}, "engine_settings": {"model": "/m", "dtype": "bfloat16"},
         "generation": {"max_tokens": 16}, "router_settings": {"block_tokens": 256},
         "pair_settings": {"warmups": 2, "rate": 0.0, "arrival_seed": 0, "pairs": 5},
         "systems": {"standalone": {"transport": "local", "options": {}},
                     "flame": {"transport": "flame", "options": {"batch_size": 128, "endpoint": "http://a:1"}}},
         "runtime": {"vllm": "0.26.0"}}
    for k, v in over.items():
        h[k] = v
    return h


def make_run(tmp_path, name, cases, hdr=None, header_file=HEADER):
    d = tmp_path / name
    d.mkdir()
    (d / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    if hdr is not None:
        (d / header_file).write_text(json.dumps(hdr))
    return d


def report(tmp_path, *runs, name="merged"):
    rc = main(["report", *map(str, runs), "--output-dir", str(tmp_path / "out"), "--run-name", name])
    d = tmp_path / "out" / (name + RUN_SUFFIX)
    return rc, (json.loads((d / "locality.json").read_text()) if d.is_dir() else None)


def test_two_runs_merge_with_pairs_renumbered_and_incomplete_pairs_dropped(tmp_path, capsys):
    a = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(0, "flame", 9.9), case(1, "flame", 9.6),
                                 case(1, "standalone", 10.0), case(2, "standalone", 11.0)], header())
    b_header = dict(header(), status="ok", error=None, runtime={"vllm": "0.27.0"},
                    pair_settings=dict(header()["pair_settings"], pairs=6),  # its pairs 0-5: 3 and 5 finished
                    systems=dict(header()["systems"], flame={"transport": "flame",
                                                             "options": {"batch_size": 128, "endpoint": "http://b:2"}}))
    b = make_run(tmp_path, "b", [case(3, "flame", 12.1), case(3, "standalone", 11.0), case(5, "standalone", 12.0),
                                 case(5, "flame", 12.0)], b_header, header_file="locality.json")
    rc, rec = report(tmp_path, a, b)
    assert rc == 0 and rec["merged"] is True and rec["mlperf"] is False and rec["status"] == "ok"
    # run a's pairs 0, 1, 2 -> 0, 1, 2; run b's pairs 3, 5 -> 3, 4
    assert [(c["pair"], c["source"]["pair"], c["source"]["run"]) for c in rec["cases"]][-4:] == \
        [(3, 3, str(b)), (3, 3, str(b)), (4, 5, str(b)), (4, 5, str(b))]
    assert rec["sources"][1]["pairs"] == [{"pair": 3, "merged_pair": 3}, {"pair": 5, "merged_pair": 4}]
    assert rec["dropped"] == [{"pair": 2, "policy": "prefix_affinity", "systems": ["standalone"],
                               "missing": ["flame"], "source": {"run": str(a), "pair": 2}}]
    by_hand = [9.9 / 10.0, 9.6 / 10.0, 12.1 / 11.0, 12.0 / 12.0]
    got = rec["report"]["pair_ratios"]["prefix_affinity"]
    assert [x["pair"] for x in got["per_pair"]] == [0, 1, 3, 4]
    assert [x["ratio"] for x in got["per_pair"]] == pytest.approx(by_hand)
    assert got["median"] == pytest.approx(statistics.median(by_hand)) and got["min"] == pytest.approx(0.96)
    st = rec["report"]["runs"]["standalone"]["prefix_affinity"]["requests_per_s"]
    assert st["n"] == 4 and st["median"] == pytest.approx(statistics.median([10.0, 10.0, 11.0, 12.0]))
    assert any("other runtime versions" in n and "vllm" in n for n in rec["notes"])  # noted, not refused
    assert (tmp_path / "out" / ("merged" + RUN_SUFFIX) / "locality.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "pair 2 (" in out and "dropped, no flame case" in out and "median 99.50%" in out
    # the placement line names each replica once, not once per source run
    assert "replicas' own records): replica 0 on fake:0, replica 1 on fake:1\n" in out


def test_policy_ratios_over_pairs_that_ran_both_policies(tmp_path, capsys):
    a = make_run(tmp_path, "a", [case(0, s, r, po) for s in ("standalone", "flame")
                                 for po, r in (("prefix_affinity", 20.0), ("round_robin", 10.0))], header())
    b = make_run(tmp_path, "b", [case(0, "standalone", 22.0), case(0, "flame", 21.0)], header())
    rc, rec = report(tmp_path, a, b)
    assert rc == 0
    pr = rec["report"]["policy_ratios"]["standalone"]
    assert pr["per_pair"] == [{"pair": 0, "ratio": 2.0}]
    assert pr["ratio_of_medians"] == pytest.approx(21.0 / 10.0)
    assert pr["pairs"] == {"prefix_affinity": 2, "round_robin": 1, "both": 1}
    out = capsys.readouterr().out  # the console says the two medians are over different pairs
    assert ("standalone: prefix_affinity / round_robin = 2.100x (ratio of medians); medians over 2 and 1 pairs, "
            "2.000x per pair over the 1 that ran both") in out, out


@pytest.mark.parametrize("field,value", [("trace_hash", "other"), ("trace_preset", "study-no-reuse"),
                                         ("engine_settings", {"model": "/m", "dtype": "float16"}),
                                         ("model", {"revision": "rev2"}),
                                         ("pair_settings", {"warmups": 1, "rate": 0.0, "arrival_seed": 0})])
def test_runs_of_other_settings_are_refused_naming_run_and_field(tmp_path, capsys, field, value):
    a = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(0, "flame", 9.9)], header())
    b = make_run(tmp_path, "b", [case(0, "standalone", 10.0), case(0, "flame", 9.9)], header(**{field: value}))
    rc, rec = report(tmp_path, a, b)
    err = capsys.readouterr().err
    assert rc == 2 and rec is None and not (tmp_path / "out").exists()
    assert f"run {b}: {field}" in err


def test_an_engine_setting_spelled_at_its_default_merges_and_a_real_difference_is_named(tmp_path, capsys):
    """--admit-every-steps 1 is the same engine loop as no flag (null): the runs merge; 2 is refused, the message
    naming that key and both values, not the whole settings dicts."""
    def cases(rps):  # each run its own measurements (a copy of a run is refused)
        return [case(0, "standalone", rps), case(0, "flame", rps - 0.1)]

    es = header()["engine_settings"]
    a = make_run(tmp_path, "a", cases(10.0), header(engine_settings=dict(es, admit_every_steps=None)))
    b = make_run(tmp_path, "b", cases(11.0), header(engine_settings=dict(es, admit_every_steps=1)))
    assert report(tmp_path, a, b, name="same")[0] == 0
    c = make_run(tmp_path, "c", cases(12.0), header(engine_settings=dict(es, admit_every_steps=2)))
    capsys.readouterr()
    assert report(tmp_path, a, c, name="other")[0] == 2
    err = capsys.readouterr().err
    assert f"run {c}: engine_settings differs" in err and "(admit_every_steps: 2 vs 'unset')" in err, err


def test_other_system_options_missing_cases_jsonl_and_headerless_merges_exit_2(tmp_path, capsys):
    good = [case(0, "standalone", 10.0), case(0, "flame", 9.9)]
    a = make_run(tmp_path, "a", good, header())
    flame64 = dict(header()["systems"], flame={"transport": "flame", "options": {"batch_size": 64}})
    b = make_run(tmp_path, "b", good, header(systems=flame64))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / HEADER).write_text(json.dumps(header()))
    bare = make_run(tmp_path, "bare", good)
    for runs, msg in (([a, b], f"run {b}: systems.flame (its transport or options) differs from run {a}'s "
                               "(batch_size: 64 vs 128)"), ([a, empty], f"run {empty}: no cases.jsonl"),
                      ([a, bare], f"run {bare}: no locality.json or {HEADER}"), ([a, a], "given twice"),
                      ([a, a / "cases.jsonl"], "cases.jsonl: a file, not a run folder (give the folder that holds it)"),
                      ([a, tmp_path / "nope"], "nope: no such folder")):
        assert report(tmp_path, *runs) == (2, None)
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_watchdog_option_added_later_merges_only_while_unset(tmp_path, capsys):
    """A run recorded before the Flame option engine_stall_s existed merges with one that leaves it unset (None),
    not with one that sets it."""
    good = [case(0, "standalone", 10.0), case(0, "flame", 9.9)]
    old = make_run(tmp_path, "old", good, header())

    def flame_with(value):
        opts = dict(header()["systems"]["flame"]["options"], engine_stall_s=value)
        return dict(header()["systems"], flame={"transport": "flame", "options": opts})
    unset = make_run(tmp_path, "unset", [case(0, "standalone", 10.2), case(0, "flame", 9.7)],
                     header(systems=flame_with(None)))
    rc, rec = report(tmp_path, old, unset)
    assert rc == 0 and rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 2, rec["report"]
    set60 = make_run(tmp_path, "set60", [case(0, "standalone", 10.4), case(0, "flame", 9.6)],
                     header(systems=flame_with(60.0)))
    shutil.rmtree(tmp_path / "out")
    assert report(tmp_path, old, set60) == (2, None)
    err = capsys.readouterr().err
    assert f"run {set60}: systems.flame (its transport or options) differs from run {old}'s " \
           "(engine_stall_s: 60.0 vs 'unset')" in err, err


def test_a_headerless_run_alone_is_reported_with_settings_unknown(tmp_path):
    rc, rec = report(tmp_path, make_run(tmp_path, "bare", [case(0, "standalone", 10.0), case(0, "flame", 9.0)]))
    assert rc == 0 and rec["settings_known"] is False and rec["trace_preset"] is None
    assert rec["report"]["pair_ratios"]["prefix_affinity"]["median"] == pytest.approx(0.9)
    assert any(n.startswith("settings unknown") for n in rec["notes"])


def test_run_writes_its_header_first_and_a_cut_off_run_merges_with_a_finished_one(tmp_path, monkeypatch):
    monkeypatch.setitem(SYSTEMS, "standalone", fake())
    monkeypatch.setitem(SYSTEMS, "flame", fake(step_s=0.002))
    from sut.locality.pairs import PairSettings
    from sut.locality.systems import resolve_systems

    runs = []
    for name in ("s1", "s2"):
        d = tmp_path / name
        d.mkdir()
        prep, ctx = context(d, warmups=0)
        ctx.run_dir = d
        sy = resolve_systems(["standalone", "flame"], 2)
        run_study(sy, prep, ctx, PairSettings(policies=("prefix_affinity",), pairs=2, warmups=0, progress=False),
                  {"trace_preset": None, "model": {"revision": "r"}, "engine_settings": ctx.engine})
        head = json.loads((d / HEADER).read_text())
        assert head["trace_hash"] == prep.record()["trace_hash"] and set(head["systems"]) == {"standalone", "flame"}
        assert "cases" not in head and head["mlperf"] is False
        runs.append(d)
    (runs[0] / "locality.json").unlink()  # cut off: cases.jsonl and run_header.json only
    rc, rec = report(tmp_path, *runs)
    assert rc == 0 and rec["settings_known"] is True and rec["trace_hash"] == head["trace_hash"]
    assert sorted({c["pair"] for c in rec["cases"]}) == [0, 1, 2, 3] and rec["dropped"] == []
    assert rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 4
    assert any("cut off before its locality.json" in n for n in rec["notes"])


def _bench():
    spec = importlib.util.spec_from_file_location("bench_locality", REPO / "scripts" / "bench" / "bench_locality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_real_h200_run_cut_off_after_nine_cases(tmp_path, capsys):
    run = tmp_path / "bench-study-reuse-SYNTHETIC-LOCALITY-NOT-MLPERF"
    shutil.copytree(REAL, run)
    rc, rec = report(tmp_path, run)
    aff = rec["report"]["pair_ratios"]["prefix_affinity"]
    assert rc == 0 and aff["n"] == 4 and round(aff["median"], 4) == 0.9741
    assert [d["pair"] for d in rec["dropped"]] == [4]
    assert rec["report"]["runs"]["standalone"]["prefix_affinity"]["requests_per_s"]["n"] == 4
    capsys.readouterr()
    bench = _bench()  # --check takes the merged report and the cut-off run alike
    assert bench.main(["--check", str(run), str(tmp_path / "out" / ("merged" + RUN_SUFFIX))]) == 0
    out = capsys.readouterr().out
    assert out.count("median 97.41%") == 2 and "replicas share 1 device" in out
    (run / "cases.jsonl").unlink()
    assert bench.main(["--check", str(run)]) == 1


# ----------------------------------------------------------------- malformed input, copies, cut-off lines
GOOD = [case(0, "standalone", 10.0), case(0, "flame", 9.9)]


def _timed(**over):
    return dict(GOOD[0]["timed"], **over)


@pytest.mark.parametrize("line,field", [
    ("5", "not a JSON object"), ("null", "not a JSON object"), ('["pair", "system", "policy", "timed"]', "JSON object"),
    (dict(GOOD[0], pair="x"), "field pair"), (dict(GOOD[0], pair=0.5), "field pair"),
    (dict(GOOD[0], pair=None), "pair"),
    (dict(GOOD[0], timed={}), "timed.requests"), (dict(GOOD[0], timed=None), "timed"),
    (dict(GOOD[0], system=["a"]), "field system"), (dict(GOOD[0], placement=[{"x": 1}]), "field placement"),
    (dict(GOOD[0], timed=_timed(requests_per_s=0.0)), "timed.requests_per_s"),
    (dict(GOOD[0], timed=_timed(requests_per_s="fast")), "timed.requests_per_s"),
    (dict(GOOD[0], timed=_timed(ttft_s=[1])), "timed.ttft_s"), (dict(GOOD[0], replicas=[{"kv_cache": 3}]), "replicas"),
    (dict(GOOD[0], timed=_timed(tpot_s={"p50": "x"})), "timed.tpot_s"),
    (dict(GOOD[0], timed=_timed(latency_s={"p99": [1]})), "timed.latency_s"),
    (dict(GOOD[0], timed=_timed(router_cached_share="0.06")), "timed.router_cached_share"),
    (dict(GOOD[0], timed=_timed(router_cached_share=1.7)), "timed.router_cached_share"),
    (dict(GOOD[0], timed=_timed(per_replica=[{"requests": 10, "uncached_tokens": "9"}])), "timed.per_replica"),
    (dict(GOOD[0], working_set={"replica_kv_tokens": ["a"]}), "field working_set"),
], ids=["int", "null", "list", "pair-str", "pair-float", "pair-none", "timed-empty", "timed-null", "system-list",
        "placement", "rps-0", "rps-str", "ttft-list", "kv-int", "tpot-str", "latency-list", "router-share-str",
        "router-share-over-1", "uncached-str", "working-set"])
def test_malformed_case_lines_exit_2_naming_run_line_and_field_without_a_folder(tmp_path, capsys, line, field):
    d = make_run(tmp_path, "r", [], header())
    (d / "cases.jsonl").write_text(json.dumps(GOOD[1]) + "\n" + (line if isinstance(line, str) else json.dumps(line))
                                   + "\n")
    assert report(tmp_path, d) == (2, None) and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert f"error: run {d}: cases.jsonl line 2" in err and field in err and "Traceback" not in err


@pytest.mark.parametrize("hdr,msg", [("[1, 2]", "run_header.json is list"), ('"text"', "run_header.json is str"),
                                     (json.dumps(header(systems=["flame"])), "run_header.json field systems"),
                                     (json.dumps(header(workload={"working_set": {"documents": 24,
                                                                                  "document_tokens": None}})),
                                      "run_header.json field workload.working_set"),
                                     (json.dumps(header(trace={"answer_tokens": {"p50": "x"}})),
                                      "run_header.json field trace.answer_tokens"),
                                     (json.dumps(header(workload=[1])), "run_header.json field workload"),
                                     ("{", "cannot read run_header.json")])
def test_a_header_that_is_not_a_header_or_a_file_not_utf8_exits_2(tmp_path, capsys, hdr, msg):
    d = make_run(tmp_path, "r", GOOD)
    (d / HEADER).write_text(hdr)
    assert report(tmp_path, d) == (2, None)
    assert f"error: run {d}: {msg}" in capsys.readouterr().err
    (d / HEADER).write_text(json.dumps(header()))
    (d / "cases.jsonl").write_bytes(b"\xff" + (d / "cases.jsonl").read_bytes())
    assert report(tmp_path, d) == (2, None) and not (tmp_path / "out").exists()
    assert f"error: run {d}: cases.jsonl line 1 is not JSON (not UTF-8 " in capsys.readouterr().err


@pytest.mark.parametrize("edit, said", [
    (lambda h: h["pair_settings"].update(policies=["round_robin"]),
     "field pair_settings.policies is ['round_robin'] in locality.json but ['prefix_affinity'] in run_header.json"),
    (lambda h: h["pair_settings"].update(arrival_seed=7),
     "field pair_settings.arrival_seed is 7 in locality.json but 0 in run_header.json"),
    (lambda h: h["systems"].pop("flame"), "field systems.flame is absent in locality.json but {"),
    (lambda h: h["systems"]["flame"]["options"].update(batch_size=64),
     "field systems.flame.options.batch_size is 64 in locality.json but 128 in run_header.json"),
    (lambda h: h.update(trace_preset="study-no-reuse"),
     "field trace_preset is 'study-no-reuse' in locality.json but 'study-reuse' in run_header.json"),
    (lambda h: h.update(notes=["another run's note"]),
     "field notes of locality.json does not begin with its run_header.json's ['settings note']"),
])
def test_a_run_whose_locality_json_contradicts_its_run_header_exits_2_naming_the_field(tmp_path, capsys, edit, said):
    """Before: report read locality.json alone and merged a run whose run_header.json said other settings (a file
    edited by hand, or copied in from another run)."""
    hdr = header(pair_settings=dict(header()["pair_settings"], policies=["prefix_affinity"]), notes=["settings note"])
    d = make_run(tmp_path, "r", GOOD, hdr)
    record = json.loads(json.dumps(dict(hdr, status="ok", error=None, notes=["settings note", "a deviation note"])))
    (d / "locality.json").write_text(json.dumps(record))  # as the run writes it: the header, its notes and more
    rc, rec = report(tmp_path, d, name="agree")
    assert rc == 0 and rec["trace_preset"] == "study-reuse", capsys.readouterr().err
    edit(record)
    (d / "locality.json").write_text(json.dumps(record))
    assert report(tmp_path, d, name="disagree") == (2, None) and not (tmp_path / "out" / ("disagree" + RUN_SUFFIX)
                                                                      ).exists()
    err = capsys.readouterr().err
    assert f"error: run {d}: {said}" in err and "Traceback" not in err, err


def test_a_copy_of_a_run_is_refused_naming_both_runs(tmp_path, capsys):
    a = make_run(tmp_path, "a", GOOD + [case(1, "standalone", 10.0), case(1, "flame", 9.0)], header())
    b = make_run(tmp_path, "b", [case(2, "standalone", 11.0), case(2, "flame", 10.0)], header())
    shutil.copytree(a, tmp_path / "a_copy")
    (tmp_path / "a_copy" / "cases.jsonl").write_text(json.dumps(GOOD[1]) + "\n")  # a copy cut off earlier
    assert report(tmp_path, a, b, tmp_path / "a_copy") == (2, None) and not (tmp_path / "out").exists()
    assert f"run {tmp_path / 'a_copy'} holds the same case as run {a}" in capsys.readouterr().err


def test_each_run_path_is_resolved_once(tmp_path, monkeypatch):
    from pathlib import Path

    runs = [make_run(tmp_path, f"r{i}", [case(0, "standalone", 10.0 + i), case(0, "flame", 9.0 + i)], header())
            for i in range(30)]
    calls = []
    real = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    from sut.locality.merge import build

    m = build(runs)
    assert len(calls) <= 30 and len(m.runs) == 60  # was 30 + 30 x 30 x 2: quadratic in the runs


def test_a_cut_off_last_line_is_skipped_with_a_note_other_bad_lines_exit_2(tmp_path, capsys):
    text = "".join(json.dumps(c) + "\n" for c in GOOD + [case(1, "standalone", 10.0)])
    d = make_run(tmp_path, "r", [], header())
    (d / "cases.jsonl").write_text(text + json.dumps(case(1, "flame", 9.0))[:40])
    rc, rec = report(tmp_path, d)
    assert rc == 0 and len(rec["cases"]) == 3 and rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 1
    assert f"run {d}: cases.jsonl line 4 is cut off (the run stopped while writing it): skipped" in rec["notes"]
    for bad, n in ((text + json.dumps(case(1, "flame", 9.0))[:40] + "\n", 4), ("{\n" + text, 1)):
        (d / "cases.jsonl").write_text(bad)  # ended by a newline or not the last line: corrupt, not cut off
        assert report(tmp_path, d, name=f"bad{n}") == (2, None)
        assert f"error: run {d}: cases.jsonl line {n} is not JSON" in capsys.readouterr().err


def test_runs_without_a_complete_pair_exit_2(tmp_path, capsys):
    a = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(1, "standalone", 10.5)], header())
    b = make_run(tmp_path, "b", [case(0, "flame", 9.0)], header())
    assert report(tmp_path, a, b) == (2, None) and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert f"error: runs {a}, {b}: no complete pair" in err and f"pair 0 of {a} (prefix_affinity) lacks flame" in err


def test_a_failure_while_writing_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sut.locality.runner.plot_pair_report", boom)
    rc, rec = report(tmp_path, make_run(tmp_path, "a", GOOD, header()))
    assert rc == 1 and rec is None and not (tmp_path / "out").exists()  # --output-dir too: this report made it


def test_a_console_table_that_cannot_be_made_leaves_no_folder(tmp_path, monkeypatch):
    """The table is rendered before the folder counts as written: a record it cannot show leaves nothing."""
    def boom(record):
        raise TypeError("unsupported format string passed to NoneType.__format__")

    monkeypatch.setattr("sut.locality.__main__.study_tables", boom)
    with pytest.raises(TypeError):
        report(tmp_path, make_run(tmp_path, "a", GOOD, header()))
    assert not (tmp_path / "out").exists()


def test_a_merged_report_given_as_a_run_is_named_as_such(tmp_path, capsys):
    a = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(0, "flame", 9.9)], header())
    assert report(tmp_path, a, name="first")[0] == 0
    merged = tmp_path / "out" / ("first" + RUN_SUFFIX)
    capsys.readouterr()
    rc, rec = report(tmp_path, a, merged, name="second")
    err = capsys.readouterr().err
    assert rc == 2 and rec is None and "is a merged report" in err and "sources" in err


def test_a_too_deeply_nested_header_or_case_line_exits_2(tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    a = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(0, "flame", 9.9)])
    (a / HEADER).write_text(deep)
    assert report(tmp_path, a)[0] == 2 and "recursion limit" in capsys.readouterr().err
    b = make_run(tmp_path, "b", [case(0, "standalone", 10.0)], header())
    (b / "cases.jsonl").write_text(deep + "\n" + json.dumps(case(0, "flame", 9.9)) + "\n")
    assert report(tmp_path, b)[0] == 2 and "line 1 is not JSON" in capsys.readouterr().err


def _edited(pair=0, **fields):
    c = case(pair, "flame", 9.9)
    for k, v in fields.items():
        if k == "timed":
            c["timed"] = dict(c["timed"], **v)
        else:
            c[k] = v
    return c


@pytest.mark.parametrize("bad, said", [
    (_edited(policy="bogus_policy"), "policy 'bogus_policy' is not one of the run's policies ['prefix_affinity']"),
    (_edited(system="vllm"), "system 'vllm' is not one of the run's systems ['flame', 'standalone']"),
    (_edited(pair=7), "pair 7 is past the run's 5 pair(s)"),
    (_edited(pair=-7), "field pair is -7, not an integer >= 0"),
    (_edited(validation={"requests_checked": 3, "failures": 15}), "field validation.failures is 15, not 0"),
    (_edited(timed={"requests_per_s": 1e6}), "field timed.requests_per_s is 1000000.0, but its requests / wall_s"),
    # a recheck's ways around the rate check: counts made consistent with each other but not with the run
    (_edited(timed={"requests": 1200, "wall_s": 1200 / 9.9}), "field validation.requests_checked is 12, but timed"),
    (_edited(timed={"requests": 1200, "wall_s": 1200 / 9.9}, validation={"requests_checked": 1200, "failures": 0}),
     "field timed.per_replica counts 12 requests, but timed.requests is 1200"),
    (_edited(timed={"requests": 1200, "wall_s": 1200 / 9.9, "per_replica": [{"replica": 0, "requests": 1200}]},
             validation={"requests_checked": 1200, "failures": 0}), "timed.requests 1200 is not the run's trace of 12"),
    (_edited(timed={"wall_s": 0}), "field timed.wall_s is 0, not a number > 0"),
    (_edited(validation=None), "lacks ['validation']"),
    (_edited(cleanup={"processes_left": 5}), "field cleanup.processes_left is 5, not null or a list"),
    # figures of one burst that contradict each other: a faster wall_s with requests_per_s to match, output tokens/s
    # or a cached share of their own, negative token counts
    (_edited(timed={"wall_s": 0.012, "requests_per_s": 1000.0}),
     "field timed.completion_s.p99 is 1.2121212121212122, after timed.wall_s 0.012 (the burst ends at its last "
     "answer)"),
    (_edited(timed={"per_replica": [{"replica": 0, "requests": 12, "done_s": 5.0}]}),
     "field timed.per_replica.0.done_s is 5.0, after timed.wall_s"),
    (_edited(timed={"output_tokens": 192, "output_tokens_per_s": 1e6}),
     "field timed.output_tokens_per_s is 1000000.0, but its output_tokens / wall_s is 192 / 1.2121"),
    (_edited(timed={"prompt_tokens": 1000, "cached_tokens": 0, "cached_share": 0.4}),
     "field timed.cached_share is 0.4, but its cached_tokens / prompt_tokens is 0 / 1000 = 0.0000"),
    (_edited(timed={"prompt_tokens": 1000, "cached_tokens": 1500}),
     "field timed.cached_tokens is 1500, more than its prompt_tokens 1000"),
    (_edited(timed={"output_tokens": -5}), "field timed.output_tokens is -5, not an integer >= 0"),
    (_edited(timed={"per_replica": [{"replica": 0, "requests": 12, "uncached_tokens": -5}]}),
     "field timed.per_replica.0.uncached_tokens is -5, not an integer >= 0"),
    (_edited(timed={"per_replica": [{"replica": 0, "requests": 14}, {"replica": 1, "requests": -2}]}),
     "field timed.per_replica.1.requests is -2, not an integer >= 0"),
])
def test_a_hand_edited_case_that_contradicts_its_run_exits_2(tmp_path, capsys, bad, said):
    """Each of these was merged and reported (exit 0, no note)."""
    hdr = header(pair_settings=dict(header()["pair_settings"], policies=["prefix_affinity"]))
    d = make_run(tmp_path, "r", [case(0, "standalone", 10.0), bad], hdr)
    assert report(tmp_path, d) == (2, None) and not (tmp_path / "out").exists()
    assert said in capsys.readouterr().err


def test_a_case_that_left_processes_behind_is_noted(tmp_path):
    left = _edited(cleanup={"processes_left": [{"pid": 123, "cmdline": "vllm serve"}]})
    rc, rec = report(tmp_path, make_run(tmp_path, "r", [case(0, "standalone", 10.0), left], header()))
    assert rc == 0 and any("pair 0, flame, prefix_affinity left 1 process(es) behind" in n and "vllm serve" in n
                           for n in rec["notes"])


def test_deviation_note_names_every_device_of_a_merge_from_two_hosts():
    def placed(*keys):
        return {"placement": [{"replica": i, "key": k} for i, k in enumerate(keys)]}

    one = deviation_notes([placed("cuda:GPU-a", "cuda:GPU-a"), placed("cuda:GPU-a", "cuda:GPU-a")])
    assert one == ["2 replicas share 1 device(s) (cuda:GPU-a); the study ran one GPU per replica (two B200s)"]
    two = deviation_notes([placed("cuda:GPU-b", "cuda:GPU-b"), placed("cuda:GPU-a", "cuda:GPU-a")])
    assert len(two) == 1 and "(cuda:GPU-a, cuda:GPU-b)" in two[0] and "2 different placements" in two[0]
    assert deviation_notes([placed("cuda:GPU-a", "cuda:GPU-b")]) == []


# ----------------------------------------------------------------- cached share above its bound, nudged copies
def test_a_cached_share_above_the_traces_bound_exits_2(tmp_path, capsys):
    """Before: a case with cached share 1.0 on a trace whose reusable share is at most 0.7 was reported."""
    hdr = header(trace={"requests": 12, "reusable_share_upper_bound": 0.7})
    bad = dict(GOOD[0], timed=_timed(cached_share=1.0))
    d = make_run(tmp_path, "r", [bad, GOOD[1]], hdr)
    assert report(tmp_path, d) == (2, None) and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert (f"error: run {d}: cases.jsonl case pair 0, standalone, prefix_affinity: timed.cached_share 1.0 is above "
            "its trace's reusable_share_upper_bound 0.7") in err
    from sut.locality.merge import CACHED_SHARE_SLACK

    at_bound = dict(GOOD[0], timed=_timed(cached_share=0.7 + CACHED_SHARE_SLACK))  # block rounding, 4-decimal figures
    ok = make_run(tmp_path, "ok", [at_bound, GOOD[1]], hdr)
    assert report(tmp_path, ok, name="ok")[0] == 0


def _real_cases():
    return [json.loads(line) for line in (REAL / "cases.jsonl").read_text().splitlines()]


def _nudged(c, everything):
    """``c`` with wall_s x 1.0001 (and, ``everything``: every timing x 1.0001, start_s and the engines' pids
    changed too: only the timings tell it is a copy)."""
    c = json.loads(json.dumps(c))
    t = c["timed"]
    t["wall_s"] = round(t["wall_s"] * 1.0001, 4)
    if everything:
        for k in ("ttft_s", "e2e_s", "completion_s"):
            t[k] = {p: round(v * 1.0001, 4) for p, v in t[k].items()}
        c["start_s"] += 1.0
        for r in c["replicas"]:
            r["pid"] += 7
    return c


@pytest.mark.parametrize("everything", [False, True], ids=["wall_s-only", "every-timing-and-identity"])
def test_a_nudged_copy_of_a_run_is_refused_and_real_distinct_runs_merge(tmp_path, capsys, everything):
    """Before: a copy of the real run with every wall_s x 1.0001 merged as a second run (its pairs counted twice)."""
    cases = _real_cases()
    hdr = header(trace={"requests": 256}, pair_settings=dict(header()["pair_settings"], pairs=5))
    a = make_run(tmp_path, "a", cases, hdr)
    copy = make_run(tmp_path, "copy", [_nudged(c, everything) for c in cases], hdr)
    assert report(tmp_path, a, copy) == (2, None) and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert f"error: run {copy} holds the same case as run {a} (pair 0, standalone, prefix_affinity; " in err
    assert ("all 10 timings within 0.1% of its" if everything else "the same start_s 55.197") in err
    # the real cases split into two runs (pairs 0-1, pairs 2-4): distinct cases, 0.38 % apart or more
    first = make_run(tmp_path, "first", [c for c in cases if c["pair"] < 2], hdr)
    second = make_run(tmp_path, "second", [c for c in cases if c["pair"] >= 2], hdr)
    rc, rec = report(tmp_path, first, second, name="split")
    assert rc == 0 and rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 4


def test_millisecond_timings_cannot_make_a_copy_but_real_ones_can():
    """Two bursts of a test double (timings of a few ms, recorded to 4 decimals) round to the same values: that
    is no evidence of a copy (a full-suite run refused two fresh runs this way); timings long enough to resolve
    0.1 % still are."""
    from sut.locality.merge import copy_of

    def case(scale, start):
        timed = {"requests": 40, "wall_s": round(0.0071 * scale, 4),
                 **{k: {p: round(v * scale, 4) for p, v in (("p50", 0.0031), ("p90", 0.0052), ("p99", 0.0068))}
                    for k in ("ttft_s", "e2e_s", "completion_s")}}
        return {"system": "standalone", "policy": "round_robin", "timed": timed, "start_s": start,
                "replicas": [{"pid": int(start * 10)}]}

    assert copy_of(case(1, 1.0), case(1, 2.0)) is None
    assert copy_of(case(1000, 1.0), case(1000, 2.0)).startswith("all 10 timings within 0.1% of its")


def test_a_report_that_cannot_be_written_exits_1_and_leaves_no_folder_it_made(tmp_path, monkeypatch, capsys, caplog):
    """A write failure fails the report (exit 1) and removes its half-written folder and the --output-dir folders
    it made; folders that were there before stay."""
    d = make_run(tmp_path, "r", GOOD, header())

    def unwritable(m, folder):
        (folder / "locality.json").write_text("{")  # half-written
        raise PermissionError(13, "Permission denied", str(folder / "locality.png"))

    monkeypatch.setattr("sut.locality.__main__.write_merged", unwritable)
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "new" / "deeper"
    assert main(["report", str(d), "--output-dir", str(out), "--run-name", "m"]) == 1
    assert "cannot write the merged report into" in capsys.readouterr().err + caplog.text
    assert (tmp_path / "kept").is_dir() and list((tmp_path / "kept").iterdir()) == []


def test_runs_of_two_presets_are_refused_by_their_preset_names_not_their_hashes():
    """Two presets always differ in their traces too: the refusal names the presets, which a user recognises."""
    from sut.errors import BadInput
    from sut.locality.merge import SourceRun, check_compatible

    runs = [SourceRun(Path(f"/r/{p}"), {"trace_preset": p, "trace_hash": h}, None, "done", None)
            for p, h in (("arrivals", "a6f8"), ("variable-answers", "c3d1"))]
    with pytest.raises(BadInput, match=r"run /r/variable-answers: trace_preset differs from run /r/arrivals's "
                                       r"\('variable-answers' vs 'arrivals'\)"):
        check_compatible(runs)


def test_a_case_without_its_optional_fields_is_reported_with_dashes(tmp_path, capsys):
    """Fields the case schema lets a record lack (engine latencies, per-replica counts, cached share, some
    router counters) print as "-" instead of failing the report."""
    def bare(c):
        for k in ("ttft_s", "e2e_s", "completion_s", "per_replica", "cached_share"):
            del c["timed"][k]
        c["routing"] = {"affinity_hits": 3}
        return c
    run = make_run(tmp_path, "bare", [bare(case(0, "standalone", 10.0)), bare(case(0, "flame", 9.9))], header())
    rc, rec = report(tmp_path, run)
    out = capsys.readouterr().out
    assert rc == 0 and rec["report"]["pair_ratios"]["prefix_affinity"]["n"] == 1, out
    assert "hits 3, new -, released -, no key -, evicted -" in out


@pytest.mark.parametrize("edit, where", [
    (lambda c, h: c["timed"].update(requests=10 ** 400), "cases.jsonl line 1 field timed.requests is"),
    (lambda c, h: c["timed"].update(ttft_s={"p50": -5.0, "p99": -1.0}), "cases.jsonl line 1 field timed.ttft_s is"),
    (lambda c, h: c.update(warmups=[{"wall_s": float("nan")}]),
     "cases.jsonl line 1 field warmups[0].wall_s is nan, not a finite number"),
    (lambda c, h: h.update(report_metric=["x"]), f"{HEADER} field report_metric is ['x'], not null or one of"),
    (lambda c, h: h["trace"].update(document_tokens="abc"), f"{HEADER} field trace.document_tokens is 'abc'"),
    (lambda c, h: h.update(workload={"calibration": "x"}), f"{HEADER} field workload.calibration is 'x'"),
    (lambda c, h: h.update(pair_settings=dict(h["pair_settings"], rate=float("inf"))),
     f"{HEADER} field pair_settings.rate is inf, not a finite number"),
])
def test_values_the_report_cannot_read_are_refused_naming_the_field(tmp_path, capsys, edit, where):
    first, hdr = case(0, "standalone", 10.0), header()
    edit(first, hdr)
    run = make_run(tmp_path, "r", [first, case(0, "flame", 9.9)], hdr)
    assert report(tmp_path, run) == (2, None)
    err = capsys.readouterr().err
    assert f"error: run {run}: {where}" in err, err
    assert not (tmp_path / "out").exists()


def test_a_run_folder_that_cannot_be_made_leaves_no_output_dir(tmp_path, capsys):
    run = make_run(tmp_path, "a", [case(0, "standalone", 10.0), case(0, "flame", 9.9)], header())
    out = tmp_path / "new" / "deeper"
    rc = main(["report", str(run), "--output-dir", str(out), "--run-name", "a" * 300])
    assert rc == 2 and "cannot create the run folder under --output-dir" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_merged_runs_of_one_pair_each_are_noted_when_the_order_does_not_alternate(tmp_path):
    """Two runs of --pairs 1 both ran standalone first: the merge says the order effect is not averaged out; one
    run per order does not get the note."""
    def ordered(pair, first, rps):
        out = []
        for i, system in enumerate((first, "flame" if first == "standalone" else "standalone")):
            c = case(pair, system, rps + i / 10 + pair / 100)
            c["order"] = i
            out.append(c)
        return out
    a = make_run(tmp_path, "a", ordered(0, "standalone", 10.0), header())
    b = make_run(tmp_path, "b", ordered(0, "standalone", 11.0), header())
    rc, rec = report(tmp_path, a, b, name="same")
    assert rc == 0 and any(n.startswith("prefix_affinity: the merged pairs do not alternate which system runs "
                                        "first (standalone first in 2)") for n in rec["notes"]), rec["notes"]
    c = make_run(tmp_path, "c", ordered(0, "flame", 12.0), header())
    rc, rec = report(tmp_path, a, c, name="alternating")
    assert rc == 0 and not any("do not alternate" in n for n in rec["notes"]), rec["notes"]


def test_kv_cache_line_says_when_no_replica_reported_its_capacity():
    from sut.locality.report import _kv_cache_line

    unknown = {"per_replica": [{"replica": 0, "tokens": None}, {"replica": 1, "tokens": None}],
               "trace_document_tokens": 65536}
    assert _kv_cache_line(unknown) == ("KV cache per replica: not read back from these replicas (vllm serve replicas "
                                       "do not report it); the trace's distinct documents need 65,536 tokens")
    known = dict(unknown, per_replica=[{"tokens": 1000}, {"tokens": None}])
    assert _kv_cache_line(known).startswith("KV cache per replica (blocks x block size): 1,000, - tokens")


# ------------------------------------------------------------------------ run files that are no regular files
def _fifo_or_folder(path: Path, kind: str) -> None:
    import os

    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:  # a sparse file over the bound: nothing of it may be read
        from sut.locality.merge import MAX_FILE_BYTES

        with open(path, "wb") as f:
            f.truncate(MAX_FILE_BYTES + 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "folder", "huge"])
@pytest.mark.parametrize("name", ["run_header.json", "locality.json", "cases.jsonl"])
def test_a_run_file_that_is_a_fifo_a_folder_or_too_large_exits_2_naming_it(tmp_path, capsys, name, kind):
    """Before: a FIFO as locality.json (no cases.jsonl) blocked the command forever; a FIFO or folder as
    run_header.json was passed over (the run reported with its settings unknown, exit 0); a cases.jsonl larger than
    memory was read whole (MemoryError, exit 1)."""
    d = make_run(tmp_path, "r", [] if name == "cases.jsonl" else [case(0, "standalone", 10.0), case(0, "flame", 9.9)],
                 header() if name != "run_header.json" else None)
    if name == "cases.jsonl":
        (d / name).unlink()
    _fifo_or_folder(d / name, kind)
    assert report(tmp_path, d) == (2, None) and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    said = {"fifo": "is not a regular file", "folder": "is a folder",
            "huge": "is 1,073,741,825 bytes, more than the limit of 1,073,741,824 bytes"}
    assert f"error: run {d}: cannot read {name}: {said[kind]}" in err
    if name == "locality.json":  # also where only a merged report's locality.json could be
        (d / "cases.jsonl").unlink()
        assert report(tmp_path, d) == (2, None)
        assert f"error: run {d}: no cases.jsonl" in capsys.readouterr().err
