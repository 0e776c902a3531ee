"""Stop signals of ``python -m sut run`` without engines: SIGINT works even when inherited as ignored,
a second signal does not cut the shutdown short, and the run record names the signal (issue 16)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, sut_env
from sut import exits
from sut.harness import interrupt_reason

def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does for `cmd &`


# A stand-in for a run: install the handlers as cmd_run does, report, then wait to be stopped.
_CHILD = """
import sys, time
from sut import exits
exits.stop_on_sigterm_like_ctrl_c()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt as e:
    print("stopped:", e.args[0], flush=True)
    sys.exit(exits.EXIT_INTERRUPTED)
sys.exit(3)
"""


@pytest.mark.parametrize("sig, name", [(signal.SIGINT, "SIGINT, Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_stop_signals_work_even_when_sigint_was_inherited_ignored(sig, name):
    # SIG_IGN survives exec: the wrapper ignores SIGINT and execs the run, as a shell does for `cmd &`. (No
    # preexec_fn: forking a process that has gRPC threads and running Python before exec can hang the child.)
    wrapper = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
               "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])")
    p = subprocess.Popen([sys.executable, "-c", wrapper, _CHILD], cwd=REPO, env=sut_env(), stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(sig)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and f"stopped: {name}" in out, (p.returncode, out)


def test_a_second_signal_is_logged_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(exits, "_interrupted", type(exits._interrupted)())
    monkeypatch.setattr(exits, "_again", type(exits._again)())
    with pytest.raises(KeyboardInterrupt) as first:
        exits._raise_interrupt(signal.SIGTERM, None)
    assert interrupt_reason(first.value) == "interrupted (SIGTERM)" and not exits.stopped_again()
    exits._raise_interrupt(signal.SIGINT, None)  # the clean shutdown goes on
    assert "already stopping" in caplog.text
    assert exits.stopped_again()  # ... without waiting for a Flame session's running tasks


def test_a_bare_keyboard_interrupt_is_ctrl_c():
    assert interrupt_reason(KeyboardInterrupt()) == "interrupted (SIGINT, Ctrl-C)"


def test_sut_run_stopped_while_checking_the_dataset_exits_130(tmp_path):
    """A stop before LoadGen (here: while the dataset file is being read) exits 130 too, no traceback."""
    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)  # reading it blocks until the signal arrives
    p = subprocess.Popen([sys.executable, "-m", "sut", "run", "--dataset", str(fifo),
                          "--output-dir", str(tmp_path / "o"),
                          "--model", str(REPO / "sut" / "models" / "tiny-llama3"), "--user-conf",
                          str(REPO / "loadgen_configs" / "cpu_tiny.user.conf"), "--load-format", "dummy"],
                         cwd=REPO, env=sut_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=_ignore_sigint)
    try:
        time.sleep(5)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out[-2000:]
    assert "interrupted (SIGINT, Ctrl-C)" in out and "Traceback" not in out


def _engine_start_fails():
    from sut.base import RunFailed

    raise RunFailed("engine 0 exited while starting")


def test_a_failure_while_stopping_exits_130_not_1(monkeypatch, caplog):
    """An engine start cut short by Ctrl-C raises RunFailed; the stop, not the failure, decides the exit code."""
    monkeypatch.setattr(exits, "_interrupted", type(exits._interrupted)())
    assert exits.run_main(_engine_start_fails) == 1  # no stop signal: a failure
    exits._interrupted.set()  # what the signal handler does
    assert exits.run_main(_engine_start_fails, messages={"stopped": "run stopped: {}"}) == 130
    assert "run stopped: engine 0 exited while starting" in caplog.text
