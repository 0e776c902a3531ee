"""A stand-in for ``sut.engine.worker.worker_main`` that behaves like a GPU worker at shutdown: it forks a
child the way vLLM forks its EngineCore (the child inherits the pipe and the process sentinel), answers
``Ready``, and on ``Stop`` exits at once, leaving that child running. Used by tests/test_engine_shutdown.py."""

from __future__ import annotations

import os
import time

from sut.engine.messages import Ready, Stop


def forking_worker(conn, settings, gen, slot, own_process_group, gc_freeze, detail, log_path, stream) -> None:
    if own_process_group:
        os.setpgrp()
    child = os.fork()
    if child == 0:  # the "EngineCore": holds every inherited fd until it is killed
        time.sleep(120)
        os._exit(0)
    conn.send(Ready({"child_pid": child}))
    while not isinstance(conn.recv(), Stop):
        pass
    os._exit(0)


def pin_then_mark(slot, marker: str) -> None:
    """The real worker's first step (``sut.engine.worker._pin``: own group, SIGINT ignored), then a marker file
    after a pause in which more SIGINTs may arrive."""
    from sut.engine.worker import _pin

    _pin(slot, True, None)
    time.sleep(0.5)
    with open(marker, "w") as f:
        f.write("ok")
