"""The five workload presets on real CPU engines (slow: each starts vLLM engines of the tiny dummy-weight model):
two engines of one core, random-id documents of ~300 tokens, one pair of the standalone system, shrunk from the
GPU shapes of docs/locality.md; the same record fields the GPU runs fill. The fast tests of the same presets on
the fake transport: ``tests/test_locality_workloads.py``."""

import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, TINY_MODEL, sut_env

from sut.locality import RUN_SUFFIX

ENGINES = ["--model", str(TINY_MODEL), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--device",
           "cpu", "--engines-per-device", "2"]
SHRUNK = ["--text", "random", "--doc-tokens", "300", "--documents", "4", "--warmups", "1", "--pairs", "1",
          "--systems", "standalone", "--no-progress"]

#: Each preset's own flags after ENGINES and SHRUNK: the commands of docs/locality.md "On a CPU"
#: (``test_docs_give_these_commands`` holds the page to them).
CASE_ARGS = {
    "arrivals": ["--trace-preset", "arrivals", "--policies", "prefix_affinity", "--max-tokens", "4",
                 "--load-levels", "0.5", "0.95", "--tpot-target-s", "1"],
    "variable-answers": ["--trace-preset", "variable-answers", "--policies", "prefix_affinity", "--max-tokens", "24",
                         "--min-answer-tokens", "2"],
    "hot-prefixes": ["--trace-preset", "hot-prefixes", "--policies", "prefix_affinity", "prefix_affinity_never",
                     "--documents", "6", "--max-tokens", "4", "--block-tokens", "64"],
    "eviction": ["--trace-preset", "eviction", "--policies", "prefix_affinity", "round_robin", "--kv-blocks", "12",
                 "--max-tokens", "4", "--block-tokens", "64"],
    # 2 sequences an engine: requests wait in the engine, so the killed one holds some
    "replica-loss": ["--trace-preset", "replica-loss", "--policies", "round_robin", "--documents", "6",
                     "--max-tokens", "16", "--max-num-seqs", "2"],
}


def docs_cpu_commands() -> dict[str, list[str]]:
    """The ``python -m sut.locality run $CPU ...`` lines of docs/locality.md's CPU block, ``$CPU`` expanded, by
    preset."""
    text = (REPO / "docs" / "locality.md").read_text().split("On a CPU, each preset shrunk", 1)[1]
    block = text.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    cpu = shlex.split(re.search(r'CPU="([^"]*)"', block).group(1))
    runs = [shlex.split(line.split("$CPU", 1)[1], comments=True) for line in block.splitlines()
            if line.startswith("python -m sut.locality run $CPU")]
    return {args[args.index("--trace-preset") + 1]: cpu + args for args in runs}


def test_docs_give_these_commands():
    """The page's CPU commands parse to exactly what these tests run (the model path and --no-progress aside)."""
    from sut.locality.__main__ import build_parser
    docs, parser = docs_cpu_commands(), build_parser()
    assert sorted(docs) == sorted(CASE_ARGS)
    for preset, args in CASE_ARGS.items():
        ours = vars(parser.parse_args(["run", *ENGINES, *SHRUNK, *args]))
        page = vars(parser.parse_args(["run", *docs[preset], "--no-progress"]))
        page["model"] = str(REPO / page["model"])
        assert page == ours, preset


def run(tmp_path, *args) -> tuple[dict, str]:
    """One ``python -m sut.locality run`` (exit 0 required); its ``locality.json`` and console output."""
    cmd = [sys.executable, "-m", "sut.locality", "run", *ENGINES, *SHRUNK, "--output-dir", str(tmp_path), *args]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    (d,) = [p for p in tmp_path.iterdir() if p.name.endswith(RUN_SUFFIX)]
    rec = json.loads((d / "locality.json").read_text())
    for c in rec["cases"]:
        assert c["cleanup"]["stopped"] and c["cleanup"]["processes_left"] == [], c["cleanup"]
    assert (d / "locality.png").stat().st_size > 10_000  # no traceback of the harness (engine log tails may hold one):
    assert not [line for line in out.stderr.splitlines() if line.startswith("Traceback")], out.stderr[-3000:]
    return rec, out.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_arrivals_on_cpu_engines(tmp_path):
    rec, out = run(tmp_path, *CASE_ARGS["arrivals"])
    cap = rec["workload"]["capacity"]["requests_per_s"]
    assert cap > 0 and rec["workload"]["calibration"]["case"]["cleanup"]["processes_left"] == []
    (case,) = rec["cases"]
    assert [lv["rate"] for lv in case["levels"]] == [round(0.5 * cap, 4), round(0.95 * cap, 4)]
    for lv in case["levels"]:
        t = lv["timed"]
        assert t["goodput_targets"]["ttft_from"].startswith("client")  # engine and harness share one clock
        assert 0 <= t["client_ttft_s"]["p50"] <= t["client_ttft_s"]["p99"] and t["tpot_s"]["p99"] > 0
        assert 0 <= t["goodput_share"] <= 1 and t["cached_share"] > 0 and t["goodput_targets"]["tpot_s"] == 1.0
        assert lv["validation"] == {"requests_checked": 16, "failures": 0}
    assert "arrivals: capacity" in out and rec["report"]["metric"] == "goodput_per_s"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_variable_answers_on_cpu_engines(tmp_path):
    rec, out = run(tmp_path, *CASE_ARGS["variable-answers"])
    (case,) = rec["cases"]
    a = rec["trace"]["answer_tokens"]
    assert a["min"] >= 2 and a["max"] <= 24 and a["min"] < a["max"]
    assert case["timed"]["output_tokens"] == a["total"]  # every engine generated each request's own length
    assert case["timed"]["tpot_s"]["p99"] > 0 and "variable answers:" in out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hot_prefixes_on_cpu_engines(tmp_path):
    rec, out = run(tmp_path, *CASE_ARGS["hot-prefixes"])
    assert rec["trace_settings"]["zipf_s"] == 1.1 and rec["trace"]["popularity"]["hottest"][0]["share"] > 1 / 6
    by = {c["policy"]: c for c in rec["cases"]}
    assert by["prefix_affinity_never"]["routing"]["releases"] == 0
    for c in by.values():
        per = c["timed"]["per_replica"]
        assert len(per) == 2 and sum(p["requests"] for p in per) == 24 and c["timed"]["balance"] is not None
        assert all(p["cached_tokens"] + p["uncached_tokens"] == p["prompt_tokens"] for p in per)
    assert "hot prefixes: Zipf s = 1.1" in out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eviction_on_cpu_engines(tmp_path):
    rec, out = run(tmp_path, *CASE_ARGS["eviction"])
    ws = rec["workload"]["working_set"]
    assert rec["engine_settings"]["num_gpu_blocks_override"] == 12 and ws["probe"]["cleanup"]["processes_left"] == []
    assert ws["replica_kv_tokens"] == min(ws["probe"]["replica_kv_tokens"]) > 0 and 2.5 < ws["ratio"] < 3.5
    for c in rec["cases"]:
        assert c["working_set"]["replica_kv_tokens"] == ws["probe"]["replica_kv_tokens"]
        assert [r["kv_cache"]["blocks"] for r in c["replicas"]] == [12, 12]
        assert c["timed"]["router_cached_share"] is not None
    assert "eviction: " in out and "router expected" in out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replica_loss_on_cpu_engines(tmp_path):
    rec, out = run(tmp_path, *CASE_ARGS["replica-loss"])
    (case,) = rec["cases"]
    f, t = case["failover"], case["timed"]
    assert f["answered"] + f["rerouted"] + f["failed"] == 24 and f["killed"]["how"].startswith("SIGKILL to pid")
    assert f["killed"]["how"].endswith("(replica 0's engine process)") and f["detected_after_s"] is not None
    assert "exited unexpectedly" in f["detected_how"] and f["failed"] == 0 and f["rerouted"] > 0
    assert t["answered"] == 24 and case["validation"]["requests_checked"] == 24
    assert "how detected" in out
