"""docs/multinode.md's `vllm serve` fleet, in the shape it documents: servers started with the flags the page
gives (two stand-in servers on loopback, ``fake_vllm_server.py``, standing in for two hosts) and one
``python -m sut run --sut vllm-http --server-url URL,URL`` over both, and the page's fleet file (its URLs
replaced by the stand-ins', the second server requiring the key its ``api_key_env`` names) with its
``--fleet`` command; the page's commands and its list of what is not built yet stay in the page."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import tomllib
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
def two_hosts(request):
    """Two stand-in servers started as the page starts each fleet server (indirect parameter: per server, extra
    flags); killed at the end."""
    extra = getattr(request, "param", ([], []))
    procs, urls = [], []
    try:
        for flags in extra:
            port = _free_port()
            p = subprocess.Popen([sys.executable, str(FAKE), "--model", str(TINY_MODEL), "--host", "127.0.0.1",
                                  "--port", str(port), *SERVER_FLAGS, *flags], stdout=subprocess.DEVNULL,
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
    for flag in [f for f in SERVER_FLAGS if f.startswith("--")] + ["--sut vllm-http", "--server-url", "--fleet",
                                                                  "FLAME_ENDPOINT", "--flame-engines"]:
        assert flag in text, flag
    not_built = text.split("## Not built yet", 1)[1]
    for item in ("GPU of a `vllm serve` server read back", "node selector"):
        assert item in not_built, item
    assert "--nodes" not in not_built
    for item in ("A fleet file for", "sends no API key", "sends no `Authorization`"):  # built now
        assert item not in text, item
    built = text.split("## Not built yet", 1)[0]
    # the emulated nodes' commands, as tests/test_flame_real_nodes.py runs them, and the lost-node bound it asserts
    for item in ("python -m sut.flame cluster --nodes 2 --policies priority,drf,gang --flame-bin", "nodes.json",
                 "--executors-per-engine 2", "--option resreq=cpu=$(nproc),mem=1g", "at most 45 s", "--node-gpus"):
        assert item in built, item
    assert "flame.exposure" in built and "http.exposure" in built  # non-loopback endpoints: warned and recorded
    assert "HTTP 401: API key refused or missing" in built and "differ in dtype" in built


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


def _page_fleet() -> tuple[str, str]:
    """The page's fleet file (its ``toml`` block) and its ``--fleet`` command (the ``bash`` block that runs it)."""
    text = DOC.read_text()
    toml_block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    command = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "--fleet" in b)
    return toml_block, command


#: The key the page's second server is started with (``--api-key``), held in ``GPU_B_API_KEY``.
DOC_KEY = "doc-fleet-key-" + secrets.token_hex(8)


@pytest.mark.parametrize("two_hosts", [([], ["--api-key", DOC_KEY])], indirect=True, ids=["second-server-keyed"])
def test_the_pages_fleet_file_and_command_run_over_two_servers_one_with_a_key(tmp_path, two_hosts, synthetic_small):
    key = DOC_KEY
    data, _ = synthetic_small
    toml_text, command = _page_fleet()
    fleet = tomllib.loads(toml_text)
    assert [s["url"] for s in fleet["server"]] == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    for old, new in zip([s["url"] for s in fleet["server"]], two_hosts):
        toml_text = toml_text.replace(f'"{old}"', f'"{new}"')
    (tmp_path / "fleet.toml").write_text(toml_text)
    assert "--sut vllm-http --fleet fleet.toml" in command
    runs = tmp_path / "runs"
    env = dict(sut_env(), FLEET_API_KEY="default-" + secrets.token_hex(4), GPU_B_API_KEY=key)
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", "--sut", "vllm-http", "--fleet",
                          str(tmp_path / "fleet.toml"), "--user-conf", str(CPU_CONF), "--model", str(TINY_MODEL),
                          "--max-model-len", "4096", "--dataset", str(data), "--mode", "accuracy", "--max-samples", "8",
                          "--no-accuracy-gate", "--output-dir", str(runs)],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["ledger"]["completed"] == 8
    got = [(e["url"], e["node"], e["gpu"], e["api_key_env"], e["api_key"]) for e in rec["engines"]]
    assert got == [(two_hosts[0], "gpu-a", "0", "FLEET_API_KEY", "set"),
                   (two_hosts[1], "gpu-b", "GPU-5c2a0f1e-8d4b-4c1a-9f3e-2b7d6a1c0e9f", "GPU_B_API_KEY", "set")]
    assert all(e["samples"] > 0 for e in rec["engines"])
    assert key not in (run / "run.json").read_text() and key not in out.stderr + out.stdout
