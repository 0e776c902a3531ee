"""LoadGen's ``mlperf_log_detail.txt`` read back: its results as plain values (``parse_loadgen_detail``) and the
token latencies of a streaming run (``token_latencies``)."""

from __future__ import annotations

import json
from pathlib import Path

from sut.scenarios import LATENCY_LIMITS_MS


def parse_loadgen_detail(path: Path) -> dict:
    """Key results from ``mlperf_log_detail.txt`` (``:::MLLOG`` JSON lines) as plain values."""
    wanted = {"result_validity", "result_samples_per_second", "result_tokens_per_second", "result_min_duration_met",
              "result_min_queries_met", "early_stopping_met", "effective_samples_per_query", "effective_min_duration_ms",
              "effective_performance_sample_count", "effective_target_qps", "loadgen_version", "effective_min_query_count",
              "result_max_latency_ns", "effective_sample_concatenate_permutation", "effective_use_token_latencies",
              "effective_scenario", "result_completed_samples_per_sec", "result_completed_tokens_per_second",
              "result_scheduled_samples_per_sec", "result_perf_constraints_met", "early_stopping_ttft_result",
              "early_stopping_tpot_result", "result_invalid_reason", "result_first_token_99.00_percentile_latency_ns",
              "result_first_token_mean_latency_ns", "result_first_token_50.00_percentile_latency_ns",
              "result_time_per_output_token_99.00_percentile_ns", "result_time_per_output_token_50.00_percentile_ns",
              "result_99.00_percentile_latency_ns", "effective_target_latency_percentile", "result_query_count",
              "requested_server_ttft_latency", "requested_server_tpot_latency"}
    out: dict = {"errors": 0, "warnings": 0}
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith(":::MLLOG"):
            continue
        try:
            rec = json.loads(line[len(":::MLLOG"):])
        except json.JSONDecodeError:
            continue
        key = rec.get("key")
        if key in wanted:
            out[key] = rec.get("value")
        if key == "error" or str(key).startswith("error_"):
            out["errors"] += 1
        if key == "warning" or str(key).startswith("warning_"):
            out["warnings"] += 1
    return out


def token_latencies(scenario: str, results: dict, harness: dict) -> dict:
    """``run.json`` ``latency``: the scenario's p99 limits, LoadGen's TTFT/TPOT (from
    ``mlperf_log_detail.txt``, ms) and the harness's own per-sample figures."""
    def ms(key):
        v = results.get(key)
        return None if v is None else v / 1e6

    return {"limits_ms": LATENCY_LIMITS_MS.get(scenario),
            "loadgen": {"ttft_p99_ms": ms("result_first_token_99.00_percentile_latency_ns"),
                        "ttft_p50_ms": ms("result_first_token_50.00_percentile_latency_ns"),
                        "ttft_mean_ms": ms("result_first_token_mean_latency_ns"),
                        "tpot_p99_ms": ms("result_time_per_output_token_99.00_percentile_ns"),
                        "tpot_p50_ms": ms("result_time_per_output_token_50.00_percentile_ns"),
                        "latency_p99_ms": ms("result_99.00_percentile_latency_ns"),
                        "perf_constraints_met": results.get("result_perf_constraints_met"),
                        "early_stopping_met": results.get("early_stopping_met")},
            "harness": harness}
