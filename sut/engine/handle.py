"""``EngineHandle``: the parent-side handle of one engine worker process (start, submit, watch, shut down).

Failure handling: a worker runs in its own process group (or, for the Flame service, in its
parent's). The watcher thread waits on the worker's pipe and its process sentinel together, so an
exited worker or an engine exception reaches ``on_fatal`` at once, with the last lines of the engine
log; it also polls ``waitpid`` every ``SENTINEL_POLL_S`` (a child the worker forked, vLLM's EngineCore
on a GPU, holds the pipe and the sentinel open after the worker died). ``shutdown`` ends the process
group (SIGTERM, then SIGKILL), so vLLM's own child processes never outlive the run. A worker that has
reported ``Ready`` first gets ``Stop`` and returns from its serve loop; one still starting (building
``vllm.LLM``: minutes on a GPU) reads no ``Stop`` and may not die from SIGTERM while in native code, so
it is ended at once: SIGTERM, then SIGKILL after ``STARTING_TERM_WAIT_S``, with a log line saying so
(signalled by pid while it has not yet made its own process group).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from sut.engine.devices import EngineSlot
from sut.engine.logs import start_log, with_log_tail
from sut.engine.messages import (
    Done,
    Failed,
    Firsts,
    Generate,
    RawDone,
    RawGenerate,
    Ready,
    ResetCache,
    Stats,
    StatsQuery,
    Stop,
)
from sut.engine.settings import EngineSettings, GenerationSettings
from sut.engine.worker import worker_main
from sut.errors import EngineError
from sut.messages import Completion, FirstToken

DoneCallback = Callable[[int, list[Completion]], None]  # (engine index, completions)
FirstCallback = Callable[[int, list[FirstToken]], None]  # (engine index, first tokens)
FatalCallback = Callable[[str], None]  # the message names the engine

log = logging.getLogger(__name__)

#: Seconds after SIGTERM before SIGKILL (``EngineHandle.shutdown``): a worker that reported ``Ready`` (then
#: mostly its children, vLLM's EngineCore) / one still starting, which reads no ``Stop`` and may outlive SIGTERM
#: while it builds ``vllm.LLM`` (seen 2026-12-01 with the tiny CPU engine: still alive 10 s after SIGTERM).
READY_TERM_WAIT_S = 10.0
STARTING_TERM_WAIT_S = 2.0
#: Seconds between ``waitpid`` polls while waiting on a worker's pipe and sentinel: the sentinel alone misses
#: a worker's exit while a child it forked (vLLM's EngineCore) still holds the sentinel pipe (``_exited_within``).
SENTINEL_POLL_S = 1.0


def start_with_sigint_blocked(proc) -> None:
    """Start ``proc`` (a ``multiprocessing`` spawn child) with SIGINT blocked from its first instruction.

    A spawned child shares the terminal's process group until its own code runs (``worker._pin``: own
    group, SIGINT ignored), and Python's start-up and imports take seconds: a Ctrl-C then printed a
    ``KeyboardInterrupt`` traceback from the child (``init_import_site``) over the parent's orderly stop.
    The signal mask survives fork and exec, so the child starts with SIGINT blocked and ``_pin`` unblocks it
    after ignoring it (a Ctrl-C pending by then is discarded). The parent's mask is restored at once; a
    Ctrl-C that reached this thread meanwhile is delivered then. (CPython protects its resource tracker the
    same way, bpo-33613, and unblocks SIGINT after starting it: it is started first, else this child would
    inherit the tracker's unblocked mask.)
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: The likely sender of a SIGKILL that the harness did not send, and what to change: the second line of the message.
OOM_HINT = ("\nSIGKILL: unless someone stopped it on purpose, most often the kernel's out-of-memory killer "
            "(`dmesg` names it); give the engines less memory (--cpu-kvcache-gib on a CPU, --gpu-memory-utilization "
            "on a GPU) or free some on the host")


def exit_how(code: Optional[int]) -> tuple[str, str]:
    """``(how, hint)`` for a worker that ended with ``code`` (``Process.exitcode``): ``"code 1"``, ``"code -11
    (SIGSEGV)"`` for a signal; ``hint`` is ``OOM_HINT`` for a SIGKILL (on Linux most often the out-of-memory
    killer, which says nothing to the process), else ''. The hint starts a new line, which ``with_log_tail`` puts
    after the log's tail and a one-line summary (``partition("\\n")[0]``) leaves out."""
    if code is None or code >= 0:
        return f"code {code}", ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"code {code} ({name})", OOM_HINT if -code == signal.SIGKILL else ""


class EngineHandle:
    """Parent-side handle of one engine worker.

    Args:
        slot: where the engine runs (``sut.engine.devices``).
        own_process_group: the worker starts its own process group (``shutdown`` ends it with one
            killpg); False keeps it in this process's group (the Flame service).
        gc_freeze: freeze the worker's heap after start-up and time its GC pauses.
        detail / stream: delta outputs with first-token times; ``stream`` also reports first tokens
            (``watch(on_first=...)``; ``sut.engine.worker``).
    """

    def __init__(self, slot: EngineSlot, settings: EngineSettings, gen: GenerationSettings,
                 own_process_group: bool = True, gc_freeze: bool = False, detail: bool = False, stream: bool = False):
        self.slot, self.settings, self.gen = slot, settings, gen
        self.own_process_group, self.gc_freeze, self.detail, self.stream = own_process_group, gc_freeze, detail, stream
        self.info: dict = {}
        self.log_path: Optional[Path] = None
        self._conn: Optional[mpc.Connection] = None
        self._proc: Optional[mp.Process] = None
        self._send_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._stopping = False
        self._ready = False  # the worker has reported Ready (it serves the pipe and reads Stop)
        self._on_done: Optional[DoneCallback] = None
        self._on_fatal: Optional[FatalCallback] = None
        self._on_stats: Optional[Callable[[dict], None]] = None
        self._on_first: Optional[FirstCallback] = None
        self._raw: "queue.Queue" = queue.Queue()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def start(self, log_path: Optional[Path] = None) -> None:
        """Spawn the worker. ``log_path``: its stdout/stderr (vLLM's output) go to this file, which
        gets a header line first; None = the parent's stdout/stderr. Raises ``EngineError`` if the
        file cannot be written."""
        if log_path is not None:
            log_path = start_log(log_path, f"engine {self.slot.index}", f"({self.slot.kind}:{self.slot.device}): "
                                 "vLLM's own output (worker and its child processes)")
        self.log_path = log_path
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._conn = parent
        self._proc = ctx.Process(target=worker_main, args=(child, self.settings, self.gen, self.slot,
                                                           self.own_process_group, self.gc_freeze, self.detail,
                                                           log_path, self.stream),
                                 name=f"vllm-engine-{self.slot.index}", daemon=False)
        start_with_sigint_blocked(self._proc)
        child.close()

    def failure(self, msg: str) -> str:
        """``msg`` with the engine log's last lines (``sut.engine.logs.with_log_tail``)."""
        return with_log_tail(msg, self.log_path)

    def _exited(self, during: str) -> EngineError:
        self._exited_within(1)
        how, hint = exit_how(self._proc.exitcode)
        return EngineError(self.failure(f"engine {self.slot.index} exited {during} ({how})" + hint))

    def wait_ready(self, timeout: float) -> dict:
        """Block until the worker reports ready; return its read-back record. Raises ``EngineError``
        on failure or timeout (the message ends with the engine log's last lines)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(self.failure(f"engine {self.slot.index} not ready after {timeout:.0f} s"))
            ready = mpc.wait([self._conn, self._proc.sentinel], timeout=min(left, SENTINEL_POLL_S))
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except EOFError:
                    raise self._exited("during start-up") from None
                if type(msg) is Ready:
                    self.info, self._ready = msg.info, True
                    return msg.info
                raise EngineError(self.failure(msg.message if type(msg) is Failed else
                                               f"engine {self.slot.index}: unexpected start-up message {msg!r}"))
            if self._proc.sentinel in ready or self._proc.exitcode is not None:
                raise self._exited("during start-up")

    def watch(self, on_done: DoneCallback, on_fatal: FatalCallback, on_stats: Optional[Callable[[dict], None]] = None,
              on_first: Optional[FirstCallback] = None) -> None:
        """Route results to ``on_done(engine index, [Completion])`` and death/errors to ``on_fatal(message)``
        (reported within milliseconds).

        ``on_stats`` receives the worker's answer to :meth:`request_stats` / :meth:`reset_prefix_cache`;
        ``on_first`` a streaming worker's ``(engine index, [FirstToken])``, always before the ``on_done``
        call of the same requests (one thread, in the worker's order). The watcher thread starts on the
        first call; later calls only swap the callbacks (a benchmark runs several SUTs over one engine).
        """
        self._on_done, self._on_fatal, self._on_stats, self._on_first = on_done, on_fatal, on_stats, on_first
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name=f"engine-{self.slot.index}-watch",
                                             daemon=True)
            self._watcher.start()

    def _fatal(self, msg: str) -> None:
        msg = self.failure(msg)
        self._raw.put(EngineError(msg))
        if self._on_fatal is not None:
            self._on_fatal(msg)

    def _deliver(self, msg) -> bool:
        """Hand one result message to its callback; False if ``msg`` is not a result."""
        kind = type(msg)
        if kind is Done:
            self._on_done(self.slot.index, msg.completions)
        elif kind is Firsts:
            if self._on_first is not None:
                self._on_first(self.slot.index, msg.firsts)
        elif kind is Stats:
            if self._on_stats is not None:
                self._on_stats(msg.stats)
        elif kind is RawDone:
            self._raw.put((msg.seconds, msg.results))
        else:
            return False
        return True

    def _watch_loop(self) -> None:
        conn, sentinel = self._conn, self._proc.sentinel
        while True:
            ready = mpc.wait([conn, sentinel], timeout=SENTINEL_POLL_S)
            if not ready and self._proc.exitcode is None:
                continue
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                try:
                    delivered = self._deliver(msg)
                except Exception as e:  # noqa: BLE001 - a broken callback must fail the run, not the watcher
                    self._fatal(f"engine {self.slot.index}: handling its results failed: {e!r}")
                    return
                if delivered:
                    continue
                if self._stopping:
                    return
                if type(msg) is Failed:
                    self._fatal(msg.message)
                    return
            if self._stopping:
                return
            self._exited_within(2)
            how, hint = exit_how(self._proc.exitcode)
            self._fatal(f"engine {self.slot.index} (pid {self._proc.pid}) exited unexpectedly with {how}" + hint)
            return

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, BrokenPipeError) as e:
            raise EngineError(f"engine {self.slot.index} is gone: {e}") from None

    def submit(self, batch: Sequence) -> None:
        """Send ``Request``s (or ``(request id, int32 prompt)`` pairs) to the worker. Raises ``EngineError``
        if it is gone."""
        self._send(Generate(list(batch)))

    def raw_generate_start(self, batch: Sequence) -> None:
        """Ask the idle worker for one plain ``LLM.generate`` over ``batch`` (see ``raw_generate_result``)."""
        self._send(RawGenerate(list(batch)))

    def raw_generate_result(self, timeout: float = 3600.0) -> tuple[float, list[Completion]]:
        """``(generate seconds, [Completion])`` of the raw batch; needs ``watch`` running."""
        res = self._raw.get(timeout=timeout)
        if isinstance(res, Exception):
            raise res
        return res

    def reset_prefix_cache(self) -> None:
        """Ask the idle worker to empty vLLM's prefix cache; the answer (``{"reset_prefix_cache": ok}``)
        goes to ``watch``'s ``on_stats``."""
        self._send(ResetCache())

    def request_stats(self) -> None:
        """Ask the worker for its GC statistics; the answer goes to ``watch``'s ``on_stats``."""
        self._send(StatsQuery())

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the worker and end its process group, or only the worker when it shares its
        parent's group (SIGTERM, then SIGKILL). A ``Ready`` worker first gets ``Stop`` and up to
        ``timeout`` seconds to return; one that has not reported ``Ready`` is ended at once (SIGKILL
        ``STARTING_TERM_WAIT_S`` after SIGTERM). Safe to call twice and before ``start``."""
        self._stopping = True
        if self._proc is None or self._proc.pid is None:  # never started (or its start raised)
            return
        term_wait = READY_TERM_WAIT_S if self._ready else STARTING_TERM_WAIT_S
        if self._proc.is_alive() and proc_state(self._proc.pid) in ("T", "t"):  # reads neither Stop nor SIGTERM
            log.warning("engine %d (pid %d) is stopped (SIGSTOP or a debugger): ending its process group at once",
                        self.slot.index, self._proc.pid)
            term_wait = 0.0
        elif self._proc.is_alive() and self._ready:
            try:
                with self._send_lock:
                    self._conn.send(Stop())
            except (OSError, BrokenPipeError):
                pass
            if not self._exited_within(timeout):
                log.warning("engine %d (pid %d) still running %.0f s after Stop: ending its process group",
                            self.slot.index, self._proc.pid, timeout)
        elif self._proc.is_alive():
            log.warning("engine %d (pid %d) is still starting: ending it now (SIGTERM, SIGKILL after %.0f s)",
                        self.slot.index, self._proc.pid, term_wait)
        if self.own_process_group:
            _end_group(self._proc.pid, term_wait, leader_exit=lambda: self._proc.exitcode)
        else:
            for end, wait in ((self._proc.terminate, term_wait), (self._proc.kill, 5)):
                if self._proc.is_alive():
                    end()
                    self._exited_within(wait)
        self._exited_within(5)
        if self._conn is not None:
            self._conn.close()

    def _exited_within(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the worker to exit, reaping it; True once it has. Polls ``waitpid``
        (``exitcode``) instead of joining on the process sentinel: vLLM forks its EngineCore from the worker,
        the fork inherits the sentinel pipe's write end, and the sentinel then stays silent until the
        EngineCore is gone too (on the H200, 2026-12-01: every stop took the whole 30 s join, then 10 + 5 s
        more)."""
        deadline = time.monotonic() + timeout
        while self._proc.exitcode is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


def proc_state(pid: int) -> Optional[str]:
    """The one-letter state of process ``pid`` (``/proc/PID/stat``: ``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``
    ...); None when it cannot be read (no such process, no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    tail = stat[stat.rfind(")") + 1:].split()  # the name, in parentheses, may hold spaces and ')'
    return tail[0] if tail else None


def _end_group(pgid: int, term_wait: float, leader_exit: Callable[[], Optional[int]]) -> None:
    """SIGTERM the process group ``pgid``, wait up to ``term_wait`` s, then SIGKILL it and wait up to 5 s.
    ``leader_exit``: the group leader's (the worker's, our child's) exit code once it has exited, reaping it,
    else None. A leader still starting may not have made its group yet (``os.setpgrp`` comes after the spawned
    interpreter's imports): then it is signalled by pid. The group counts as ended when the leader has exited
    and no member is left but zombies (``live_group_members``): an orphaned member that exited is reaped by
    PID 1, which in a container may never do it."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 5.0)):
        _signal_group(pgid, sig, leader_exit)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if leader_exit() is not None and not live_group_members(pgid):
                return
            time.sleep(0.1)
    left = live_group_members(pgid)
    if left or leader_exit() is None:
        log.error("process group %d still has live member(s) %s after SIGKILL", pgid, left or [pgid])


def _signal_group(pgid: int, sig: int, leader_exit: Callable[[], Optional[int]]) -> None:
    """``killpg(pgid, sig)``; when there is no such group yet and the leader has not exited, ``kill(pgid, sig)``."""
    try:
        os.killpg(pgid, sig)
        return
    except PermissionError:
        return
    except ProcessLookupError:
        pass
    if leader_exit() is None:
        try:
            os.kill(pgid, sig)
        except ProcessLookupError:
            pass


def live_group_members(pgid: int) -> list[int]:
    """Pids of process group ``pgid`` that are not zombies, read from ``/proc/<pid>/stat``; where ``/proc``
    is missing: ``[pgid]`` while ``killpg(pgid, 0)`` succeeds, else ``[]``."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(name))
    return out
