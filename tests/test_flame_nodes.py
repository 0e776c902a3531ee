"""Emulated Flame nodes without Flame: node plans and ``--node-gpus``, each node's engine-slot lock folder, the
``leave`` ping that ends a service whose session can never be closed, and the client's release of those services
(``sut.flame.health.release_survivors``) against a scripted session manager."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from sut.flame import payload as pl
from sut.flame.health import release_survivors
from sut.flame.nodes import NODE_ENV, parse_node_gpus, plan_nodes
from sut.flame.service import VllmBatchService, node_lock_dir
from tests.test_flame_service import _common, _ctx, _task, lock_dir  # noqa: F401


def test_node_plans_and_gpu_lists(tmp_path):
    nodes = plan_nodes(tmp_path, Path("/tmp/s"), "gpu", parse_node_gpus("0,1:2,3", 2), 2)
    assert [n.name for n in nodes] == ["gpu-0", "gpu-1"]
    assert nodes[1].home == tmp_path / "nodes" / "gpu-1" / "home" and nodes[1].log_dir == nodes[1].home / "logs"
    assert nodes[0].env() == {"FLAME_HOME": str(nodes[0].home), "FLAME_SOCKET_DIR": "/tmp/s/0", NODE_ENV: "gpu-0",
                              "CUDA_VISIBLE_DEVICES": "0,1"}
    assert nodes[1].command(["/bin/x", "-a"])[-4:] == ["exec", "gpu-1", "/bin/x", "-a"]
    assert parse_node_gpus("each", 3) == ("0", "1", "2") and parse_node_gpus(None, 2) == ()
    for bad in ("0", "0:1:2", "0:"):
        with pytest.raises(ValueError, match="one per node"):
            parse_node_gpus(bad, 2)


def test_each_emulated_node_locks_its_engine_slots_in_a_folder_of_its_own(monkeypatch, tmp_path):
    monkeypatch.delenv(NODE_ENV, raising=False)
    assert node_lock_dir(tmp_path) == tmp_path  # a real host: the folder as given
    monkeypatch.setenv(NODE_ENV, "node-1")
    assert node_lock_dir(tmp_path) == tmp_path / "node-1"


def test_a_leave_ping_is_answered_then_the_service_stops(lock_dir):  # noqa: F811
    svc = VllmBatchService()
    gone = threading.Event()
    svc.on_session_gone = lambda why: gone.set()
    try:
        svc.on_session_enter(_ctx(_common(lock_dir)))
        plain = pl.decode_result(svc.on_task_invoke(_task(pl.encode_ping(1).data)))
        assert "leaving" not in plain.meta and not gone.wait(1.0)  # a warm-up ping changes nothing
        r = pl.decode_result(svc.on_task_invoke(_task(pl.encode_ping(2, {pl.LEAVE: True}).data, tid="2")))
        assert r.meta["leaving"] is True and r.meta["executor"]["id"] == svc.executor_id
        assert gone.wait(5), "the service asked its process to stop"
    finally:
        svc.shutdown()


class _Flame:
    """A session manager that lists ``live`` executors of session ``s1`` Bound; each leave ping is answered by the
    next executor that has not answered yet (``mute``: never answers)."""

    def __init__(self, live: list, mute: tuple = ()):
        self.live, self.mute, self.answered, self.tasks = live, set(mute), [], {}

    def list_executors(self):
        return [SimpleNamespace(metadata=SimpleNamespace(id=x), spec=SimpleNamespace(node="n"),
                                status=SimpleNamespace(session_id="s1", state=4)) for x in self.live]  # 4: Bound

    def create_task(self, data: bytes) -> str:
        tid = str(len(self.tasks) + 1)
        who = next((x for x in self.live if x not in self.answered and x not in self.mute), None)
        if who is not None:
            self.answered.append(who)
        self.tasks[tid] = who
        return tid

    def get_task(self, tid: str):
        who = self.tasks[tid]
        if who is None:
            return SimpleNamespace(state=0, output=None)  # Pending: nobody takes it
        out = pl.encode_result(0, [], meta={"executor": {"id": who}, "leaving": True}).data
        return SimpleNamespace(state=2, output=out)


def test_release_asks_every_live_executor_once_and_reports_what_is_left():
    flame = _Flame(["a", "b", "c"], mute=("c",))
    rs = SimpleNamespace(id="s1", conn=flame, session=flame, create_task=flame.create_task)
    out = release_survivors(rs, wait_s=1.0, poll_s=0.05)
    assert out["released"] == ["a", "b"] and out["left"] == ["c"] and 1.0 <= out["seconds"] < 3
    assert len(flame.tasks) == 3  # one ping per live executor; none again while the unanswered one is pending
    none_left = _Flame([])
    rs = SimpleNamespace(id="s1", conn=none_left, session=none_left, create_task=none_left.create_task)
    assert release_survivors(rs, wait_s=5.0) == {"released": [], "left": [], "seconds": pytest.approx(0, abs=0.5)}
    assert not none_left.tasks


@pytest.mark.parametrize("args, said", [
    (["--nodes", "1000"], "--nodes 1000: expected 1 to 64"),
    (["--nodes", "65"], "--nodes 65: expected 1 to 64"),
    (["--nodes", "2", "--node-gpus", "a b:c"], "--node-gpus 'a b:c': 'a b' is no CUDA_VISIBLE_DEVICES value"),
    (["--nodes", "2", "--node-gpus", "0;1:2"], "--node-gpus '0;1:2': '0;1' is no CUDA_VISIBLE_DEVICES value"),
    (["--nodes", "2", "--node-gpus", "0,:1"], "'0,' is no CUDA_VISIBLE_DEVICES value"),
    (["--nodes", "3", "--node-gpus", "0,1:2:1"], "--node-gpus '0,1:2:1': GPU 1 is given to node 0 and node 2"),
    (["--nodes", "3", "--node-gpus", "each"], "--node-gpus 'each': node 2's GPU 2 is not on this host (nvidia-smi "
                                              "-L lists GPU 0, 1 and their GPU- / MIG- ids)"),
    (["--nodes", "2", "--node-gpus", "0:GPU-ffff"], "node 1's GPU GPU-ffff is not on this host"),
    (["--nodes", "2", "--node-gpus", "0:GPU-aaaa"], "node 1's GPU GPU-aaaa is node 0's GPU 0 again (GPU-aaaa; "),
    (["--nodes", "2", "--node-gpus", "0:GPU-a"], "node 1's GPU GPU-a is node 0's GPU 0 again (GPU-aaaa; "),
])
def test_odd_node_counts_and_gpu_values_exit_2_before_a_work_folder(monkeypatch, tmp_path, capsys, args, said):
    from sut.flame import cluster
    from sut.flame.cluster import main

    def never(*_a, **_k):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(cluster, "host_gpus", lambda: {"0": "GPU-aaaa", "1": "GPU-bbbb", "GPU-aaaa": "GPU-aaaa",
                                                      "GPU-bbbb": "GPU-bbbb"})  # a 2-GPU host
    monkeypatch.setattr(cluster, "RealCluster", never)
    monkeypatch.setattr(cluster, "_check_args", never)
    work = tmp_path / "w"
    with pytest.raises(SystemExit) as e:
        main(["--workdir", str(work), *args])
    assert e.value.code == 2 and said in str(e.value) + capsys.readouterr().err, str(e.value)
    assert not work.exists()


def test_gpu_values_may_be_indices_uuids_or_mig_ids():
    uuid = "GPU-5c2a0f1e-8d4b-4c1a-9f3e-2b7d6a1c0e9f"
    mig = "MIG-GPU-5c2a0f1e-8d4b-4c1a-9f3e-2b7d6a1c0e9f/1/0"
    assert parse_node_gpus(f"0,1:{uuid}:{mig}", 3) == ("0,1", uuid, mig)


def test_a_stop_signal_during_the_cluster_start_stops_it_at_once_without_printing_an_endpoint(monkeypatch, tmp_path,
                                                                                             capsys):
    import os
    import signal
    import time

    from sut.flame import cluster
    from tests.conftest import flame_bin_dir

    class SlowStart:
        stopped = False

        def __init__(self, settings):
            self.endpoint, self.nodes, self.workdir = "http://127.0.0.1:1", [], tmp_path

        def start(self):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # nodes not Ready yet
                return self
            except BaseException:
                self.stop()
                raise

        def stop(self):
            SlowStart.stopped = True

    monkeypatch.setattr(cluster, "RealCluster", SlowStart)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.main(["--workdir", str(tmp_path / "w"), "--flame-bin", str(flame_bin_dir())])
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert time.monotonic() - t0 < 3 and SlowStart.stopped
    assert "FLAME_ENDPOINT" not in capsys.readouterr().out


def test_a_work_folder_in_use_by_another_cluster_exits_2(monkeypatch, tmp_path):
    """Two clusters on one --workdir would share cluster.yaml: the second would point the first's executor managers at
    its own session manager."""
    import fcntl
    import os

    from sut.flame import cluster
    from tests.conftest import flame_bin_dir

    def never(*_a, **_k):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(cluster, "RealCluster", never)
    work = tmp_path / "w"
    work.mkdir()
    with open(work / cluster.WORKDIR_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"{os.getpid()}\n")
        held.flush()
        with pytest.raises(SystemExit) as e:
            cluster.main(["--workdir", str(work), "--flame-bin", str(flame_bin_dir())])
    assert e.value.code == 2 and f"--workdir {work}: in use by another cluster (pid {os.getpid()})" in str(e.value)


def test_each_executor_up_line_and_the_run_summary_name_the_node_of_its_shard(caplog):
    """Two executors on two nodes, each on its node's shard cpu-0-1.e0: the console tells the nodes apart."""
    from sut.cli import _print_summary, shards_by_node
    from sut.flame.session import SUCCEED
    from sut.flame.stats import FlameStats
    from sut.flame.warmup import PING_BATCH_BASE, Warmup

    stats = FlameStats()
    rs = SimpleNamespace(id="s1", replica=0, endpoint="http://fsm:8080", o=SimpleNamespace())
    w = Warmup(rs, 2, stats.note_ping)
    for i, node in enumerate(("node-0", "node-1")):
        meta = {"executor": {"id": f"ex{i}", "node": node, "pid": 100 + i, "role": "host", "seat": 0},
                "shard": {"key": "cpu-0-1.e0", "node": node, "device_name": "AMD EPYC 9654"}}
        w.results[f"t{i}"] = (SUCCEED, pl.encode_result(PING_BATCH_BASE + i, [], meta=meta).data, "")
    with caplog.at_level("INFO", logger="sut.flame.transport"):
        w._collect()
    lines = [r.getMessage() for r in caplog.records if " up: " in r.getMessage()]
    assert [ln.split(" -> ")[1] for ln in lines] == ["shard cpu-0-1.e0 on node-0 (AMD EPYC 9654)",
                                                     "shard cpu-0-1.e0 on node-1 (AMD EPYC 9654)"], lines
    shards = stats.record()["shards"]
    assert [s["shard"] for s in shards] == ["node-0/cpu-0-1.e0", "node-1/cpu-0-1.e0"]
    assert shards_by_node(shards) == "node-0: cpu-0-1.e0 (AMD EPYC 9654); node-1: cpu-0-1.e0 (AMD EPYC 9654)"
    rec = {"output_dir": "RUN", "sut": "flame", "scenario": "Offline", "mode": "accuracy", "flame": {"shards": shards},
           "compliance": {"compliant": True, "reasons": []}, "ledger": {"completed": 8, "issued": 8}}
    caplog.clear()
    with caplog.at_level("INFO", logger="sut"):
        _print_summary(rec)
    summary = "\n".join(r.getMessage() for r in caplog.records)
    assert "engine shards   : node-0: cpu-0-1.e0 (AMD EPYC 9654); node-1: cpu-0-1.e0 (AMD EPYC 9654)" in summary


def test_node_gpus_are_checked_against_what_nvidia_smi_lists(monkeypatch):
    """``--node-gpus each`` gave node i GPU i on any host: a node then reported a GPU it did not have."""
    from sut.flame import nodes

    listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-48ae3960-6069-16e6-967a-4c64ff4fc453)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0c86ccab-1111-2222-3333-444455556666)\n"
               "  MIG 1g.10gb     Device  0: (UUID: MIG-5a4c9e1f-aaaa-bbbb-cccc-ddddeeeeffff)\n")
    monkeypatch.setattr(nodes.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""))
    listed = nodes.host_gpus()
    assert set(listed) == {"0", "1", "GPU-48ae3960-6069-16e6-967a-4c64ff4fc453",
                           "GPU-0c86ccab-1111-2222-3333-444455556666", "MIG-5a4c9e1f-aaaa-bbbb-cccc-ddddeeeeffff"}
    assert listed["1"] == "GPU-0c86ccab-1111-2222-3333-444455556666"
    nodes.check_node_gpus(("0", "MIG-5a4c9e1f-aaaa-bbbb-cccc-ddddeeeeffff"), listed, "0:MIG-5a4c9e1f-...")
    nodes.check_node_gpus(("0,1",), listed, "0,1")
    with pytest.raises(ValueError, match="node 0's GPU 2 is not on this host"):
        nodes.check_node_gpus(("1,2",), listed, "1,2")
    with pytest.raises(ValueError, match="this host has no NVIDIA GPU that nvidia-smi -L lists"):
        nodes.check_node_gpus(("0",), None, "each")

    def missing(*_a, **_k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(nodes.subprocess, "run", missing)
    assert nodes.host_gpus() is None
    monkeypatch.setattr(nodes.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 9, "", "no driver"))
    assert nodes.host_gpus() is None


def test_node_gpus_take_cuda_s_abbreviated_uuids_and_refuse_one_gpu_under_two_names():
    """CUDA takes a UUID's first characters (``GPU-48ae3960``) when no other GPU's UUID starts so: such a value was
    refused as 'not on this host'; a GPU given as its index to one node and as its UUID to another was let through
    (two nodes sharing one GPU)."""
    from sut.flame import nodes

    a, b = "GPU-48ae3960-6069-16e6-967a-4c64ff4fc453", "GPU-48ae0000-1111-2222-3333-444455556666"
    listed = {"0": a, "1": b, a: a, b: b}
    nodes.check_node_gpus(("GPU-48ae3960", "GPU-48ae0"), listed, "GPU-48ae3960:GPU-48ae0")
    with pytest.raises(ValueError, match="node 0's GPU GPU-48ae is the start of 2 of this host's ids"):
        nodes.check_node_gpus(("GPU-48ae", "1"), listed, "GPU-48ae:1")
    with pytest.raises(ValueError, match=f"node 1's GPU GPU-48ae3960 is node 0's GPU 0 again \\({a}; "):
        nodes.check_node_gpus(("0", "GPU-48ae3960"), listed, "0:GPU-48ae3960")
    with pytest.raises(ValueError, match="node 0's GPU 1 is node 0's GPU GPU-48ae0 again"):
        nodes.check_node_gpus(("GPU-48ae0,1",), listed, "GPU-48ae0,1")
    with pytest.raises(ValueError, match="GPU GPU-48AE3960 is not on this host \\(nvidia-smi writes it GPU-48ae3960"):
        nodes.check_node_gpus(("GPU-48AE3960",), listed, "GPU-48AE3960")
