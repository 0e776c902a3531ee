"""Stop signals of ``python -m sut run`` without engines: SIGINT works even when inherited as ignored,
a second signal does not cut the shutdown short, and the run record names the signal."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, sut_env

from sut import exits
from sut.run.loadgen_watch import interrupt_reason

#: Starts ``argv[1:]`` with SIGINT ignored, as a non-interactive shell does for ``cmd &`` (SIG_IGN survives exec;
#: SIGINT unblocked, whatever mask this process has), in the same process. No ``preexec_fn``: forking a process that
#: has threads (gRPC's, pytest's) and running Python before exec can hang the child.
_SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execv(sys.argv[1], sys.argv[1:])")


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
    p = subprocess.Popen([sys.executable, "-c", _SIGINT_IGNORED, sys.executable, "-c", _CHILD], cwd=REPO,
                         env=sut_env(), stdout=subprocess.PIPE, text=True)
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


def _open_once_read(fifo, p, log, timeout_s=120.0) -> int:
    """The write end of ``fifo``, opened once process ``p`` has opened the FIFO for reading (until then a
    non-blocking open for writing fails with ENXIO); AssertionError (with ``log``) when ``p`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        assert p.poll() is None, f"exit {p.returncode} before it opened the dataset: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the dataset not opened in {timeout_s:.0f} s: {log.read_text()[-2000:]}"
        time.sleep(0.05)


#: ``python -m sut run`` whose dataset parse first reads the FIFO ``argv[1]`` (blocking while the test holds its write
#: end): a run stopped while it checks the dataset (a dataset file is read only if regular, so the FIFO is not it).
_SLOW_DATASET = """
import sys
from pathlib import Path
from types import SimpleNamespace
import accuracy.dataset as d
fifo, parse = sys.argv.pop(1), d.parse_json
def slow_parse(text):
    with open(fifo) as f:
        f.read()
    return parse(text)
d.parse_json = slow_parse
from sut.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sut_run_stopped_while_checking_the_dataset_exits_130(tmp_path):
    """A stop before LoadGen (here: while the dataset file is being parsed) exits 130 too, no traceback. The parse
    first reads a FIFO whose write end the test holds, so it blocks; SIGINT is sent once the run has opened it (its
    handlers are installed by then), and the write end is closed if the run is still there 5 s later (the read
    then ends, should the signal have gone to another thread than the blocked one)."""
    import json

    fifo, log, data = tmp_path / "slow", tmp_path / "out.log", tmp_path / "data.json"
    os.mkfifo(fifo)
    data.write_text(json.dumps([{"instruction": "x", "input": "y", "tok_input": [1, 2, 3], "output": "z"}]))
    argv = [sys.executable, "-c", _SLOW_DATASET, str(fifo), "run", "--dataset", str(data), "--output-dir",
            str(tmp_path / "o"), "--model", str(REPO / "sut" / "models" / "tiny-llama3"), "--user-conf",
            str(REPO / "loadgen_configs" / "cpu_tiny.user.conf"), "--load-format", "dummy"]
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", _SIGINT_IGNORED, *argv], cwd=REPO, env=sut_env(), stdout=out,
                             stderr=subprocess.STDOUT)
    write_end = None
    try:
        write_end = _open_once_read(fifo, p, log)
        p.send_signal(signal.SIGINT)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.close(write_end)
            write_end = None
            p.wait(60)
    finally:
        if write_end is not None:
            os.close(write_end)
        if p.poll() is None:
            p.kill()
            p.wait()
    out = log.read_text()
    assert p.returncode == 130, out[-2000:]
    assert "interrupted (SIGINT, Ctrl-C)" in out and "Traceback" not in out


def _engine_start_fails():
    from sut.errors import RunFailed

    raise RunFailed("engine 0 exited while starting")


def test_a_failure_while_stopping_exits_130_not_1(monkeypatch, caplog):
    """An engine start cut short by Ctrl-C raises RunFailed; the stop, not the failure, decides the exit code."""
    monkeypatch.setattr(exits, "_interrupted", type(exits._interrupted)())
    assert exits.run_main(_engine_start_fails) == 1  # no stop signal: a failure
    exits._interrupted.set()  # what the signal handler does
    assert exits.run_main(_engine_start_fails, messages={"stopped": "run stopped: {}"}) == 130
    assert "run stopped: engine 0 exited while starting" in caplog.text


def test_a_ctrl_c_before_loadgens_thread_starts_leaves_no_thread_behind(monkeypatch):
    """A stop signal that lands before StartTest's thread exists (e.g. during the collection just before it) must
    not mark LoadGen as still running: that makes ``run_main`` end the process with ``os._exit`` (a test session
    with it), for a thread that never started."""
    import types

    from sut.run import loadgen_watch as lw

    def interrupted():
        raise KeyboardInterrupt("SIGINT, Ctrl-C")

    monkeypatch.setattr(lw.gc, "collect", interrupted)
    started = []
    with pytest.raises(KeyboardInterrupt):
        lw.start_test_interruptible(types.SimpleNamespace(), None, None, None, None, "", None, 60, 1,
                                    on_start=lambda: started.append(1))
    assert started == []
    # run_loadgen itself: LoadGen's objects are built, the signal lands before its thread: nothing is left running
    import mlperf_loadgen as lg
    import numpy as np

    from sut.data.dataset import Dataset
    from sut.settings.run import RunSettings

    ds = Dataset("d.json", "0" * 64, [np.arange(1, 5, dtype=np.int32)] * 2, ["", ""], 2)
    sut = types.SimpleNamespace(issue_queries=lambda qs: None, flush_queries=lambda: None)
    ts = lg.TestSettings()
    objs = lw.LoadGenObjects()
    with pytest.raises(KeyboardInterrupt):
        lw.run_loadgen(lg, sut, RunSettings(sut="vllm", dataset="d.json"), ds, ts, None, Path("/nonexistent"), objs)
    assert objs.returned is True and objs.qsl is not None
    objs.destroy(lg)


def test_a_stop_signal_inside_stops_held_is_raised_when_the_block_ends():
    """Inside the block the handler only records the signal (a gRPC call may be waiting); the block's end raises it,
    once, after what ran inside finished; nested blocks raise at the outermost end."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    exits.stop_on_sigterm_like_ctrl_c()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with exits.stops_held():
                with exits.stops_held():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)  # the handler runs here, and must not raise
                    done.append("inner")
                done.append("outer")
        assert done == ["inner", "outer"] and exits.interrupted()
        with exits.stops_held():  # no signal: nothing raised
            pass
    finally:
        exits._interrupted.clear()
        for s, h in before.items():
            signal.signal(s, h)


def test_the_cluster_start_poll_takes_a_stop_signal_after_its_grpc_call_not_inside_it(monkeypatch, tmp_path):
    """python -m sut.flame cluster: a Ctrl-C inside the node listing of the start-up poll was raised inside gRPC's
    wait and its channel's clean-up then hung for ever; the listing now finishes, the connection is closed, and the
    stop comes after."""
    import flamepy

    from sut.flame import cluster

    events = []

    class Conn:
        _frontend = object()

        def list_nodes(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # a raising handler would interrupt this call
            events.append("listed")
            return []

        def close(self):
            events.append("closed")

    monkeypatch.setattr(flamepy, "connect", lambda endpoint: Conn())
    proc = type("P", (), {"poll": lambda self: None})()
    c = object.__new__(cluster.RealCluster)
    c.s, c.endpoint = SimpleNamespace(start_timeout_s=30), "http://127.0.0.1:1"
    c.nodes, c.fems, c.fsm = [SimpleNamespace(name="n", emulated=False)], {"n": proc}, proc
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: exits.interrupt_unless_held("stop signal while the cluster started"))
    try:
        with pytest.raises(KeyboardInterrupt, match="stop signal while the cluster started"):
            c._wait_node_ready()
    finally:
        signal.signal(signal.SIGINT, before)
    assert events == ["listed", "closed"], events
