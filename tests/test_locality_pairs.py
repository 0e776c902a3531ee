"""The study's pair protocol on the dispatch core (``sut/locality/{systems,burst,pairs,runner}.py``) with the
fake transport of ``tests/transport_doubles.py``: order alternation, fresh transports per case, warm-ups,
medians and ratios, placement checks, validation failures that name the request (exit 1), bad input that
exits 2 before anything starts; the ledger's stall watchdog; and one real CPU run of both systems (slow)."""

import json
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import transport_doubles  # noqa: F401 - registers the "fake" transport
from conftest import REPO, SHARED_DATA, TINY_MODEL, sut_env
from transport_doubles import FakeTransport

from sut.core.routing import AffinitySettings, make_router
from sut.core.transport import TransportSpec, register_transport
from sut.engine import EngineSettings, GenerationSettings
from sut.errors import RunFailed
from sut.ledger.sample import SampleLedger
from sut.locality import RUN_SUFFIX
from sut.locality.burst import BurstSettings, run_burst
from sut.locality.pairs import PairSettings, StudyContext, case_order, run_pairs
from sut.locality.runner import prepare_trace, run_study
from sut.locality.systems import SYSTEMS, SystemSpec, parse_system_options, resolve_systems
from sut.locality.trace import TraceSettings

TRACE = TraceSettings(documents=4, doc_tokens=100, questions=3, max_tokens=4, seed=3)


@register_transport("fake-mutating")
class MutatingTransport(FakeTransport):
    """Changes request 3's prompt in place after taking it (a transport that writes into shared arrays)."""

    def submit(self, replica, requests):
        for r in requests:
            if r.rid == 3:
                r.prompt[-1] = (r.prompt[-1] + 1) % 1000
        super().submit(replica, requests)


@register_transport("fake-elsewhere")
class ElsewhereTransport(FakeTransport):
    """Reports its replicas on other devices than the fake transport does."""

    def start(self, sink):
        recs = super().start(sink)
        for r in recs:
            r.info["device"] = {"kind": "fake", "name": "fake", "uuid": f"OTHER-{r.index}"}
        return recs


def fake(transport="fake", **opts):
    return SystemSpec(transport, dict({"out_len": 4, "prefix_caching_on": True}, **opts), replicas_field="replicas")


@pytest.fixture
def systems(monkeypatch):
    """'standalone' and 'flame' as fake transports (so the pair report computes flame / standalone)."""
    log = []
    monkeypatch.setitem(SYSTEMS, "standalone", fake(log=log))
    monkeypatch.setitem(SYSTEMS, "flame", fake(log=log, step_s=0.002))
    return log


def context(tmp_path, warmups=2, trace=TRACE):
    prep = prepare_trace(trace, warmups)
    ctx = StudyContext(prep.trace, prep.warmups, prep.input_hashes, EngineSettings(model=str(TINY_MODEL)),
                       GenerationSettings(max_tokens=trace.max_tokens, ignore_eos=True),
                       AffinitySettings(block_tokens=16), tmp_path, trace.max_tokens)
    return prep, ctx


# ------------------------------------------------------------------------------------------- protocol
def test_systems_alternate_and_every_case_starts_a_fresh_transport(systems, tmp_path, caplog):
    order = case_order(["standalone", "flame"], ["prefix_affinity", "round_robin"], 3)
    assert [(c.pair, c.policy, c.system) for c in order[:8]] == [
        (0, "prefix_affinity", "standalone"), (0, "prefix_affinity", "flame"),
        (0, "round_robin", "standalone"), (0, "round_robin", "flame"),
        (1, "round_robin", "flame"), (1, "round_robin", "standalone"),
        (1, "prefix_affinity", "flame"), (1, "prefix_affinity", "standalone")]
    assert [c.order for c in order] == list(range(12))
    prep, ctx = context(tmp_path)
    ps = PairSettings(policies=("prefix_affinity", "round_robin"), pairs=2, progress=False)
    with caplog.at_level("INFO", logger="sut.locality"):
        record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx, ps, {})
    assert error is None and record["status"] == "ok"
    said = [r.getMessage() for r in caplog.records]  # the engine start is no longer a silent stretch
    assert sum("starting 2 replica(s) (fresh engines)" in m for m in said) == 8
    assert sum(m.endswith("(fresh engines) and a Flame session") for m in said) == 4
    assert sum("replicas ready in " in m for m in said) == 8
    cases = record["cases"]
    assert [(c["pair"], c["system"], c["policy"]) for c in cases] == \
        [(c.pair, c.system, c.policy) for c in case_order(["standalone", "flame"], ["prefix_affinity", "round_robin"], 2)]
    # one fresh transport per case: each started, then stopped before the next one starts (never reused)
    assert [w for w, _ in systems] == ["start", "stop"] * 8
    assert all(systems[i][1] == systems[i + 1][1] for i in range(0, 16, 2))
    for c in cases:
        assert [w["requests"] for w in c["warmups"]] == [12, 12]
        assert c["timed"]["requests"] == 12 and c["timed"]["output_tokens"] == 48
        assert c["validation"] == {"requests_checked": 12, "failures": 0} and len(c["output_hashes"]) == 12
        assert c["cleanup"]["stopped"] and c["cleanup"]["processes_left"] == []
        assert [p["key"] for p in c["placement"]] == ["fake:FAKE-0", "fake:FAKE-1"]
        if c["policy"] == "prefix_affinity":  # the router of the timed burst alone: 4 documents x 3 questions
            assert c["routing"]["affinity_hits"] == 8 and c["routing"]["new_prefixes"] == 4
    # medians and ratios: the report is the study's arithmetic over these very runs
    runs = record["runs"]
    assert len(runs) == 8
    rep = record["report"]
    aff = {r["pair"]: r["requests_per_s"] for r in runs if r["policy"] == "prefix_affinity" and r["system"] == "flame"}
    base = {r["pair"]: r["requests_per_s"] for r in runs if r["policy"] == "prefix_affinity" and r["system"] == "standalone"}
    ratios = [aff[p] / base[p] for p in (0, 1)]
    got = rep["pair_ratios"]["prefix_affinity"]
    assert [x["ratio"] for x in got["per_pair"]] == pytest.approx(ratios)
    assert got["median"] == pytest.approx(np.median(ratios)) and got["min"] == pytest.approx(min(ratios))
    assert ratios[0] < 0.9  # the fake "flame" sleeps twice as long per request
    st = rep["runs"]["standalone"]["prefix_affinity"]["requests_per_s"]
    assert st["median"] == pytest.approx(np.median(list(base.values())))
    assert "standalone" in rep["policy_ratios"] and "flame" in rep["policy_ratios"]
    assert rep["runs"]["flame"]["prefix_affinity"]["cached_share"]["median"] > \
        rep["runs"]["flame"]["round_robin"]["cached_share"]["median"]
    saved = json.loads((tmp_path / "locality.json").read_text())
    assert saved["mlperf"] is False and saved["trace_hash"] == record["trace_hash"] and len(saved["input_hashes"]) == 12
    lines = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert [(c["system"], c["pair"]) for c in lines] == [(c["system"], c["pair"]) for c in saved["cases"]]
    assert [w["shift"] for w in saved["warmups"]] == prep.shifts and (tmp_path / "locality.png").stat().st_size > 10_000


def test_warmups_use_shifted_ids_and_their_own_request_ids(systems, tmp_path):
    seen = []

    class Spy(FakeTransport):
        def submit(self, replica, requests):
            seen.extend((r.rid, r.prompt[1]) for r in requests)
            super().submit(replica, requests)

        def mark_timed(self):  # the transport learns where the warm-ups end (Flame counts batches apart)
            seen.append(("timed", None))

    register_transport("fake-spy")(Spy)
    SYSTEMS["standalone"] = fake("fake-spy")
    prep, ctx = context(tmp_path)
    _, error = run_pairs(resolve_systems(["standalone"], 2), ctx, PairSettings(policies=("round_robin",), pairs=1,
                                                                              progress=False))
    assert error is None
    assert [i for i, (rid, _) in enumerate(seen) if rid == "timed"] == [24]  # once, after both warm-ups
    seen.pop(24)
    rids = [rid for rid, _ in seen]
    assert sorted(rids[:12]) == [1_000_000 + i for i in range(12)]
    assert sorted(rids[12:24]) == [2_000_000 + i for i in range(12)]
    assert sorted(rids[24:]) == list(range(12))
    firsts = {int(r.prompt[1]) for r in prep.trace}
    assert firsts.isdisjoint({int(x) for _, x in seen[:24]}) and {int(x) for _, x in seen[24:]} == firsts


# ------------------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("opts, message", [
    ({"short_output": {5: 3}}, "request 5 (trace request 5): replica 1 answered 3 generated ids, the generation settings ask for exactly 4"),
    ({"duplicate": 7}, "request 7 was answered twice or never issued"),
    ({"wrong_replica": 2}, "request 2 (trace request 2) was routed to replica"),
    ({"die_after": {1: 2}}, "fake replica 1 died"),
    ({"step_s": 1.5}, "no request completed for 1 s with"),
])
def test_a_broken_burst_fails_naming_the_request(systems, tmp_path, opts, message):
    prep, ctx = context(tmp_path, warmups=0)
    SYSTEMS["standalone"] = fake(**opts)
    ps = PairSettings(policies=("round_robin",), pairs=1, progress=False, stall_timeout_s=1.0)
    t0 = time.monotonic()
    record, error = run_study(resolve_systems(["standalone"], 2), prep, ctx, ps, {})
    assert time.monotonic() - t0 < 15
    assert error is not None and message in error and error.startswith("pair0-standalone-round_robin: ")
    saved = json.loads((tmp_path / "locality.json").read_text())
    assert saved["status"] == "failed" and message in saved["error"] and "report" not in saved
    assert saved["cases"][-1]["cleanup"]["stopped"]


def test_input_hash_mismatch_names_the_request(systems, tmp_path):
    """A transport that writes into the trace's arrays: the next case sends another prompt for request 3."""
    prep, ctx = context(tmp_path, warmups=0)
    SYSTEMS["standalone"] = fake("fake-mutating")
    ps = PairSettings(policies=("round_robin",), pairs=2, progress=False)
    record, error = run_study(resolve_systems(["standalone"], 2), prep, ctx, ps, {})
    assert record["cases"][0].get("error") is None
    assert error.startswith("pair1-standalone-round_robin: validation of the burst's requests failed for 1 check(s): "
                            "request 3: input hash ")
    assert "!= the trace's " + prep.input_hashes[3][:12] in error


def test_run_burst_validates_against_the_recorded_hashes(tmp_path):
    prep, _ = context(tmp_path, warmups=0)
    t = FakeTransport(TransportSpec(EngineSettings(model=str(TINY_MODEL)), GenerationSettings(),
                                    transport_doubles.FakeOptions()))
    t.start(None)
    try:
        res = run_burst(t, make_router("round_robin", 2, 4), prep.trace, BurstSettings(max_tokens=4), prep.input_hashes)
        assert res.metrics["requests"] == 12 and res.metrics["cached_share"] is not None
        assert [p["requests"] for p in res.metrics["per_replica"]] == [6, 6]
        wrong = list(prep.input_hashes)
        wrong[4] = "0" * 64
        with pytest.raises(RunFailed, match="request 4: input hash .* != the trace's 000000000000"):
            run_burst(t, make_router("round_robin", 2, 4), prep.trace, BurstSettings(max_tokens=4, first_id=100), wrong)
    finally:
        t.stop()


def test_placement_must_match_across_systems(systems, tmp_path):
    SYSTEMS["flame"] = fake("fake-elsewhere")
    prep, ctx = context(tmp_path, warmups=0)
    record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx,
                              PairSettings(policies=("round_robin",), pairs=1, progress=False), {})
    assert "placement differs: pair0-flame-round_robin has replica 0 on fake:OTHER-0, " \
           "pair0-standalone-round_robin had it on fake:FAKE-0" in error


def test_prefix_caching_must_be_on(systems, tmp_path):
    SYSTEMS["standalone"] = fake(prefix_caching_on=False)
    prep, ctx = context(tmp_path, warmups=0)
    _, error = run_pairs(resolve_systems(["standalone"], 2), ctx, PairSettings(policies=("round_robin",), pairs=1,
                                                                              progress=False))
    assert "replica 0 reports prefix caching off" in error


def test_system_options_and_unavailable_transports(systems, monkeypatch):
    assert parse_system_options(["flame.step_s=0.5", "flame.log=null", "standalone.out_len=4"]) == \
        {"flame": {"step_s": 0.5, "log": None}, "standalone": {"out_len": 4}}
    with pytest.raises(ValueError, match="expected SYSTEM.KEY=VALUE"):
        parse_system_options(["batch_size=4"])
    (s,) = resolve_systems(["flame"], 3, {"flame": {"step_s": 0.5}})
    assert s.options.replicas == 3 and s.options.step_s == 0.5 and s.options.out_len == 4
    with pytest.raises(ValueError, match="FakeOptions.step_s must be a number"):
        resolve_systems(["flame"], 2, {"flame": {"step_s": "fast"}})
    with pytest.raises(ValueError, match="unknown FakeOptions field"):
        resolve_systems(["flame"], 2, {"flame": {"nope": 1}})
    with pytest.raises(ValueError, match="not among --systems"):
        resolve_systems(["flame"], 2, {"standalone": {"out_len": 1}})
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        resolve_systems(["vllm"], 2)
    monkeypatch.setitem(SYSTEMS, "ghost", SystemSpec("no-such-transport"))
    with pytest.raises(ValueError, match="system ghost: its transport 'no-such-transport' is not available here"):
        resolve_systems(["ghost"], 2)


# ------------------------------------------------------------------------------------------ the CLI
def cli(tmp_path, *args):
    from sut.locality.__main__ import main

    return main(["run", "--model", str(TINY_MODEL), "--device", "cpu", "--engines-per-device", "2", "--documents", "3",
                 "--doc-tokens", "100", "--questions", "2", "--max-tokens", "4", "--output-dir", str(tmp_path / "out"),
                 "--no-progress", "--block-tokens", "16", *args])


def test_cli_runs_fake_systems_and_a_failed_check_exits_1_naming_the_request(systems, tmp_path, capsys):
    assert cli(tmp_path, "--systems", "standalone", "flame", "--policies", "prefix_affinity", "--pairs", "2") == 0
    out = capsys.readouterr().out
    assert "flame / standalone, prefix_affinity: median" in out and "NOT an MLPerf result" in out
    (run,) = (tmp_path / "out").iterdir()
    assert run.name.endswith(RUN_SUFFIX) and (run / "locality.png").is_file()
    rec = json.loads((run / "locality.json").read_text())
    assert rec["status"] == "ok" and rec["model"]["revision"] and rec["router_settings"]["model_revision"]
    assert rec["generation"]["ignore_eos"] is True and rec["engine_settings"]["enable_prefix_caching"] is True
    assert rec["runtime"]["python"] and "harness_commit" in rec["runtime"]
    SYSTEMS["flame"] = fake(short_output={2: 1})
    assert cli(tmp_path, "--systems", "standalone", "flame", "--policies", "round_robin", "--pairs", "1",
               "--run-name", "bad") == 1
    captured = capsys.readouterr()
    assert "request 2 (trace request 2): replica 0 answered 1 generated ids, the generation settings ask for exactly 4" in (
        captured.out + captured.err)  # the dispatcher's check, before the burst's own validation
    rec = json.loads((tmp_path / "out" / ("bad" + RUN_SUFFIX) / "locality.json").read_text())
    assert rec["status"] == "failed" and "request 2 (trace request 2): replica 0 answered 1 generated ids" in rec["error"]
    SYSTEMS["flame"] = fake(answers={2: [11, 200000, 12, 13]})  # the model's vocabulary: 128,256 ids
    assert cli(tmp_path, "--systems", "flame", "--policies", "round_robin", "--pairs", "1", "--run-name", "oov") == 1
    rec = json.loads((tmp_path / "out" / ("oov" + RUN_SUFFIX) / "locality.json").read_text())
    assert "request 2 (trace request 2): replica 0 answered id 200000 at position 1 of 4, outside the model's " \
           "vocabulary [0, 128256)" in rec["error"]


@pytest.mark.parametrize("args, message", [
    (["--systems", "standalone", "vllm"], "unknown system 'vllm'"),
    (["--systems", "flame", "flame"], "systems must be distinct"),
    (["--policies", "random"], "unknown policy"),
    (["--pairs", "0"], "pairs must be in [1, 1000]"),
    (["--pairs", "1000000000000"], "pairs must be in [1, 1000]"),  # memory grew, nothing started
    (["--arrival-seed", "-1", "--rate", "2"], "arrival_seed must be >= 0"),  # was a traceback after engine start
    (["--seed", "-5"], "seed must be >= 0"),
    (["--engine-seed", "-5"], "--engine-seed must be in [0, 4294967295]"),
    (["--engine-seed", "4294967296"], "--engine-seed must be in [0, 4294967295]"),  # vLLM failed after start
    (["--warmups", "1000000000"], "warmups must be in [0, 20]"),  # a recheck's find: it spun at 100 % CPU
    (["--documents", "100000000", "--doc-tokens", "1"], "more than this tool builds (100,000 requests"),
    (["--warmups", "-1"], "warmups must be in [0, 20]"),
    (["--max-model-len", "150"], "below the longest prompt"),
    (["--doc-tokens", "8000"], "exceeds the model's max_position_embeddings 8192"),
    (["--system-option", "flame.nope=1", "--systems", "flame"], "unknown FakeOptions field"),
    (["--http", "--server-url", "http://127.0.0.1:1"], "give one of them"),
    (["--server-url", "http://127.0.0.1:1"], "system standalone: server http://127.0.0.1:1"),  # not `sut run`'s flag
    (["--server-url", "http://127.0.0.1:1,http://127.0.0.1:2"], "server http://127.0.0.1:1:"),  # a comma list
    (["--server-url", "http://127.0.0.1:1", "--server-url", "http://127.0.0.1:1"], "is given twice"),  # both kept
    (["--http", "--system-option", "standalone.server_args=--enable-prefix"], "system standalone"),
])
def test_cli_bad_input_exits_2_before_anything_starts(systems, tmp_path, capsys, args, message):
    assert cli(tmp_path, *args) == 2
    assert message in capsys.readouterr().err
    assert systems == [] and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- ledger
def test_ledger_first_id_and_stall_watchdog():
    got = []
    led = SampleLedger((), progress=False, complete_fn=got.extend, first_id=500)

    class S:
        def __init__(self, i):
            self.id, self.index = i, i

    assert led.issue([S(0), S(1)]) == [(500, 0), (501, 1)]
    led.complete([(500, np.array([1, 2], np.int32))])
    assert not led.check_stall(60.0)
    assert led.check_stall(0.0, now=time.monotonic() + 1) and "with 1 outstanding (stall)" in led.error
    assert led.wait_idle(1.0) == led.error and led.answered_empty == 1


# ------------------------------------------------------------------------------------ real engines
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_real_cpu_run_of_both_systems_through_the_flame_standin(tmp_path):
    """Two CPU engines per system (tiny model), the Flame system through the stand-in control plane:
    both systems validated on every request, replica r on the same CPU slot on both, the pair report with
    flame / standalone and the figure."""
    import sut.flame.transport  # noqa: F401
    from tests import flame_standin as standin
    lock_dir = tempfile.mkdtemp(prefix="loc-", dir="/tmp")
    data = ["--text", "news", "--dataset", str(SHARED_DATA / "cnn_eval_public.json")] if SHARED_DATA.is_dir() else []
    cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--load-format", "dummy",
           "--dtype", "float32", "--enforce-eager", "--device", "cpu", "--engines-per-device", "2",
           "--systems", "standalone", "flame", "--policies", "prefix_affinity", "--pairs", "1",
           "--documents", "4", "--doc-tokens", "400", "--questions", "2", "--max-tokens", "8", *data,
           "--system-option", f"flame.lock_dir={lock_dir}", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    try:
        with standin.StandinCluster(tmp_path / "cluster", max_executors=16) as cluster:
            out = subprocess.run(cmd, env=dict(sut_env(), FLAME_ENDPOINT=cluster.endpoint), cwd=REPO,
                                 capture_output=True, text=True, timeout=1400)
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    (run,) = (tmp_path / "out").iterdir()
    rec = json.loads((run / "locality.json").read_text())
    assert rec["status"] == "ok" and [c["system"] for c in rec["cases"]] == ["standalone", "flame"]
    for c in rec["cases"]:
        assert c["validation"]["requests_checked"] == 8 and c["timed"]["cached_share"] is not None
        assert [p["key"] for p in c["placement"]] == ["cpu:0", "cpu:1"] and c["cleanup"]["stopped"]
    # the Flame case's engines were given the standalone case's KV cache (no profiling) and report it
    first, flame = rec["cases"]
    blocks = {r["kv_cache"]["blocks"] for r in first["replicas"]}
    assert first["kv_pinned"] is None and flame["kv_pinned"]["blocks"] in blocks and len(blocks) == 1
    assert [r["kv_cache"]["blocks"] for r in flame["replicas"]] == [flame["kv_pinned"]["blocks"]] * 2
    assert "flame / standalone, prefix_affinity: median" in out.stdout and (run / "locality.png").is_file()
    # the record says the control plane was the stand-in: its flame / standalone ratios are no result
    assert flame["transport_stats"]["flame"]["control_plane"] == "stand-in"
    assert any(n.startswith("the Flame control plane was the test stand-in") for n in rec["notes"]), rec["notes"]
    assert "note: the Flame control plane was the test stand-in" in out.stdout


# --------------------------------------------------------------------------------- benchmark script
def test_bench_script_checks_the_targets_of_recorded_runs(tmp_path, capsys):
    import importlib.util

    from sut.locality.study import pair_report

    spec = importlib.util.spec_from_file_location("bench_locality", REPO / "scripts" / "bench" / "bench_locality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = []
    for p, ratio in enumerate([0.996, 0.999, 0.989]):
        for system, f in (("standalone", 1.0), ("flame", ratio)):
            runs.append({"system": system, "policy": "prefix_affinity", "pair": p, "requests_per_s": 28 * f,
                         "output_tokens_per_s": 448 * f, "cached_share": 0.749})
            runs.append({"system": system, "policy": "round_robin", "pair": p, "requests_per_s": 15.0,
                         "output_tokens_per_s": 240.0, "cached_share": 0.2})
    record = {"status": "ok", "trace_preset": "study-reuse", "report": pair_report(runs), "notes": ["one GPU"]}
    rows = {what: (v, met) for what, v, _, _, met in bench.targets(record)}
    assert rows["flame / standalone, prefix_affinity, median"] == (pytest.approx(0.996), True)
    assert rows["flame / standalone, prefix_affinity, worst pair"] == (pytest.approx(0.989), False)
    assert rows["standalone: prefix_affinity / round_robin"] == (pytest.approx(28 / 15), True)
    assert rows["flame: prefix_affinity / round_robin"] == (pytest.approx(28 * 0.996 / 15), True)
    assert rows["flame: cached share with prefix_affinity"] == (pytest.approx(0.749), True)
    run = tmp_path / "bench-study-reuse-SYNTHETIC-LOCALITY-NOT-MLPERF"
    run.mkdir()
    (run / "locality.json").write_text(json.dumps(record))
    assert bench.main(["--check", str(run)]) == 0
    assert bench.main(["--check", str(run), "--require-targets"]) == 1
    out = capsys.readouterr().out
    assert "worst pair" in out and "MISSED" in out and "98.90%" in out and "note: one GPU" in out
    no_reuse = dict(record, trace_preset="study-no-reuse")
    assert [r[0] for r in bench.targets(no_reuse)] == ["flame / standalone, prefix_affinity, median"]
    assert bench.main(["--check", str(tmp_path / "missing")]) == 1


def test_every_system_must_run_as_many_replicas(systems, tmp_path):
    SYSTEMS["flame"] = SystemSpec("fake", {"out_len": 4, "prefix_caching_on": True, "replicas": 1})
    prep, ctx = context(tmp_path, warmups=0)
    _, error = run_pairs(resolve_systems(["standalone", "flame"], 2), ctx,
                         PairSettings(policies=("round_robin",), pairs=1, progress=False))
    assert "pair0-flame-round_robin has 1 replica(s), pair0-standalone-round_robin had 2" in error


def test_the_flame_system_needs_a_control_plane_that_answers(tmp_path, monkeypatch):
    import flamepy  # noqa: F401
    monkeypatch.delenv("FLAME_ENDPOINT", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.flame/flame.yaml
    with pytest.raises(ValueError, match="system flame: no Flame endpoint: .*python -m sut.flame cluster"):
        resolve_systems(["flame"], 2)
    monkeypatch.setenv("FLAME_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ValueError, match="no Flame session manager answers at http://127.0.0.1:9"):
        resolve_systems(["flame"], 2)
    assert cli(tmp_path, "--systems", "standalone", "flame") == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("finished_before_stop", [1, 0])
def test_a_stopped_run_keeps_its_finished_cases_or_leaves_nothing(systems, tmp_path, monkeypatch, caplog,
                                                                  finished_before_stop):
    """Ctrl-C / SIGTERM after finished cases removed the run folder, cases.jsonl included, though
    docs/locality.md promises a cut-off run keeps what it finished."""
    import sut.locality.runner as runner

    real, calls = runner.append_case, []

    def stop_after(d, rec):
        if len(calls) == finished_before_stop:
            raise KeyboardInterrupt  # as stop_on_sigterm_like_ctrl_c turns SIGTERM into
        calls.append(rec)
        real(d, rec)

    monkeypatch.setattr(runner, "append_case", stop_after)
    assert cli(tmp_path, "--systems", "standalone", "flame", "--policies", "round_robin", "--pairs", "2",
               "--run-name", "cut", "--output-dir", str(tmp_path / "out" / "a" / "b")) == 130
    run = tmp_path / "out" / "a" / "b" / ("cut" + RUN_SUFFIX)
    if finished_before_stop:
        rec = json.loads((run / "locality.json").read_text())
        assert rec["status"] == "interrupted" and "interrupted after 1 finished case(s)" in rec["error"]
        assert len(rec["cases"]) == 1 and len((run / "cases.jsonl").read_text().splitlines()) == 1
        assert rec["mlperf"] is False and "report" not in rec
        assert "kept the finished cases in" in caplog.text
    else:
        assert not (tmp_path / "out").exists()  # the run folder and every folder of --output-dir this run made
        (tmp_path / "kept").mkdir()
        assert cli(tmp_path, "--systems", "standalone", "--policies", "round_robin", "--pairs", "1", "--run-name", "k",
                   "--output-dir", str(tmp_path / "kept" / "x")) == 130
        assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "x").exists()  # what was there stays


def test_an_unexpected_error_mid_run_is_recorded_as_the_runs_failure(systems, tmp_path, monkeypatch):
    """An error no check named (then: a negative --arrival-seed, after the engines started) left
    only run_header.json, no locality.json saying the run failed."""
    import sut.locality.runner as runner

    real, calls = runner.append_case, []

    def fail_second(d, rec):
        if calls:
            raise RuntimeError("boom")
        calls.append(rec)
        real(d, rec)

    monkeypatch.setattr(runner, "append_case", fail_second)
    assert cli(tmp_path, "--systems", "standalone", "flame", "--policies", "round_robin", "--pairs", "1",
               "--run-name", "err") == 1
    rec = json.loads((tmp_path / "out" / ("err" + RUN_SUFFIX) / "locality.json").read_text())
    assert rec["status"] == "failed" and rec["error"] == "unexpected error after 1 finished case(s): RuntimeError: boom"
    assert len(rec["cases"]) == 1


def test_a_preset_whose_shape_flags_changed_says_so_in_the_record(systems, tmp_path):
    """A user's find: `--trace-preset study-reuse --documents 6...` recorded trace_preset study-reuse with no
    word that the trace was not the preset's."""
    assert cli(tmp_path, "--trace-preset", "study-reuse", "--text", "random", "--systems", "standalone",
               "--policies", "round_robin", "--pairs", "1", "--run-name", "pre") == 0
    rec = json.loads((tmp_path / "out" / ("pre" + RUN_SUFFIX) / "locality.json").read_text())
    assert rec["trace_preset"] == "study-reuse"
    assert "--trace-preset study-reuse: documents 3 given instead of the preset's 64" in rec["notes"]
    assert not any("rate" in n or "release_gate" in n for n in rec["notes"])  # the preset's own values, not given


# ------------------------------------------------------------------- KV cache sized by the first case
def _kv_systems(monkeypatch, **opts):
    seen = []
    for name in ("standalone", "flame"):
        monkeypatch.setitem(SYSTEMS, name, fake(**{"kv_tokens": 1600, "kv_bytes_per_block": 4096, "engines": seen, **opts}))
    return seen


def test_later_cases_get_the_first_cases_kv_cache_and_each_case_profiles_on_request(monkeypatch, tmp_path):
    seen = _kv_systems(monkeypatch)
    (tmp_path / "a").mkdir()
    prep, ctx = context(tmp_path / "a")
    ps = PairSettings(policies=("round_robin",), pairs=2, progress=False)
    record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx, ps, {})
    assert error is None and len(seen) == 4
    assert seen[0].kv_cache_memory_bytes is None and seen[0].num_gpu_blocks_override is None  # profiles
    assert {(e.num_gpu_blocks_override, e.kv_cache_memory_bytes) for e in seen[1:]} == {(100, 100 * 4096)}
    first = "pair0-standalone-round_robin"
    assert record["cases"][0]["kv_pinned"] is None
    assert [c["kv_pinned"] for c in record["cases"][1:]] == \
        [{"blocks": 100, "bytes_per_block": 4096, "bytes": 409600, "case": first}] * 3
    assert json.loads((tmp_path / "a" / "locality.json").read_text())["pair_settings"]["kv_sizing"] == "first-case"

    seen.clear()
    (tmp_path / "b").mkdir()
    prep, ctx = context(tmp_path / "b")
    ps = PairSettings(policies=("round_robin",), pairs=2, progress=False, kv_sizing="each-case")
    record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx, ps, {})
    assert error is None and [(e.num_gpu_blocks_override, e.kv_cache_memory_bytes) for e in seen] == [(None, None)] * 4
    assert all(c["kv_pinned"] is None for c in record["cases"])


def test_no_pin_without_bytes_per_block_and_a_case_that_ignores_the_pin_fails(monkeypatch, tmp_path):
    seen = _kv_systems(monkeypatch, kv_bytes_per_block=None)
    (tmp_path / "a").mkdir()
    prep, ctx = context(tmp_path / "a")
    ps = PairSettings(policies=("round_robin",), pairs=1, progress=False)
    record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx, ps, {})
    assert error is None and [e.kv_cache_memory_bytes for e in seen] == [None, None]

    _kv_systems(monkeypatch, kv_ignore_override=True)
    monkeypatch.setitem(SYSTEMS, "standalone", fake(kv_tokens=3200, kv_bytes_per_block=4096))
    (tmp_path / "b").mkdir()
    prep, ctx = context(tmp_path / "b")
    record, error = run_study(resolve_systems(["standalone", "flame"], 2), prep, ctx, ps, {})
    assert error and "replica 0 reports 100 KV-cache blocks, but its engine was given" in error
    assert error.startswith("pair0-flame-round_robin: replica 0 reports")  # the case named once
    assert "'s 200 (--kv-sizing first-case); run with --kv-sizing each-case" in error
    assert record["status"] == "failed" and len(record["cases"]) == 2


def test_kv_pin_needs_one_size_on_every_replica():
    from sut.locality.kv_pin import pin_from, pinned_engine

    def info(blocks, per_block):
        return {"kv_cache": {"blocks": blocks, "bytes_per_block": per_block}}

    assert pin_from([info(10, 8), info(10, 8)], "c0") == {"blocks": 10, "bytes_per_block": 8, "bytes": 80, "case": "c0"}
    assert pin_from([info(10, 8), info(11, 8)], "c0") is None  # replicas on different cards
    assert pin_from([info(10, None), info(10, None)], "c0") is None  # a record without bytes per block
    assert pin_from([{}, {}], "c0") is None and pin_from([], "c0") is None
    es = EngineSettings(model=str(TINY_MODEL))
    assert pinned_engine(es, None) is es
    got = pinned_engine(es, {"blocks": 10, "bytes": 80})
    assert (got.num_gpu_blocks_override, got.kv_cache_memory_bytes) == (10, 80)
    assert got.vllm_kwargs()["kv_cache_memory_bytes"] == 80 and got.vllm_kwargs()["num_gpu_blocks_override"] == 10
    with pytest.raises(ValueError, match="kv_sizing must be one of first-case, each-case"):
        PairSettings(kv_sizing="every-case")


def test_a_pinned_system_whose_replicas_report_no_kv_cache_is_not_failed(monkeypatch, tmp_path, caplog):
    """``--systems flame standalone --http``: the Flame case sets the pin; the ``vllm serve`` fleet that follows
    (started with --disable-log-stats: no blocks in its record) is given the cache but cannot confirm it; that
    is recorded and logged, not a failure of the run (the engines were given the same cache)."""
    seen = []
    monkeypatch.setitem(SYSTEMS, "flame", fake(kv_tokens=1600, kv_bytes_per_block=4096, engines=seen))
    monkeypatch.setitem(SYSTEMS, "standalone", fake(engines=seen))  # reports no kv_cache at all
    prep, ctx = context(tmp_path)
    ps = PairSettings(policies=("round_robin",), pairs=1, progress=False)
    record, error = run_study(resolve_systems(["flame", "standalone"], 2), prep, ctx, ps, {})
    assert error is None, error
    assert [(e.num_gpu_blocks_override, e.kv_cache_memory_bytes) for e in seen] == [(None, None), (100, 409600)]
    pinned = record["cases"][1]
    assert pinned["kv_pinned"]["blocks"] == 100 and pinned["kv_pin_unconfirmed"] == [0, 1]
    assert "kv_pin_unconfirmed" not in record["cases"][0]
    assert "replicas 0, 1 report no KV-cache blocks: the pinned cache (100 blocks) is not confirmed" in caplog.text
