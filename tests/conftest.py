"""Shared fixtures: paths, the tiny model, small synthetic datasets, real-data skips, real Flame clusters."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_MODEL = REPO / "sut" / "models" / "tiny-llama3"
CPU_CONF = REPO / "loadgen_configs" / "cpu_tiny.user.conf"
# The real Flame v0.6.0 control plane of this repository's development set-up (or FLAME_BIN).
FLAME_BIN = Path(os.environ.get("FLAME_BIN") or (REPO.parent / "shared" / "flame" / "bin"))
TINY_ENGINE_ARGS = ["--model", str(TINY_MODEL), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
                    "--max-model-len", "4096"]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def standin_python3(tmp_path: Path, script: str) -> dict:
    """``{"PATH": ...}`` that puts ``script`` (a bash stand-in whose ``{real}`` becomes this interpreter) first as
    ``python3``, in ``tmp_path/bin``: how the tests of ``scripts/bench/gpu_runs.sh`` steps see its calls."""
    import shlex

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(script.replace("{real}", shlex.quote(sys.executable)))
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def pytest_configure(config):
    config.addinivalue_line("markers", "realflame: needs the real Flame v0.6.0 binaries (../shared/flame/bin or "
                            "FLAME_BIN; skipped when absent)")


def flame_bin_dir():
    """The folder of the real Flame binaries, or None (then tests marked ``realflame`` skip)."""
    from sut.flame.cluster import find_bin_dir

    return find_bin_dir(FLAME_BIN)


def pytest_collection_modifyitems(config, items):
    no_flame = None
    for item in items:
        if "realdata" in item.keywords and not SHARED_DATA.is_dir():
            item.add_marker(pytest.mark.skip(reason=f"{SHARED_DATA} is absent"))
        if "realflame" in item.keywords:
            if no_flame is None:
                no_flame = flame_bin_dir() is None
            if no_flame:
                item.add_marker(pytest.mark.skip(reason=f"real Flame control plane absent: no flame-session-manager and "
                                                        f"flame-executor-manager in {FLAME_BIN} (set FLAME_BIN)"))


@pytest.fixture
def write_json(tmp_path):
    def _w(obj, name="data.json"):
        p = tmp_path / name
        p.write_text(json.dumps(obj))
        return p

    return _w


@pytest.fixture(scope="session")
def synthetic_small(tmp_path_factory):
    """64-sample synthetic dataset (seed 0) and its word-level tokenizer folder."""
    from sut.data.synthetic import SyntheticSettings, write_dataset, write_tokenizer

    d = tmp_path_factory.mktemp("synthetic")
    write_dataset(d / "syn64.json", SyntheticSettings(samples=64, seed=0, median=300, max_len=1200))
    write_tokenizer(d / "tok")
    return d / "syn64.json", d / "tok"


def proc_state(pid: int) -> str:
    """The /proc state letter of process ``pid`` ("Z": a zombie, ended but not reaped; "" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return ""


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie its parent (or PID 1 in a container) has not reaped yet."""
    return proc_state(pid) in ("", "Z")


def sut_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@pytest.fixture
def real_flame_factory(tmp_path_factory, request):
    """``make(**ClusterSettings fields) -> RealCluster`` (started); every cluster is stopped at the end
    of the test, and its folder (logs in ``home/logs``) removed unless the test failed."""
    from sut.flame.cluster import ClusterSettings, RealCluster

    bin_dir = flame_bin_dir()
    if bin_dir is None:
        pytest.skip(f"real Flame control plane absent: no binaries in {FLAME_BIN} (set FLAME_BIN)")
    made = []

    def make(**kw):
        c = RealCluster(ClusterSettings(bin_dir=bin_dir, workdir=tmp_path_factory.mktemp("flame-real"), **kw))
        made.append(c)
        return c.start()

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for c in made:
        c.stop()
        if failed:
            print(f"real Flame cluster logs kept in {c.log_dir}")
        else:
            shutil.rmtree(c.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def real_flame(tmp_path_factory, request):
    """One real Flame v0.6.0 cluster for the whole test session (skips when the binaries are absent).
    Logs are kept (path printed) when any test of the session failed."""
    from sut.flame.cluster import ClusterSettings, RealCluster

    bin_dir = flame_bin_dir()
    if bin_dir is None:
        pytest.skip(f"real Flame control plane absent: no binaries in {FLAME_BIN} (set FLAME_BIN)")
    cluster = RealCluster(ClusterSettings(bin_dir=bin_dir, workdir=tmp_path_factory.mktemp("flame-real-session")))
    cluster.start()
    yield cluster
    cluster.stop()
    if request.session.testsfailed:
        print(f"real Flame cluster logs kept in {cluster.log_dir}")
    else:
        shutil.rmtree(cluster.workdir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the item (``rep_call``), so fixtures can tell a failed test."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(scope="session")
def punkt_ready(tmp_path_factory):
    """nltk's punkt_tab data for the gate: the installed copy, else one written to a temp folder for the session."""
    import nltk

    from accuracy.errors import PunktDataMissingError
    from accuracy.punkt_data import ensure_punkt, write_punkt_tab

    try:
        ensure_punkt()
        yield
        return
    except PunktDataMissingError:
        pass
    root = tmp_path_factory.mktemp("nltk_data")
    write_punkt_tab(root)
    nltk.data.path.insert(0, str(root))
    yield
    nltk.data.path.remove(str(root))


@pytest.fixture(scope="session")
def synthetic_full(tmp_path_factory):
    """The official size: 13,368 synthetic samples, written by ``python -m sut synthetic``."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("synthetic-full") / "syn13368.json"
    out = subprocess.run([sys.executable, "-m", "sut", "synthetic", "--out", str(path)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return path


@pytest.fixture(autouse=True)
def _restore_stop_signals():
    """A test that calls a CLI ``main`` in-process installs the harness's SIGINT/SIGTERM handlers
    (``sut.exits.stop_on_sigterm_like_ctrl_c``), and a signal it sends sets the harness's stop flag: both are
    restored after every test, so that no later test sees a stop it did not send (it would exit 130, not 1)."""
    from sut import exits

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])
    exits._interrupted.clear()


FAKE_VLLM_SERVER = Path(__file__).resolve().parent / "fake_vllm_server.py"


def _fake_healthy(url: str) -> bool:
    from sut.core.transports import http_servers

    try:
        return http_servers.health_status(url, timeout=1) == 200
    except OSError:
        return False


@pytest.fixture
def fake_server():
    """``start(*flags, model=TINY_MODEL) -> (url, Popen)``: a stand-in ``vllm serve`` (``fake_vllm_server.py``)
    on a free loopback port, killed at the end."""
    import subprocess
    import time

    from sut.core.transports.http_servers import free_port

    procs = []

    def start(*flags, model=str(TINY_MODEL)):
        port = free_port()
        p = subprocess.Popen([sys.executable, str(FAKE_VLLM_SERVER), "--model", model, "--port", str(port), *flags],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while not _fake_healthy(url):
            assert p.poll() is None and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.05)
        return url, p

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@pytest.fixture
def started():
    """Stops every transport a test started (append each to the list)."""
    made = []
    yield made
    for t in made:
        t.stop()
