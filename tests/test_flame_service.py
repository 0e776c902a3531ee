"""The Flame service in-process (no Flame, no vLLM: the fake engine through the engine_factory extension
point): seats, the replica's pinned slot, host + forwarder, batches, cached tokens and times, errors, GC."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import flamepy
import numpy as np
import pytest

from sut.engine import EngineSettings, GenerationSettings, plan_engines
from sut.flame import payload as pl
from sut.flame.seats import slot_keys, take_seat
from sut.flame.service import VllmBatchService
from sut.flame.service_config import make_common_data
from tests.flame_doubles import Faults, fake_generate, fake_options

GEN = GenerationSettings(eos_token_ids=(128009,))
TINY = Path(__file__).resolve().parent.parent / "sut" / "models" / "tiny-llama3"


@pytest.fixture
def lock_dir():
    d = Path(tempfile.mkdtemp(prefix="sfs-", dir="/tmp"))  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _common(lock_dir, engine=None, **kw):
    es = engine or EngineSettings(model=str(TINY), max_model_len=1024, device="cpu")
    return make_common_data(es, GEN, lock_dir=str(lock_dir), **dict(fake_options(step_s=0.01), **kw))


def _ctx(common, sid="s1"):
    return flamepy.SessionContext(_common_data=common, session_id=sid, application=flamepy.ApplicationContext(name="sut-vllm"))


def _task(data, tid="1"):
    return flamepy.TaskContext(task_id=tid, session_id="s1", input=data)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128000, size=20 + 3 * i, dtype=np.int32) for i in range(n)]


def test_seats_spread_over_slots(lock_dir):
    keys = ["cuda-0.e0", "cuda-1.e0"]
    got = [take_seat(lock_dir, keys)[:2] for _ in range(5)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]


def test_slot_keys_are_unique():
    from sut.engine import EngineSlot

    slots = [EngineSlot(0, "cuda", "GPU-ab/1", 2), EngineSlot(1, "cuda", "GPU-ab/1", 2), EngineSlot(2, "cpu", "0-1")]
    assert slot_keys(slots) == ["cuda-GPU-ab_1.e0", "cuda-GPU-ab_1.e1", "cpu-0-1.e0"]


def test_host_and_forwarder_share_one_engine(lock_dir):
    common = _common(lock_dir)
    host, fwd = VllmBatchService(), VllmBatchService()
    try:
        host.on_session_enter(_ctx(common))
        fwd.on_session_enter(_ctx(common))
        assert (host.role, host.seat, fwd.role, fwd.seat) == ("host", 0, "forwarder", 1)
        assert fwd.client.shard["host_pid"] == host.host.shard["host_pid"]
        prompts = _prompts(6)
        outs = {}

        def run(svc, rids, ps, tid):
            outs[tid] = pl.decode_result(svc.on_task_invoke(_task(pl.encode_task(int(tid), rids, prompts=ps).data, tid)))

        threads = [threading.Thread(target=run, args=(host, [1, 2, 3], prompts[:3], "1")),
                   threading.Thread(target=run, args=(fwd, [4, 5, 6], prompts[3:], "2"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for tid, rids, ps in (("1", [1, 2, 3], prompts[:3]), ("2", [4, 5, 6], prompts[3:])):
            r = outs[tid]
            assert [s.request_id for s in r.samples] == rids  # input order
            for s, p in zip(r.samples, ps):
                assert s.ok and np.array_equal(s.token_ids, fake_generate(p, 128, 128009))
        assert outs["2"].meta["executor"]["role"] == "forwarder" and outs["1"].meta["executor"]["role"] == "host"
        ping = pl.decode_result(fwd.on_task_invoke(_task(pl.encode_ping(99).data, "3")))
        assert ping.meta["shard"]["key"] == "cpu-0-1.e0" and ping.meta["executor"]["pid"] > 0
        assert "fake" in ping.meta["engine"]
    finally:
        fwd.shutdown()
        host.shutdown()


def test_a_slot_held_by_another_sessions_host_fails_the_enter_after_slot_wait_s(lock_dir):
    """A new user's second Flame run waited ~10 min in silence while another cluster's run held the host's one
    CPU slot (the locks are per host): after slot_wait_s the enter fails, naming the slot and its holder."""
    import os
    import time

    host, other = VllmBatchService(), VllmBatchService()
    try:
        host.on_session_enter(_ctx(_common(lock_dir), sid="run-a"))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as ei:
            other.on_session_enter(_ctx(_common(lock_dir, slot_wait_s=1.5), sid="run-b"))
        waited = time.monotonic() - t0
        assert 1.5 <= waited < 5.0, waited
        msg = str(ei.value)
        assert "engine slot cpu-0-1.e0" in msg and "(run-a, pid %d)" % os.getpid() in msg and "slot_wait_s" in msg
    finally:
        other.shutdown()
        host.shutdown()
    late = VllmBatchService()  # once the holder is gone the slot is free again
    try:
        late.on_session_enter(_ctx(_common(lock_dir, slot_wait_s=1.5), sid="run-b"))
        assert late.role == "host"
    finally:
        late.shutdown()


def test_per_sample_errors_travel_in_the_result(lock_dir):
    host = VllmBatchService()
    try:
        host.on_session_enter(_ctx(_common(lock_dir)))
        too_long = np.arange(2000, dtype=np.int32)
        bad_id = np.array([5, 200000], dtype=np.int32)
        good = _prompts(1)[0]
        r = pl.decode_result(host.on_task_invoke(_task(pl.encode_task(0, [7, 8, 9], prompts=[too_long, good, bad_id]).data)))
        assert [s.ok for s in r.samples] == [False, True, False]
        assert "more than max_model_len" in r.samples[0].error and "vocabulary" in r.samples[2].error
    finally:
        host.shutdown()


def test_session_mismatch_and_bad_common_data(lock_dir):
    svc = VllmBatchService()
    with pytest.raises(ValueError, match="common data"):
        svc.on_session_enter(_ctx(None))
    with pytest.raises(ValueError, match="protocol"):
        svc.on_session_enter(_ctx(b'{"protocol": 99}'))
    with pytest.raises(RuntimeError, match="boom"):
        VllmBatchService(Faults(enter_error="boom")).on_session_enter(_ctx(_common(lock_dir)))


def test_service_hooks_come_from_the_common_data(lock_dir):
    """The session's service_hooks ("module:callable" + args) are loaded by the service itself; a spec that
    does not import fails on_session_enter naming it."""
    common = _common(lock_dir, **fake_options(faults={"enter_error": "from the common data"}))
    with pytest.raises(RuntimeError, match="from the common data"):
        VllmBatchService().on_session_enter(_ctx(common))
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        VllmBatchService().on_session_enter(_ctx(_common(lock_dir, engine_factory="no_such_module_xyz:f")))


def test_prefix_caching_guard_before_the_engine_is_built(lock_dir):
    """The one guard (sut.core.guard) runs in the engine host before any engine exists; the spec's
    allow_prefix_caching (the locality entry point) lets it through."""
    from sut.core.guard import PROHIBITED

    es = EngineSettings(model=str(TINY), max_model_len=1024, device="cpu", enable_prefix_caching=True)
    svc = VllmBatchService()
    try:
        with pytest.raises(RuntimeError, match=PROHIBITED.split("(")[0].strip()):
            svc.on_session_enter(_ctx(_common(lock_dir, engine=es)))
        assert svc.host.handle is None  # refused before the engine was built
    finally:
        svc.shutdown()
    ok = VllmBatchService()
    try:
        ok.on_session_enter(_ctx(_common(lock_dir, engine=es, allow_prefix_caching=True), sid="s2"))
        assert ok.host.info["enable_prefix_caching"] is True
    finally:
        ok.shutdown()


def test_session_is_pinned_to_its_replicas_slot(lock_dir):
    """Replica r's session takes a seat of engine slot r only (plan_engines order), and its results name it;
    a host that plans fewer slots refuses the session with the reason."""
    es = EngineSettings(model=str(TINY), max_model_len=1024, device="cpu", engines_per_device=2)
    svc = VllmBatchService()
    try:
        svc.on_session_enter(_ctx(_common(lock_dir, engine=es, slot=1)))
        assert svc.role == "host" and svc.host.slot.index == 1 and svc.host.key.endswith(".e0")
        assert svc.host.key == slot_keys(plan_engines(es))[1]
        assert (lock_dir / f"{svc.host.key}.seat0.lock").exists()
        r = pl.decode_result(svc.on_task_invoke(_task(pl.encode_task(0, [1], prompts=_prompts(1)).data)))
        assert r.meta["replica"] == 1 and r.meta["shard"] == svc.host.key
    finally:
        svc.shutdown()
    with pytest.raises(ValueError, match="needs engine slot 2, but this executor's host .* plans 2 slot"):
        VllmBatchService().on_session_enter(_ctx(_common(lock_dir, engine=es, slot=2), sid="s3"))


def test_results_carry_cached_tokens_and_engine_times(lock_dir):
    """Each sample of a result carries the engine's cached prompt tokens and its queued/first/done times."""
    import time

    host = VllmBatchService()
    try:
        host.on_session_enter(_ctx(_common(lock_dir)))
        p = np.arange(1, 41, dtype=np.int32)  # 40 tokens: two whole 16-token blocks
        t0 = time.monotonic()
        first = pl.decode_result(host.on_task_invoke(_task(pl.encode_task(0, [1], prompts=[p]).data)))
        again = pl.decode_result(host.on_task_invoke(_task(pl.encode_task(1, [2], prompts=[p]).data)))
        assert first.samples[0].cached_tokens == 0 and again.samples[0].cached_tokens == 32
        s = again.samples[0]
        assert t0 <= s.t_queued <= s.t_first <= s.t_done <= time.monotonic()
    finally:
        host.shutdown()


def test_injected_task_failure_counts_across_executors(lock_dir, tmp_path):
    faults = Faults(task_error={"batches": [3], "times": 1}, state_dir=str(tmp_path))
    host = VllmBatchService(faults)
    try:
        host.on_session_enter(_ctx(_common(lock_dir)))
        data = pl.encode_task(3, [1], prompts=_prompts(1)).data
        with pytest.raises(RuntimeError, match="injected"):
            host.on_task_invoke(_task(data))
        assert pl.decode_result(host.on_task_invoke(_task(data))).samples[0].ok  # second attempt passes
    finally:
        host.shutdown()


def test_gc_is_frozen_after_enter_and_unfrozen_at_shutdown(lock_dir):
    import gc

    host = VllmBatchService()
    host.on_session_enter(_ctx(_common(lock_dir)))
    assert gc.get_freeze_count() > 0
    host.shutdown()
    assert gc.get_freeze_count() == 0
    st = host.gcmon.stats()
    assert st["freeze_ms"] > 0 and st["frozen_objects"] > 0  # the freeze's collection is kept apart


def test_output_goes_to_the_run_folder_on_the_clients_host(tmp_path):
    """From on_session_enter on, the service process's stdout/stderr -- and so the engine worker's, started
    later -- go to <log_dir>/<executor id>.log; a client on another host leaves them where Flame put them."""
    import subprocess
    import sys

    code = """
import os, socket, sys
from sut.flame.service import VllmBatchService
from sut.flame.service_config import ServiceConfig, make_common_data
from sut.engine import EngineSettings, GenerationSettings
host = sys.argv[2]
cfg = ServiceConfig.from_bytes(make_common_data(EngineSettings(model="m"), GenerationSettings(), log_dir=sys.argv[1],
                                                client_host=socket.gethostname() if host == "same" else "elsewhere"))
svc = VllmBatchService()
svc.session_id = "s1"
print("before", flush=True)
svc._redirect_output(cfg)
print("after", flush=True)
os.system("echo child-process")
"""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "FLAME_INSTANCE_ENDPOINT": "/x/exec-7.sock",
           "PATH": "/usr/bin:/bin"}
    for host in ("same", "other"):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / host), host], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        if host == "same":
            text = (tmp_path / "same" / "exec-7.log").read_text()
            assert "after" in text and "child-process" in text and "before" not in text
            assert "before" in out.stdout and "after" not in out.stdout
        else:
            assert not (tmp_path / "other").exists() and "child-process" in out.stdout


def test_instance_socket_appears_only_once_listening(tmp_path):
    """The executor manager connects the moment the socket file exists; grpc creates it at bind(), before
    listen(). listen_unix binds a temporary path and renames it into place."""
    import concurrent.futures as cf
    import os
    import socket

    import grpc

    from sut.flame.service import listen_unix

    endpoint = str(tmp_path / "exec-1.sock")
    server = grpc.server(cf.ThreadPoolExecutor(1))
    bound = []
    real_add = server.add_insecure_port

    def add(addr):
        bound.append((addr, os.path.exists(endpoint)))
        return real_add(addr)

    server.add_insecure_port = add
    listen_unix(server, endpoint)
    try:
        assert bound == [(f"unix://{endpoint}.{os.getpid()}.tmp", False)]  # the endpoint did not exist while binding
        assert os.listdir(tmp_path) == ["exec-1.sock"]
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(endpoint)  # listening already, before server.start()
    finally:
        server.stop(0)
