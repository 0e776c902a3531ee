"""Routing at fleet scale: the ArgMin tree, the policies against a scan over every replica, the
prefix-affinity gate on total work, and the quick path of scripts/bench/bench_routing.py (64 simulated
replicas on 8 nodes: exactly-once, balance, the affinity map's memory bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sut.core.routing import AffinitySettings, make_router
from sut.core.routing.argmin import ArgMin
from sut.core.routing.prefix_affinity import MAP_ENTRY_BYTES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [1, 3, 8, 37])
def test_argmin_tracks_the_smallest_key_through_random_updates(n):
    rng = np.random.default_rng(n)
    keys = [(float(rng.integers(0, 5)), i) for i in range(n)]
    tree = ArgMin(keys)
    for _ in range(500):
        i = int(rng.integers(0, n))
        keys[i] = (float(rng.integers(0, 5)), i)  # many ties: the lower index must win them
        tree.update(i, keys[i])
        assert tree.best == min(range(n), key=lambda r: keys[r])
    with pytest.raises(ValueError):
        ArgMin([])


def _scan_choice(r, policy, prompt):
    """The replica a scan over every replica picks (the policies' definitions in their headers)."""
    n = r.replicas
    if policy == "least_loaded":
        return min(range(n), key=lambda e: (r.load[e] + len(prompt), r.inflight[e], e))
    if policy == "least_pending":
        return min(range(n), key=lambda e: (r.inflight[e] + r.weight * r.waiting_first[e], e))
    return sum(r.routed) % n


@pytest.mark.parametrize("policy", ["least_loaded", "least_pending", "round_robin"])
def test_each_policy_picks_what_a_scan_over_every_replica_picks(policy):
    rng = np.random.default_rng(1)
    r = make_router(policy, 13, 128)
    live = []
    for rid in range(3000):
        p = np.zeros(int(rng.integers(50, 2000)), dtype=np.int32)
        want = _scan_choice(r, policy, p)
        assert r.route(rid, p) == want, rid
        live.append(rid)
        if policy == "least_pending" and rng.random() < 0.5:
            r.first(live[int(rng.integers(0, len(live)))])
        while live and rng.random() < 0.45:
            r.done(live.pop(int(rng.integers(0, len(live)))))


def _doc_prompt(doc: int, q: int) -> np.ndarray:
    """A 1,024-token document (four full blocks: its whole key) and a 16-token question."""
    base = np.random.default_rng(doc).integers(0, 1000, size=1024, dtype=np.int32)
    return np.concatenate([base, np.full(16, 5000 + q, dtype=np.int32)])


def test_prefix_affinity_releases_a_hot_owner_on_its_total_work_not_only_its_uncached_prefill():
    """Repeat questions of one document book 16 uncached tokens each but 128 tokens of decode: the
    owner must be released once its estimated work exceeds the least-loaded replica's by release_tokens,
    so the replicas' booked work never differs by more than release_tokens plus one request."""
    s = AffinitySettings(release_tokens=2000)
    r = make_router("prefix_affinity", 4, 128, s)
    owner = r.route(0, _doc_prompt(7, 0))
    one_request = 1040 + 128
    for rid in range(1, 50):
        r.route(rid, _doc_prompt(7, rid))
        assert max(r.load) - min(r.load) <= s.release_tokens + one_request, rid
    st = r.stats()
    assert st["affinity_hits"] > 10 and st["releases"] > 0
    assert r.uncached[owner] < s.release_tokens  # a gate on uncached prefill alone would never have opened


def test_bench_routing_quick_path_exactly_once_balanced_and_the_map_bounded(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_routing.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["machine"]["date"] and rep["failed"] == []
    cases = rep["cases"]
    assert {c["policy"] for c in cases} == {"round_robin", "least_loaded", "least_pending", "prefix_affinity"}
    for c in cases:
        name = f"{c['policy']} {c['mode']} {c['scenario']} {c['mix']}"
        assert c["replicas"] == 64 and c["nodes"] == 8, name
        assert c["exactly_once"] is None and c["samples"] >= 1000, name
        assert c["cpu_us_per_sample"] > 0, name
        if c["mode"] != "step":
            continue
        assert c["replicas_unused"] == 0, name
        pt = c.get("end_of_burst") or c["over_time"]
        if c["policy"] == "prefix_affinity" and c["mix"] == "shared":
            gap = pt.get("booked_gap_worst", pt.get("booked_gap"))
            assert gap <= c["gate_bound"] and c["affinity"]["hits"] > c["samples"] // 2, name
        else:  # all on one replica would read 64
            assert pt.get("max_over_mean_avg", pt.get("max_over_mean")) <= 2.0, name
    m = rep["map_at_bound"]
    assert m["evictions"] > 0 and m["entries"] == m["max_entries"]
    assert m["worst_bytes"] <= m["max_entries"] * MAP_ENTRY_BYTES
