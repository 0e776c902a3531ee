"""scripts/bench_suts.py: run order rotates per round; medians and ratios skip failed runs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_suts  # noqa: E402


def test_order_rotates_so_no_sut_always_runs_first():
    order = bench_suts.rounds_order(["vllm", "vllm-http", "flame"], 3)
    firsts = [order[i * 3][1] for i in range(3)]
    assert firsts == ["vllm", "vllm-http", "flame"]
    assert sorted(order) == sorted((k, s) for k in range(3) for s in ("vllm", "vllm-http", "flame"))


def test_summary_is_median_of_good_runs_and_ratio_to_the_first_sut():
    runs = [{"sut": "a", "ok": True, "tokens_per_s": 100.0}, {"sut": "a", "ok": True, "tokens_per_s": 110.0},
            {"sut": "a", "ok": True, "tokens_per_s": 90.0}, {"sut": "b", "ok": True, "tokens_per_s": 99.0},
            {"sut": "b", "ok": False, "tokens_per_s": 1.0}]
    s = bench_suts.summarize(runs, ["a", "b"])
    assert s["a"] == {"median_tokens_per_s": 100.0, "runs": 3, "ratio_to_a": 1.0}
    assert s["b"] == {"median_tokens_per_s": 99.0, "runs": 1, "ratio_to_a": 0.99}
    assert bench_suts.summarize([{"sut": "a", "ok": False, "tokens_per_s": None}], ["a"])["a"]["ratio_to_a"] is None
