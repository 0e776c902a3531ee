"""A server that ``http_servers.launch`` starts (its own process group) ends when the harness dies, even by SIGKILL:
``setpriv --pdeathsig TERM`` then a parent check in ``sh`` (``http_servers._PARENT_CHECK``)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, process_ended, sut_env

from sut.core.transports import http_servers as servers

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and shutil.which("setpriv")),
                                reason="needs Linux with util-linux setpriv")

HARNESS = (
    "import sys, time\n"
    "from sut.core.transports import http_servers as s\n"
    "from sut.engine import EngineSettings, EngineSlot\n"
    "p = s.launch(0, EngineSlot(0, 'cpu', '0'), EngineSettings(model='m'), ['bash', '-c', 'sleep 300', '--'], None)\n"
    "print(p.proc.pid, p.cmd[0], flush=True)\n"
    "time.sleep(300)\n")


def ended_within(pid: int, seconds: float) -> bool:
    """True once ``pid`` is gone or a zombie (ended, not reaped: PID 1 in a container may not reap)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process_ended(pid):
            return True
        time.sleep(0.1)
    return False


def kill_harness_and_check(env: dict) -> None:
    harness = subprocess.Popen([sys.executable, "-c", HARNESS], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    pid, first = harness.stdout.readline().split()
    assert first == "bash"  # the recorded command is the server's own, without the prefix
    os.kill(int(pid), 0)  # started
    harness.kill()
    harness.wait()
    if not ended_within(int(pid), 10):
        os.killpg(int(pid), signal.SIGKILL)
        pytest.fail("the server outlived the SIGKILLed process that started it")


def test_a_started_server_dies_with_a_harness_killed_by_sigkill():
    """After SIGKILL of a `--http` locality run, its two `vllm serve` servers kept running."""
    kill_harness_and_check(sut_env())


def test_a_harness_killed_before_setpriv_armed_the_signal_leaves_no_server(tmp_path):
    """Killed right after ``Popen`` returned, while setpriv was still starting, the harness left
    ``sleep 300`` running (no parent-death signal comes once the parent is gone). A slow setpriv makes that window 1 s
    wide; the server must still not start."""
    fake = tmp_path / "bin" / "setpriv"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nsleep 1\nexec {shutil.which('setpriv')} \"$@\"\n")
    fake.chmod(0o755)
    env = sut_env()
    env["PATH"] = f"{fake.parent}{os.pathsep}{env.get('PATH', '')}"
    kill_harness_and_check(env)


@pytest.mark.parametrize("parent, ran", [("mine", True), ("other", False)])
def test_the_parent_check_starts_the_command_only_under_its_parent(tmp_path, parent, ran):
    mark = tmp_path / "ran"
    pid = str(os.getpid()) if parent == "mine" else "1"
    code = subprocess.run(["sh", "-c", servers._PARENT_CHECK, "sh", pid, "touch", str(mark)]).returncode
    assert (code, mark.exists()) == ((0, True) if ran else (1, False))
