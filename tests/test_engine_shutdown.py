"""Engine worker shutdown when the worker has forked children (vLLM's EngineCore on a GPU).

On the H200 (2026-12-01) every stop of a standalone engine pair took 45 s: the parent joined on the worker's
process sentinel, which a forked child keeps open (30 s join timeout), then waited on a process group whose
only members left were zombies nobody reaps (10 s SIGTERM + 5 s SIGKILL waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import proc_state, process_ended

import sut.engine.handle as handle_mod
from sut.engine.devices import EngineSlot
from sut.engine.handle import EngineHandle, live_group_members
from sut.engine.settings import EngineSettings, GenerationSettings

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")




def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_live_group_members_leaves_out_zombies():
    # the leader forks a child that exits at once and never reaps it: the group = live leader + zombie child
    code = "import os, sys, time\npid = os.fork()\nif pid == 0: os._exit(0)\nprint(pid, flush=True)\ntime.sleep(60)\n"
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(leader.stdout.readline())
        assert _wait_for(lambda: proc_state(child) == "Z")
        assert live_group_members(leader.pid) == [leader.pid]
    finally:
        leader.kill()
        leader.wait()
    assert live_group_members(leader.pid) == []


def test_shutdown_is_quick_when_the_worker_forked_a_child(monkeypatch):
    import fake_engine_worker

    monkeypatch.setattr(handle_mod, "worker_main", fake_engine_worker.forking_worker)
    h = EngineHandle(EngineSlot(0, "cpu", "0"), EngineSettings(model="m"), GenerationSettings())
    h.start()
    try:
        child = h.wait_ready(30)["child_pid"]
        assert not process_ended(child)
    finally:
        t0 = time.monotonic()
        h.shutdown()
        took = time.monotonic() - t0
    assert took < 8, f"shutdown took {took:.1f} s (the sentinel join waits for the forked child)"
    assert h._proc.exitcode == 0
    assert process_ended(child), "the worker's forked child outlived the shutdown"


def test_watcher_sees_a_worker_death_while_its_child_holds_the_pipe(monkeypatch):
    """A worker killed while its forked child holds the pipe is reported at once, naming the signal and, for a
    SIGKILL the harness did not send, its likely sender (the out-of-memory killer: an engine given more KV cache than
    the host could hold said only "exited unexpectedly with code -9")."""
    import fake_engine_worker

    monkeypatch.setattr(handle_mod, "worker_main", fake_engine_worker.forking_worker)
    h = EngineHandle(EngineSlot(0, "cpu", "0"), EngineSettings(model="m"), GenerationSettings())
    h.start()
    fatal = []
    try:
        h.wait_ready(30)
        h.watch(lambda i, c: None, fatal.append)
        os.kill(h.pid, signal.SIGKILL)
        assert _wait_for(lambda: fatal, timeout=5.0), "the watcher did not report the dead worker"
    finally:
        h.shutdown()
    first, _, rest = fatal[0].partition("\n")
    assert first == f"engine 0 (pid {h.pid}) exited unexpectedly with code -9 (SIGKILL)"
    assert "out-of-memory killer" in rest and "dmesg" in rest and "--cpu-kvcache-gib" in rest


@pytest.mark.parametrize("code, how, hint", [
    (1, "code 1", False), (-int(signal.SIGSEGV), "code -11 (SIGSEGV)", False),
    (-int(signal.SIGKILL), "code -9 (SIGKILL)", True), (None, "code None", False)])
def test_exit_how_names_a_signal_and_hints_at_the_oom_killer_for_sigkill_only(code, how, hint):
    short, note = handle_mod.exit_how(code)
    assert short == how and bool(note) is hint


def test_worker_ends_and_reaps_its_children_before_exiting():
    code = textwrap.dedent("""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        from sut.engine.worker import _end_children
        _end_children(5.0)
        print(os.path.exists(f"/proc/{p.pid}"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(120)
def test_shutdown_right_after_start_ends_a_worker_that_has_no_process_group_yet(tmp_path, monkeypatch):
    """``shutdown`` at once after ``start`` (EnginePool's cleanup on an early Ctrl-C): the spawned worker has not
    run ``os.setpgrp`` yet, so ``killpg(pid)`` finds no group; it was missed and went on to build its engine."""
    import vllm_standin
    from conftest import TINY_MODEL

    from sut.engine import plan_engines

    vllm_standin.install(tmp_path / "standin", monkeypatch)
    monkeypatch.setenv("STANDIN_CHILD_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("STANDIN_START_S", "600")
    es = EngineSettings(model=str(TINY_MODEL), device="cpu", max_model_len=512)
    h = EngineHandle(plan_engines(es)[0], es, GenerationSettings(max_tokens=4))
    h.start()
    t0 = time.monotonic()
    h.shutdown()
    took = time.monotonic() - t0
    time.sleep(3)  # a worker that survived would reach LLM.__init__ (and start its child) by now
    kids = [int(k) for k in (tmp_path / "pids").read_text().split()] if (tmp_path / "pids").exists() else []
    live = [p for p in [h.pid] + kids if not process_ended(p)]
    for p in live:
        try:
            os.kill(p, 9)
        except OSError:
            pass
    assert not live, f"left running: {live} (shutdown took {took:.1f} s)"
    assert took < 4.5, f"shutdown took {took:.1f} s"


@pytest.mark.parametrize("shielded", [True, False])
def test_ctrl_c_while_a_worker_starts_up_reaches_only_the_parent(tmp_path, shielded):
    """A spawned worker shares the terminal's process group until ``_pin`` runs; a Ctrl-C then killed it with a
    ``KeyboardInterrupt`` traceback from Python's start-up (``init_import_site``). ``start_with_sigint_blocked``
    makes it start with SIGINT blocked; unshielded, the same signals kill it (the test's control)."""
    import multiprocessing as mp

    import fake_engine_worker

    marker = tmp_path / "marker"
    proc = mp.get_context("spawn").Process(target=fake_engine_worker.pin_then_mark,
                                           args=(EngineSlot(0, "cpu", "0"), str(marker)))
    # a terminal's parent: SIGINT handled and not blocked (an earlier test of this process may leave it ignored,
    # which a child inherits, and the control would then survive)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        if shielded:
            handle_mod.start_with_sigint_blocked(proc)
        else:
            proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGINT, old_handler)
    for _ in range(6):  # through interpreter start-up, imports and _pin
        try:
            os.kill(proc.pid, 2)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    proc.join(30)
    if shielded:
        assert proc.exitcode == 0 and marker.read_text() == "ok"
    else:
        assert proc.exitcode != 0 and not marker.exists()


def test_a_stopped_worker_is_ended_at_once_not_after_the_stop_wait(monkeypatch, caplog):
    """A SIGSTOPped worker reads neither Stop nor SIGTERM: waiting 30 s for Stop and 10 s for SIGTERM (41 s before)
    ends in SIGKILL anyway, so it is ended at once, with the worker's child."""
    import fake_engine_worker

    monkeypatch.setattr(handle_mod, "worker_main", fake_engine_worker.forking_worker)
    h = EngineHandle(EngineSlot(0, "cpu", "0"), EngineSettings(model="m"), GenerationSettings())
    h.start()
    child = h.wait_ready(30)["child_pid"]
    os.kill(h.pid, signal.SIGSTOP)
    assert _wait_for(lambda: proc_state(h.pid) in ("T", "t"))
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        h.shutdown()
    took = time.monotonic() - t0
    assert took < 8, f"shutdown of a stopped worker took {took:.1f} s"
    assert h._proc.exitcode == -signal.SIGKILL and process_ended(child)
    assert any("is stopped (SIGSTOP or a debugger): ending its process group at once" in r.getMessage()
               for r in caplog.records)
