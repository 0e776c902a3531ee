"""The one-host real Flame v0.6.0 cluster (sut.flame.cluster) with the echo service and the registration
CLI: loopback ports, isolation of two clusters, no process left after stop, and Flame behaviour the
stand-in copies (a dead service's executor stuck in Unbinding starves new sessions). Skipped when the
binaries (../shared/flame/bin or FLAME_BIN) are absent."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import flamepy
import psutil
import pytest

from sut.flame.cluster import ClusterError, ClusterSettings, RealCluster, pick_ports
from tests.conftest import REPO, flame_bin_dir, sut_env
from tests.flame_standin import echo_app_attributes

pytestmark = pytest.mark.realflame


def _echo_session(cluster, tmp_path, name="echo", n=1, **app):
    conn = flamepy.connect(cluster.endpoint)
    conn.register_application(name, echo_app_attributes(working_directory=str(tmp_path / name), **app))
    return conn, conn.create_session(flamepy.SessionAttributes(application=name, min_instances=n, max_instances=n))


def test_echo_through_real_cluster_then_stop_leaves_nothing(real_flame_factory, tmp_path):
    cluster = real_flame_factory()
    assert cluster.endpoint == f"http://127.0.0.1:{cluster.port}"
    conn, ssn = _echo_session(cluster, tmp_path)
    info = json.loads(ssn.invoke(b"info"))
    assert info["endpoint"] == cluster.endpoint and info["cwd"] == str(tmp_path / "echo")  # host shim: cwd, env
    assert info["pid"] in {p.pid for p in cluster.service_processes()}
    assert ssn.invoke(b"hello") == b"hello"
    ssn.close()
    conn.close()
    pids = [p.pid for p in cluster.processes()]
    assert len(pids) >= 2  # the two managers (and possibly the service until its release)
    cluster.stop()

    def lingering():  # a killed process may take a moment to leave the process table on a busy machine
        out = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != "zombie":
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + 10
    while lingering() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cluster.processes() and not lingering()
    assert not cluster.sock_dir.exists() and list(cluster.log_dir.iterdir())


def test_two_clusters_at_once_never_talk_to_each_other(real_flame_factory, tmp_path):
    a, b = real_flame_factory(), real_flame_factory()
    assert len({a.port, a.port + 1, b.port, b.port + 1}) == 4
    conn_a, ssn_a = _echo_session(a, tmp_path, name="only-in-a")
    conn_b = flamepy.connect(b.endpoint)
    assert conn_b.get_application("only-in-a") is None  # registered in a only
    conn_b.register_application("only-in-b", echo_app_attributes(working_directory=str(tmp_path / "b")))
    assert conn_a.get_application("only-in-b") is None
    ssn_b = conn_b.create_session(flamepy.SessionAttributes(application="only-in-b", min_instances=1, max_instances=1))
    info_a, info_b = json.loads(ssn_a.invoke(b"info")), json.loads(ssn_b.invoke(b"info"))
    # Each service was started by its own cluster's executor manager and reports its own cluster's endpoint.
    assert info_a["endpoint"] == a.endpoint and info_b["endpoint"] == b.endpoint
    assert info_a["pid"] in {p.pid for p in a.service_processes()} - {p.pid for p in b.service_processes()}
    assert info_b["pid"] in {p.pid for p in b.service_processes()} - {p.pid for p in a.service_processes()}
    assert {e["session_id"] for e in a.executors()} == {ssn_a.id}
    assert {e["session_id"] for e in b.executors()} == {ssn_b.id}
    assert [s.id for s in conn_a.list_sessions()] == [ssn_a.id] and [s.id for s in conn_b.list_sessions()] == [ssn_b.id]
    for c in (a, b):  # each executor manager connected to its own session manager's backend port only
        fem = c.log_text("fem")
        assert f"127.0.0.1:{c.port + 1}" in fem
        assert f":{(b if c is a else a).port + 1}" not in fem
    ssn_a.close()
    ssn_b.close()


@pytest.mark.parametrize("taken", [0, 1], ids=["frontend", "backend"])
def test_taken_port_is_refused_with_the_reason(tmp_path, taken):
    """A user's `cluster --port <taken>` said only "it exited with code 0": the port in use is named now."""
    bin_dir = flame_bin_dir()
    port = pick_ports()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port + taken))
        s.listen()
        with pytest.raises(ClusterError, match=f"port {port + taken} in use: the session manager needs --port {port}"):
            RealCluster(ClusterSettings(bin_dir=bin_dir, workdir=tmp_path, port=port, start_timeout_s=10)).start()
    assert not [p for p in psutil.process_iter(["name"]) if p.info["name"] == "flame-session-manager"
                and str(tmp_path) in " ".join(p.cmdline())]


def test_register_cli_then_the_executor_manager_runs_the_service(real_flame_factory, tmp_path):
    """`python -m sut.flame register` as documented; the executor manager then starts the registered
    command as a host process (fake engine, one executor) and the SUT gets its answers."""
    from tests.test_flame_standin import _assert_exactly_once, _issue, _sut

    cluster = real_flame_factory()
    workdir = tmp_path / "svc"
    p = subprocess.run([sys.executable, "-m", "sut.flame", "register", "--endpoint", cluster.endpoint, "--name", "sut-cli",
                        "--workdir", str(workdir)], cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"registered application sut-cli at {cluster.endpoint}" in p.stdout
    conn = flamepy.connect(cluster.endpoint)
    app = conn.get_application("sut-cli")
    assert (app.command, app.arguments, app.working_directory) == (sys.executable, ["-m", "sut.flame.serve"], str(workdir))
    assert app.environments["PYTHONPATH"].split(":")[0] == str(REPO) and app.delay_release == 3600

    import numpy as np

    from sut.data.dataset import Dataset

    rng = np.random.default_rng(1)
    ds = Dataset("mem", "0" * 64, [rng.integers(0, 128000, size=20, dtype=np.int32) for _ in range(4)], [""] * 4, 4)
    sut, answers = _sut(cluster, ds, tmp_path / "locks", app="sut-cli", register_app="never", executors_per_engine=1,
                        step_s=0.01)
    (tmp_path / "locks").mkdir()
    try:
        sut.start()
        samples = _issue(sut, ds, 8)
        assert sut.ledger.idle.wait(60)
    finally:
        sut.stop()
    assert sut.ledger.error is None
    _assert_exactly_once(samples, answers)
    assert sorted(workdir.glob("*.err"))  # the executor manager's log files of the service, in the app's directory


def test_register_replace_unregisters_first_and_the_new_registration_is_the_one_used(real_flame_factory, tmp_path):
    """``register --replace`` unregisters the name first (Flame v0.6.0 with sqlite storage refuses a second
    registration; this cluster's ``storage: none`` overwrites it, so both ways end with the newest)."""
    cluster = real_flame_factory()

    def register(workdir, *extra):
        return subprocess.run([sys.executable, "-m", "sut.flame", "register", "--endpoint", cluster.endpoint, "--name",
                               "sut-again", "--workdir", str(tmp_path / workdir), *extra], cwd=REPO, env=sut_env(),
                              capture_output=True, text=True, timeout=60)

    assert register("one").returncode == 0
    replaced = register("two", "--replace")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert replaced.stdout.splitlines() == [f"unregistered application sut-again at {cluster.endpoint}",
                                            f"registered application sut-again at {cluster.endpoint}"]
    assert flamepy.connect(cluster.endpoint).get_application("sut-again").working_directory == str(tmp_path / "two")
    fresh = register("three", "--replace", "--name", "sut-new")  # nothing to unregister: registers only
    assert fresh.returncode == 0 and "unregistered" not in fresh.stdout, fresh.stderr[-2000:]
    # A recheck's find: Flame v0.6.0 unregistered under an open session and dropped it (a run then failed).
    conn = flamepy.connect(cluster.endpoint)
    ssn = conn.create_session(flamepy.SessionAttributes(application="sut-again", min_instances=0, max_instances=1))
    try:
        busy = register("four", "--replace")
        assert busy.returncode == 1 and f"sessions of it are open ({ssn.id})" in busy.stderr, busy.stderr[-2000:]
        assert [x.id for x in conn.list_sessions()] == [ssn.id]
        assert conn.get_application("sut-again").working_directory == str(tmp_path / "two")
    finally:
        ssn.close()


def test_dead_service_leaves_its_executor_unbinding_and_new_sessions_get_none(real_flame_factory, tmp_path):
    """Real v0.6.0 behaviour the stand-in copies: after a service died, its executor fails OnSessionLeave and
    stays Unbinding for good; Flame offers it to every session that needs an executor, so a new session
    gets none (its task stays Pending) until the executor manager restarts."""
    cluster = real_flame_factory()
    conn, ssn = _echo_session(cluster, tmp_path, delay_release=60)
    assert ssn.invoke(b"hi") == b"hi"
    t = ssn.create_task(b"crash")
    assert cluster.wait_until(lambda: cluster.session_state(ssn.id)["counts"]["Failed"] == 1, 20)
    later = ssn.create_task(b"after the crash")  # the dead executor is still Bound and pops it at once
    assert cluster.wait_until(lambda: cluster.session_state(ssn.id)["counts"]["Failed"] == 2, 20)
    failures = [[e.message for e in ssn.get_task(x.id).events if e.code == 3] for x in (t, later)]
    # The first task meets the dying service: "transport error". The second finds it gone ("Connection refused (os
    # error 111)", every try so far) or, should the executor pop it before the service's socket is shut, still
    # dying ("transport error"); nothing else is accepted.
    assert failures[0] == ["transport error"], failures
    assert failures[1] in (["Connection refused (os error 111)"], ["transport error"]), failures
    ssn.close()
    assert cluster.wait_until(lambda: [(e["state"], e["session_id"]) for e in cluster.executors()] == [("Unbinding", None)],
                              15), cluster.executors()
    stuck = cluster.executors()[0]
    ssn2 = conn.create_session(flamepy.SessionAttributes(application="echo", min_instances=1, max_instances=1))
    t2 = ssn2.create_task(b"never runs")
    time.sleep(3)
    assert cluster.session_state(ssn2.id)["counts"]["Pending"] == 1
    assert [e["id"] for e in cluster.executors()] == [stuck["id"]]  # no new executor
    assert t.id and t2.id
    conn.close_session(ssn2.id)
    cluster.stop()  # ends the executor manager's busy retry loop
    assert not cluster.processes()


def test_cluster_cli_serves_until_sigterm(tmp_path):
    bin_dir = flame_bin_dir()
    p = subprocess.Popen([sys.executable, "-m", "sut.flame", "cluster", "--flame-bin", str(bin_dir), "--workdir",
                          str(tmp_path / "c")], cwd=REPO, env=sut_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("FLAME_ENDPOINT=http://127.0.0.1:"), line + p.stderr.read()[-2000:]
        conn = flamepy.connect(line.split("=", 1)[1].strip())
        assert [n.status.state for n in conn.list_nodes()] == [1]  # one Ready node
        conn.close()
        children = psutil.Process(p.pid).children(recursive=True)
        assert {c.name() for c in children} >= {"flame-session-manager", "flame-executor-manager"}
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_close_cli_closes_a_session_left_open_and_refuses_an_unknown_one(real_flame_factory, tmp_path):
    """`python -m sut.flame close`: what a run killed with SIGKILL leaves behind (its session stays open and
    holds its executors) is closed by id; an unknown id is bad input (exit 2) naming it."""
    cluster = real_flame_factory()
    conn, ssn = _echo_session(cluster, tmp_path)
    assert ssn.invoke(b"hello") == b"hello"
    cmd = [sys.executable, "-m", "sut.flame", "close", "--endpoint", cluster.endpoint, "--wait-s", "20"]
    out = subprocess.run(cmd + [ssn.id], env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"closed session {ssn.id}" in out.stdout, out.stderr
    assert cluster.wait_until(lambda: not [e for e in cluster.executors() if e["session_id"] == ssn.id], 20)
    out = subprocess.run(cmd + ["no-such-session"], env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"Flame at {cluster.endpoint} has no session no-such-session" in out.stderr, \
        out.stderr


def test_cluster_cli_killed_with_sigkill_leaves_no_manager(tmp_path):
    """SIGKILL of `python -m sut.flame cluster` left both managers running with their ports."""
    bin_dir = flame_bin_dir()
    p = subprocess.Popen([sys.executable, "-m", "sut.flame", "cluster", "--flame-bin", str(bin_dir), "--workdir",
                          str(tmp_path / "c")], cwd=REPO, env=sut_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    children = []
    try:
        line = p.stdout.readline()
        assert line.startswith("FLAME_ENDPOINT=http://127.0.0.1:"), line + p.stderr.read()[-2000:]
        children = psutil.Process(p.pid).children(recursive=True)
        assert {c.name() for c in children} >= {"flame-session-manager", "flame-executor-manager"}
        p.kill()
        p.wait(10)
        deadline = time.monotonic() + 20
        while [c for c in children if c.is_running() and c.status() != "zombie"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        for c in children:
            if c.is_running():
                c.kill()


@pytest.mark.parametrize("args, message", [
    (["--python", "/nonexistent"], "--python /nonexistent: not an executable file on this host"),
    (["--workdir", "/proc/nope"], "--workdir /proc/nope: cannot create it"),
])
def test_register_cli_refuses_paths_a_one_host_cluster_cannot_use(real_flame_factory, tmp_path, args, message):
    cluster = real_flame_factory()
    cmd = [sys.executable, "-m", "sut.flame", "register", "--endpoint", cluster.endpoint, "--name", "bad-paths", *args]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert flamepy.connect(cluster.endpoint).get_application("bad-paths") is None
