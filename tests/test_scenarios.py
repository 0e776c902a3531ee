"""Server and Interactive scenarios without engines: names and model keys, the streaming worker's
per-step split (typed first tokens and completions), the vllm SUT's routing policies, the target_qps search, and the multi-scenario submission tree."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, sut_env

from sut.errors import ScenarioError
from sut.findqps import cli as find_qps
from sut.scenarios import NO_FIRST_TOKEN, check_backend, resolve_scenario


# ------------------------------------------------------------------------------------- names
def test_interactive_is_a_loadgen_server_run_with_the_interactive_key():
    s = resolve_scenario("Interactive")
    assert (s.loadgen, s.model_key, s.streaming) == ("Server", "llama3_1-8b-interactive", True)
    s = resolve_scenario("Server")
    assert (s.loadgen, s.model_key, s.streaming) == ("Server", "llama3_1-8b", True)
    s = resolve_scenario("Offline", "llama3_1-8b-edge")
    assert (s.loadgen, s.model_key, s.streaming) == ("Offline", "llama3_1-8b-edge", False)


def test_model_keys_are_spelt_only_in_sut_constants():
    """One scenario -> model key mapping (``sut.constants.SCENARIO_MODEL_KEYS``): no other module of sut/,
    scripts/ or accuracy/ has a model key as a string literal (docstrings and messages built from the
    constants aside), so a renamed key cannot leave a stale copy behind."""
    import ast

    from sut.constants import MODEL_KEYS

    found = []
    for path in sorted(p for d in ("sut", "scripts", "accuracy") for p in (REPO / d).rglob("*.py")):
        if path == REPO / "sut" / "constants.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in docs and any(k in n.value for k in MODEL_KEYS)]
    assert not found


@pytest.mark.parametrize("scenario,key,message", [
    ("server", None, "case-sensitive: 'Server'"),
    ("interactive", None, "case-sensitive: 'Interactive'"),
    ("SingleStream", None, "is not one of"),
    ("Server", "llama3_1-8b-interactive", "use --scenario Interactive"),
    ("Interactive", "llama3_1-8b", "llama3_1-8b-interactive"),
    ("Server", "llama3_1-8b-edge", "edge benchmark has no Server"),
    ("Offline", "llama3_1-8b-interactive", "use --scenario Interactive"),
    ("Server", "llama3.1-8b", "LoadGen model keys"),
])
def test_wrong_scenario_or_model_key_is_refused(scenario, key, message):
    with pytest.raises(ScenarioError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve_scenario(scenario, key)


SERVER_SNIPPET = """
import json, sys
from sut.settings.run import RunSettings
from sut.settings.loadgen import loadgen_test_settings
kw = json.loads(sys.argv[1])
ts, reasons = loadgen_test_settings(RunSettings(**kw), 13368)
print(json.dumps({"qps": ts.server_target_qps, "ttft": ts.ttft_latency, "tpot": ts.tpot_latency, "scenario": int(ts.scenario),
                  "tokens": ts.use_token_latencies, "pct": ts.server_target_latency_percentile, "reasons": reasons}))
"""


def _settings(**kw):
    base = dict(dict(sut="vllm", dataset="x.json", user_conf=str(REPO / "loadgen_configs" / "cpu_tiny.user.conf")), **kw)
    out = subprocess.run([sys.executable, "-c", SERVER_SNIPPET, json.dumps(base)], capture_output=True, text=True,
                         env=sut_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_shipped_cpu_user_conf_gives_server_and_interactive_their_own_qps_and_limits(tmp_path):
    import mlperf_loadgen as lg

    s = _settings(scenario="Server")
    assert (s["qps"], s["ttft"], s["tpot"], s["pct"], s["tokens"]) == (4.0, 2_000_000_000, 100_000_000, 0.99, True)
    assert s["scenario"] == int(lg.TestScenario.Server) and s["reasons"] == []
    s = _settings(scenario="Interactive")
    assert (s["qps"], s["ttft"], s["tpot"]) == (0.5, 500_000_000, 30_000_000) and s["reasons"] == []
    assert s["scenario"] == int(lg.TestScenario.Server)
    loose = tmp_path / "loose.conf"
    loose.write_text("llama3_1-8b.Server.target_qps = 4\nllama3_1-8b.Server.ttft_latency = 5000\n")
    s = _settings(scenario="Server", user_conf=str(loose))
    assert any("ttft_latency" in r for r in s["reasons"])  # a looser limit than mlperf.conf's is not compliant


def test_a_conf_with_offline_lines_only_serves_a_server_search_with_target_qps_on_the_command_line():
    """python -m sut find-qps tries pass --target-qps with a shipped H200 user.conf whose only line is Offline's
    (the first H200 search exited 2 here): the target comes from the command line, the rest from mlperf.conf."""
    import mlperf_loadgen as lg

    conf = str(REPO / "loadgen_configs" / "h200_bf16.user.conf")
    for scen, qps in (("Server", 48.0), ("Interactive", 20.0)):
        s = _settings(scenario=scen, user_conf=conf, target_qps=qps)
        assert s["qps"] == qps and s["scenario"] == int(lg.TestScenario.Server)
        assert any("target_qps set on the command line" in r for r in s["reasons"])
    out = subprocess.run([sys.executable, "-c", SERVER_SNIPPET, json.dumps(dict(sut="vllm", dataset="x.json",
                         user_conf=conf, scenario="Server"))], capture_output=True, text=True, env=sut_env(), cwd=REPO,
                         timeout=120)
    assert out.returncode != 0 and "no line applies to this run (llama3_1-8b.Server)" in out.stderr  # no target at all


def test_the_shipped_h200_fp8_conf_gives_server_and_interactive_their_confirmed_targets():
    """h200_fp8.user.conf: Server 53 q/s and Interactive 43.5 q/s (each 600 s VALID on one H200, docs/benchmarks.md
    2026-12-02 and 2026-12-03); --target-qps still overrides either line (a search); Offline keeps its own line."""
    conf = REPO / "loadgen_configs" / "h200_fp8.user.conf"
    assert _settings(scenario="Server", user_conf=str(conf))["qps"] == 53.0
    assert _settings(scenario="Server", user_conf=str(conf), target_qps=54.0)["qps"] == 54.0
    inter = _settings(scenario="Interactive", user_conf=str(conf))
    assert (inter["qps"], inter["ttft"], inter["tpot"], inter["reasons"]) == (43.5, 500_000_000, 30_000_000, [])
    assert _settings(scenario="Interactive", user_conf=str(conf), target_qps=40.0)["qps"] == 40.0


def test_the_shipped_h100_fp8_conf_gives_each_scenario_its_confirmed_target():
    """h100_fp8.user.conf: Server 52 q/s (admission every 2nd step, the preset's Server engine;
    docs/results/h100_2026-12-07e/) and Interactive 44.8 q/s (docs/results/h100_2026-12-07d/), each 600 s VALID on one
    H100 80GB HBM3 next to an Offline on the same host."""
    conf = str(REPO / "loadgen_configs" / "h100_fp8.user.conf")
    assert _settings(scenario="Server", user_conf=conf)["qps"] == 52.0
    assert _settings(scenario="Interactive", user_conf=conf)["qps"] == 44.8


def test_a_conf_keyed_for_another_run_with_more_than_targets_is_still_refused_with_target_qps(tmp_path):
    """Server lines setting max_async_queries / the sample count would be ignored by an Interactive run without a word."""
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    conf = tmp_path / "server.conf"
    conf.write_text("llama3_1-8b.Server.target_qps = 20\nllama3_1-8b.Server.max_async_queries = 1\n")
    with pytest.raises(InputError, match=r"no line applies to this run \(llama3_1-8b-interactive.Server\)"):
        check_user_conf(conf, "llama3_1-8b-interactive", "Server", target_qps_given=True)
    assert check_user_conf(conf, "llama3_1-8b", "Server", target_qps_given=True) == {"target_qps": "20",
                                                                                      "max_async_queries": "1"}


def test_flame_cannot_stream_first_tokens():
    check_backend("flame", resolve_scenario("Offline"))
    for scen in ("Server", "Interactive"):
        with pytest.raises(ScenarioError, match="no first-token event"):
            check_backend("flame", resolve_scenario(scen))
    assert "flame" in NO_FIRST_TOKEN


# ------------------------------------------------------------------------------------- worker split
def _out(rid, ids, finished=False, cached=None):
    return SimpleNamespace(request_id=str(rid), outputs=[SimpleNamespace(token_ids=list(ids))], finished=finished,
                           num_cached_tokens=cached)


def test_delta_collector_reports_each_first_token_once_and_the_whole_sequence_at_the_end():
    from sut.engine import DeltaCollector
    from sut.messages import Completion, FirstToken

    col = DeltaCollector(report_firsts=True)
    col.t_add.update({"1": 0.0, "2": 0.0})
    first, done = col.step([_out(1, []), _out(2, [7])])  # 1: a prefill chunk, 2: its first token
    assert first == [FirstToken(2, 7)] and done == [] and type(first[0]) is FirstToken
    first, done = col.step([_out(1, [4]), _out(2, [8, 9])])
    assert first == [(1, 4)] and done == []
    first, done = col.step([_out(1, [5], finished=True, cached=16), _out(2, [128009], finished=True, cached=0)])
    assert first == []
    assert all(type(c) is Completion for c in done)
    assert [(c.rid, c.token_ids.tolist(), c.cached_tokens) for c in done] == [(1, [4, 5], 16), (2, [7, 8, 9, 128009], 0)]
    assert all(c.token_ids.dtype == np.int32 for c in done)
    c1, c2 = done
    assert 0.0 == c1.t_queued < c2.t_first <= c1.t_first <= c1.t_done == c2.t_done  # 2 got its first token a step earlier
    assert col.t_add == {} and col._acc == {}


def test_delta_collector_without_firsts_still_times_the_first_token():
    from sut.engine import DeltaCollector

    col = DeltaCollector(report_firsts=False)  # the locality runner's detail mode
    assert col.step([_out(3, [1])]) == ([], [])
    _, (c,) = col.step([_out(3, [2], finished=True, cached=5)])
    assert c.token_ids.tolist() == [1, 2] and c.cached_tokens == 5 and c.t_first <= c.t_done and c.t_queued is None


def test_final_collector_gives_completions_with_cached_tokens_and_no_first_token_time():
    from sut.engine import FinalCollector

    col = FinalCollector()
    col.t_add["4"] = 1.5
    firsts, done = col.step([_out(4, [9, 8], finished=True, cached=32), _out(5, [1])])
    assert firsts == [] and len(done) == 1
    (c,) = done
    assert (c.rid, c.token_ids.tolist(), c.cached_tokens, c.t_queued, c.t_first) == (4, [9, 8], 32, 1.5, None)
    assert c.t_done > c.t_queued and col.t_add == {}


# ------------------------------------------------------------------------------------- routing
def test_vllm_sut_is_the_local_transport_with_least_pending_for_streaming_scenarios():
    from sut.base import get_sut
    from sut.core.transport import transport_class

    cls = get_sut("vllm")
    assert cls.transport_name == "local" and cls.options_cls() is transport_class("local").options_cls
    pick = cls.policy_for  # an instance method that reads nothing from the instance
    assert [pick(None, s) for s in ("Offline", "Server", "Interactive")] == ["least_loaded", "least_pending",
                                                                             "least_pending"]


def test_least_pending_counts_a_repeated_first_token_once():
    from sut.core.routing import AffinitySettings, make_router

    r = make_router("least_pending", 2, 128, AffinitySettings(first_token_weight=8))
    p = np.zeros(4, np.int32)
    assert r.route(1, p) == 0 and r.route(2, p) == 1
    r.first(2)
    r.first(2)  # a repeat changes nothing
    assert (r.score(0), r.score(1)) == (9, 1)
    r.done(1)  # finished without a first token: both counters drop
    r.done(2)
    assert (r.inflight, r.waiting_first) == ([0, 0], [0, 0])


# ------------------------------------------------------------------------------------- qps search
def test_search_brackets_then_bisects_on_validity():
    calls = []

    def run(q):
        calls.append(q)
        return find_qps.Try(q, "VALID" if q <= 13 else "INVALID")

    best, tries = find_qps.search(run, start=4, factor=2, rel_tol=0.05, max_runs=20)
    assert calls[:3] == [4, 8, 16] and best is not None and 12.3 < best <= 13
    assert [t.qps for t in tries] == calls
    best, tries = find_qps.search(lambda q: find_qps.Try(q, "INVALID"), start=4, max_runs=3)
    assert best is None and [t.qps for t in tries] == [4, 2, 1]
    # a failed run is no verdict: it bounds nothing and ends the search (the same qps would come next)
    best, tries = find_qps.search(lambda q: find_qps.Try(q, None), start=1, max_runs=2)
    assert best is None and [t.qps for t in tries] == [1]
    with pytest.raises(ValueError):
        find_qps.search(run, start=0)


# ------------------------------------------------------------------------------------- submission tree
def _tree_runs(base: Path):
    from test_compliance import make_run, make_test06_run, write_log

    from accuracy.loadgen_log import encode_ids, make_log_entry

    out = {}
    for scen, key in (("Offline", "llama3_1-8b"), ("Interactive", "llama3_1-8b-interactive")):
        b = base / scen
        out[scen] = (make_run(b, "perf", "performance", scenario=scen, model_key=key),
                     make_run(b, "acc", "accuracy", scenario=scen, model_key=key),
                     make_test06_run(b, scenario=scen, model_key=key))
        if scen != "Offline":  # a streamed run logs the first token too
            entries = [dict(make_log_entry(i, ids), token_data=encode_ids(ids[:1])) for i, ids in enumerate([[1], [5]])]
            write_log(out[scen][2] / "mlperf_log_accuracy.json", entries)
    return out


def test_package_tree_lays_out_offline_and_interactive_with_src_and_systems(tmp_path):
    from test_compliance import write_system_desc

    from sut.submission.tree import SYSTEM_FIELDS, TreeSettings, package_tree

    runs = _tree_runs(tmp_path / "runs")
    ts = TreeSettings(out=str(tmp_path / "sub"), system="1xH200_vllm", submitter="Org",
                      performance_runs=(str(runs["Interactive"][0]), str(runs["Offline"][0])),
                      accuracy_runs=(str(runs["Offline"][1]), str(runs["Interactive"][1])),
                      test06_runs=(str(runs["Offline"][2]), str(runs["Interactive"][2])),
                      system_desc=str(write_system_desc(tmp_path / "system.json", framework="given")))
    root = package_tree(ts)
    assert root == tmp_path / "sub" / "closed" / "Org"
    for scen in ("Offline", "Interactive"):
        d = root / "results" / "1xH200_vllm" / "llama3.1-8b" / scen
        assert (d / "performance" / "run_1" / "mlperf_log_detail.txt").is_file() and (d / "TEST06").is_dir()
    readme = (root / "src" / "README.md").read_text()
    assert "commit: `" in readme and "v6.1" in readme and "Interactive performance:" in readme
    system = json.loads((root / "systems" / "1xH200_vllm.json").read_text())
    assert set(SYSTEM_FIELDS) <= set(system)
    assert system["submitter"] == "Org" and system["status"] == "available"
    assert system["framework"] == "given"  # --system-json replaces what run.json tells
    assert not (root / "NOT-COMPLIANT.txt").exists()


def test_package_tree_refuses_offline_only_and_mixed_systems(tmp_path):
    from test_compliance import make_run

    from sut.errors import ComplianceError
    from sut.submission.tree import TreeSettings, package_tree

    runs = _tree_runs(tmp_path / "runs")
    only = dict(out=str(tmp_path / "sub"), system="s", submitter="o", performance_runs=(str(runs["Offline"][0]),),
                accuracy_runs=(str(runs["Offline"][1]),), test06_runs=(str(runs["Offline"][2]),))
    with pytest.raises(ComplianceError, match="one of\\) Interactive or Server"):
        package_tree(TreeSettings(**only))
    assert not (tmp_path / "sub" / "closed").exists()
    rehearsal = package_tree(TreeSettings(**dict(only, allow_noncompliant=True)))
    assert "Interactive or Server" in (rehearsal / "NOT-COMPLIANT.txt").read_text()
    other = make_run(tmp_path / "x", "perf", "performance", scenario="Interactive", model_key="llama3_1-8b-interactive",
                     model={"path": "/m", "config_sha256": "other", "eos_token_ids": [128009]})
    with pytest.raises(ComplianceError, match="another system"):
        package_tree(TreeSettings(out=str(tmp_path / "sub2"), system="s", submitter="o",
                                  performance_runs=(str(runs["Offline"][0]), str(other)),
                                  accuracy_runs=(str(runs["Offline"][1]), str(runs["Interactive"][1])),
                                  test06_runs=(str(runs["Offline"][2]), str(runs["Interactive"][2]))))
    with pytest.raises(ComplianceError, match="two performance runs of the Offline"):
        package_tree(TreeSettings(out=str(tmp_path / "sub3"), system="s", submitter="o",
                                  performance_runs=(str(runs["Offline"][0]), str(runs["Offline"][0])),
                                  accuracy_runs=(str(runs["Offline"][1]),)))


def test_package_help_names_the_checker_version():
    out = subprocess.run([sys.executable, "-m", "sut", "package", "--help"], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "v6.1" in out.stdout and "v6.0" in out.stdout


@pytest.mark.parametrize("mode, said", [("performance", "(limits 2000 / 100 ms)"),
                                        ("accuracy", "(an accuracy run is not timed: no limits apply)")])
def test_the_run_summary_judges_latencies_against_the_limits_only_in_a_performance_run(caplog, mode, said):
    from sut.cli import _print_summary

    rec = {"output_dir": "RUN", "sut": "vllm", "scenario": "Server", "mode": mode, "validity": "VALID",
           "compliance": {"compliant": True, "reasons": []}, "ledger": {"completed": 8, "issued": 8, "first_tokens": 8},
           "latency": {"loadgen": {"ttft_p99_ms": None, "tpot_p99_ms": None}, "limits_ms": {"ttft": 2000, "tpot": 100},
                       "harness": {"ttft_ms": {"p99": 9349.5}, "tpot_ms": {"p99": 142.8}}}}
    with caplog.at_level("INFO", logger="sut"):
        _print_summary(rec)
    line = next(ln for r in caplog.records for ln in r.getMessage().splitlines() if ln.startswith("TTFT / TPOT p99"))
    assert said in line and "harness 9,349.5 / 142.8 ms" in line and line.endswith("; first tokens 8")


@pytest.mark.parametrize("admit, said", [(None, False), (1, False), (3, True)])
def test_the_run_summary_names_an_admission_interval_only_when_one_is_set(caplog, admit, said):
    """--admit-every-steps N > 1 changes TTFT: the summary says so next to the latencies; unset or 1 adds no line."""
    from sut.cli import _print_summary

    rec = {"output_dir": "RUN", "sut": "vllm", "scenario": "Server", "mode": "accuracy",
           "compliance": {"compliant": True, "reasons": []}, "ledger": {"completed": 8, "issued": 8},
           "engine_settings": {"admit_every_steps": admit}}
    with caplog.at_level("INFO", logger="sut"):
        _print_summary(rec)
    lines = [ln for r in caplog.records for ln in r.getMessage().splitlines() if ln.startswith("engine loop")]
    assert lines == (["engine loop     : new requests admitted every 3 engine steps while busy "
                      "(--admit-every-steps)"] if said else [])
