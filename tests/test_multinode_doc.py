"""docs/multinode.md's `vllm serve` fleet, in the shape it documents: servers started with the flags the page
gives (two stand-in servers on loopback, ``fake_vllm_server.py``, standing in for two hosts) and one
``python -m sut run --sut vllm-http --server-url URL,URL`` over both; the page's commands and its list of
what is not built yet stay in the page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env

pytestmark = pytest.mark.timeout(180)

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"
DOC = REPO / "docs" / "multinode.md"
#: The flags docs/multinode.md gives every fleet server (besides --host and --port).
SERVER_FLAGS = ["--no-enable-prefix-caching", "--max-model-len", "4096", "--dtype", "bfloat16"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"stand-in server {url} did not start"
        time.sleep(0.05)


@pytest.fixture
def two_hosts():
    """Two stand-in servers started as the page starts each fleet server; killed at the end."""
    procs, urls = [], []
    try:
        for _ in range(2):
            port = _free_port()
            p = subprocess.Popen([sys.executable, str(FAKE), "--model", str(TINY_MODEL), "--host", "127.0.0.1",
                                  "--port", str(port), *SERVER_FLAGS], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
            _wait_healthy(urls[-1], p)
        yield urls
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_the_page_documents_the_fleet_flags_and_what_is_not_built_yet():
    text = DOC.read_text()
    for flag in [f for f in SERVER_FLAGS if f.startswith("--")] + ["--sut vllm-http", "--server-url", "FLAME_ENDPOINT",
                                                                  "--flame-engines"]:
        assert flag in text, flag
    not_built = text.split("## Not built yet", 1)[1]
    for item in ("fleet file", "API key", "node selector"):
        assert item in not_built, item
    assert "--nodes" not in not_built
    built = text.split("## Not built yet", 1)[0]
    # the emulated nodes' commands, as tests/test_flame_real_nodes.py runs them, and the lost-node bound it asserts
    for item in ("python -m sut.flame cluster --nodes 2 --policies priority,drf,gang --flame-bin", "nodes.json",
                 "--executors-per-engine 2", "--option resreq=cpu=$(nproc),mem=1g", "at most 45 s", "--node-gpus"):
        assert item in built, item
    assert "flame.exposure" in built and "http.exposure" in built  # non-loopback endpoints: warned and recorded


def test_a_run_over_a_two_server_fleet_answers_every_sample_on_both(tmp_path, two_hosts, synthetic_small):
    data, _ = synthetic_small
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", "--sut", "vllm-http",
                          "--server-url", ",".join(two_hosts), "--user-conf", str(CPU_CONF), "--model", str(TINY_MODEL),
                          "--max-model-len", "4096", "--dataset", str(data), "--mode", "accuracy",
                          "--max-samples", "16", "--no-accuracy-gate", "--output-dir", str(tmp_path)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["ledger"]["completed"] == 16
    engines = rec["engines"]
    assert [e["url"] for e in engines] == two_hosts
    assert all(e["samples"] > 0 for e in engines) and sum(e["samples"] for e in engines) == 16
    assert all(e["device"]["kind"] == "remote" for e in engines)  # node and GPU: not built yet (the page says so)
    assert rec["prefix_caching"]["enabled"] is False
    assert rec["routing"]["policy"] == "least_loaded" and rec["routing"]["answered"] == [e["samples"] for e in engines]
