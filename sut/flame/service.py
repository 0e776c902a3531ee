"""The Flame service of the flame transport: vLLM behind Flame executors, several executors per engine.

Algorithm
---------
Flame 0.6 runs one task at a time per executor, and one service process per executor binding
(../shared/research/flame.md §1.2, §1.6). One executor with a task of 32 samples would leave an
engine nearly idle, so several executors share one engine:

* Every executor runs this same program (``python -m sut.flame.serve``). In ``on_session_enter`` it
  reads the session's common data (``sut.flame.service_config``: engine and sampling settings, and
  the session's engine **slot**: the transport opens one session per replica, replica r pinned to
  slot r of ``sut.engine.plan_engines`` on the executor's host, so the same GPU serves replica r on
  the local and the flame transport) and takes a *seat* of that slot only (``sut.flame.seats``).
* Seat 0 makes the process the slot's **engine host** (``sut.flame.engine_host``): it builds the
  engine once and serves a Unix socket ``<lock_dir>/<slot>.sock``; every batch, its own and its
  forwarders', goes to the engine at once.
* Any other seat makes the process a **forwarder**: it waits until the slot's host reports its engine
  ready (same session id and settings digest, ``sut.flame.hostlink``) and relays each task's payload
  to the host and the result back.
* ``on_task_invoke`` returns the encoded result (``sut.flame.payload``): one entry per sample in input
  order, per-sample errors inside; anything that breaks the batch raises (the task fails).
* After start-up the service process freezes its heap (``gc.freeze``, unless the session's
  ``gc_freeze`` is off) and times every GC pause; the engine worker does the same. Both unfreeze
  before the engine shuts down and log their largest pause; the values also travel in results.

The engine host dies with its executor (Flame ends the process group at unbind, at session close or
after ``delay_release`` without tasks); its forwarders then fail their tasks with a clear message,
and the transport treats that as a dead service. A service whose executor manager (its parent) dies stops
by itself within ``PARENT_POLL_S`` (engine included), or has been stopped (``SIGSTOP``, Ctrl-Z: a hung node) for
``PARENT_STOPPED_S``, and so does one whose session the session manager no longer
knows (restarted with ``storage: none``), within ``sut.flame.enter_watch.GONE_BOUND_S``: Flame v0.6.0 never ends
such orphans, and an orphaned engine host would hold its engine slot against every later run on the host.

Extension points (tests; never set by a benchmark): the session's ``engine_factory`` replaces the
engine, its ``service_hooks`` object is called at ``on_enter(service)`` and ``on_task(service,
batch_id)`` (fault injection). See ``sut.flame.options.FlameOptions``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from sut.engine import GcPauseMonitor, plan_engines
from sut.engine.handle import proc_state
from sut.errors import EngineError
from sut.flame import payload as pl
from sut.flame.engine_host import EngineHost
from sut.flame.enter_watch import SessionWatch
from sut.flame.hostlink import EngineClient, HostMismatch
from sut.flame.nodes import NODE_ENV
from sut.flame.seats import slot_keys, take_seat, try_flock
from sut.flame.service_config import ServiceConfig, load_callable

log = logging.getLogger("sut.flame.service")

#: How often (s) a service checks that its parent, the executor manager, still lives (``watch_parent``).
PARENT_POLL_S = 2.0
#: How long (s) the parent may stay stopped (state ``T``: ``SIGSTOP``, Ctrl-Z; not ``t``, a debugger's stop) before
#: the service stops: the transport has failed the run by then (a node that answers nothing is lost within 45 s,
#: docs/multinode.md), and the engine must not hold its GPU slot until the node resumes. ``PARENT_STOPPED_ENV``
#: sets another value (tests).
PARENT_STOPPED_S = 30.0
PARENT_STOPPED_ENV = "SUT_FLAME_PARENT_STOPPED_S"

DEFAULT_LOCK_DIR = "/tmp/sut-flame"
LOCK_DIR_ENV = "SUT_FLAME_LOCK_DIR"
#: Seconds between answering a ``leave`` ping and stopping the process (the answer goes out first).
LEAVE_DELAY_S = 0.5


def _base_service_class():
    import flamepy

    return flamepy.FlameService


class _BecomeHost(Exception):
    pass


class VllmBatchService(_base_service_class()):
    """FlameService: batches of samples in, generated ids out (see the module docstring).

    ``hooks``: a service-hooks object for in-process tests; otherwise the session's ``service_hooks``.
    """

    def __init__(self, hooks=None):
        self.hooks = hooks
        self.role: Optional[str] = None
        self.cfg: Optional[ServiceConfig] = None
        self.host: Optional[EngineHost] = None
        self.client: Optional[EngineClient] = None
        self.seat_fd: Optional[int] = None
        self.seat: Optional[int] = None
        self.session_id: Optional[str] = None
        self.gcmon = GcPauseMonitor("service").install()
        self._frozen = False
        self._enter_watch: Optional[SessionWatch] = None
        self.on_session_gone = None  # called with the reason once Flame no longer knows the session (``main``: stop)
        self.tasks_done = 0
        endpoint = os.environ.get("FLAME_INSTANCE_ENDPOINT", "")
        self.executor_id = Path(endpoint).name.removesuffix(".sock") if endpoint else f"pid{os.getpid()}"

    def ident(self) -> dict:
        return {"id": self.executor_id, "pid": os.getpid(), "node": socket.gethostname(), "role": self.role,
                "seat": self.seat, "gc_max_pause_ms": round(self.gcmon.max_s * 1e3, 3), "tasks": self.tasks_done}

    def _hook(self, name: str, *args) -> None:
        fn = getattr(self.hooks, name, None)
        if fn is not None:
            fn(self, *args)

    # -- Flame callbacks ---------------------------------------------------------------------
    def on_session_enter(self, context) -> bool:
        t0 = time.monotonic()
        if self.session_id is not None:
            raise RuntimeError(f"this service process already entered session {self.session_id}")
        self.cfg = cfg = ServiceConfig.from_bytes(context.common_data())
        self.session_id = context.session_id
        self._enter_watch = SessionWatch(self.session_id, self._end_entry, on_gone=self._session_gone).start()
        try:
            self._enter(cfg, t0)
        finally:
            self._enter_watch.entered()
        return True

    def _session_gone(self, why: str) -> None:
        """Flame no longer knows this service's session (``SessionWatch``): stop the process (``on_session_gone``)."""
        if self.on_session_gone is not None:
            self.on_session_gone(why)

    def _end_entry(self) -> None:
        """The session closed while this service entered it (``SessionWatch``): end an engine start now (a slot
        wait or a forwarder's wait sees ``closed`` itself)."""
        if self.host is not None:
            self.host.abort_start()

    def _closed_while(self, what: str) -> None:
        if self._enter_watch is not None and self._enter_watch.closed.is_set():
            raise RuntimeError(f"session {self.session_id} was closed while this service {what}")

    def _enter(self, cfg: ServiceConfig, t0: float) -> None:
        if self.hooks is None and cfg.service_hooks:
            self.hooks = load_callable(cfg.service_hooks)(**cfg.service_hooks_args)
        self._hook("on_enter")
        self._redirect_output(cfg)
        lock_dir = node_lock_dir(Path(cfg.lock_dir or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR))
        lock_dir.mkdir(parents=True, exist_ok=True)
        slot, key = self._pinned_slot(cfg, lock_dir)
        self._take_seat(slot, key, lock_dir, time.monotonic() + cfg.engine_start_timeout_s)
        if cfg.gc_freeze:
            self.gcmon.freeze()  # start-up is over: the long-lived heap stays out of later collections
            self._frozen = True
        log.info("session %s entered as %s of slot %s (replica %d) in %.1f s", self.session_id, self.role, key,
                 cfg.slot, time.monotonic() - t0)

    @staticmethod
    def _pinned_slot(cfg: ServiceConfig, lock_dir: Path):
        """The session's engine slot on this host and its key; ``ValueError`` if this host plans fewer slots."""
        slots = plan_engines(cfg.engine)
        keys = slot_keys(slots)
        if cfg.slot >= len(slots):
            raise ValueError(f"the session of replica {cfg.slot} needs engine slot {cfg.slot}, but this executor's "
                             f"host ({socket.gethostname()}) plans {len(slots)} slot(s) ({', '.join(keys)}): use at most "
                             "as many Flame engines as GPUs x engines_per_device (or CPU engines) on every executor host")
        longest = len(str(lock_dir / f"{keys[cfg.slot]}.sock").encode())
        if longest > 104:
            raise ValueError(f"lock_dir {lock_dir} is too long: the engine socket in it would have a {longest}-byte "
                             "path, over the Unix socket limit (108); set a shorter lock_dir / SUT_FLAME_LOCK_DIR")
        return slots[cfg.slot], keys[cfg.slot]

    def _take_seat(self, slot, key: str, lock_dir: Path, deadline: float) -> None:
        """Become the slot's engine host (seat 0) or one of its forwarders; blocks until the engine is ready.
        ``RuntimeError`` when the slot's engine host serves another session (another run on this host, perhaps
        through another Flame cluster) for longer than ``slot_wait_s``: the bind fails, and the client's
        warm-up with it, naming the slot and the holder."""
        sock_path = lock_dir / f"{key}.sock"
        held_since, warned = None, 0.0
        while True:
            _, seat, fd = take_seat(lock_dir, [key])
            self.seat, self.seat_fd = seat, fd
            if seat == 0:
                self.role = "host"
                log.info("executor %s (pid %d): engine host of slot %s (%s:%s)", self.executor_id, os.getpid(), key,
                         slot.kind, slot.device)
                self.host = EngineHost(self.cfg, slot, key, sock_path, self.session_id)
                self.host.start()
                return
            self.role = "forwarder"
            try:
                self.client = self._attach(sock_path, lock_dir, key, deadline)
            except _BecomeHost:
                os.close(fd)
                self.seat_fd = None
                continue
            except HostMismatch as e:
                os.close(fd)
                self.seat_fd = None
                self._closed_while(f"waited for engine slot {key}, held by another session's engine host")
                now = time.monotonic()
                held_since = held_since or now
                if now - held_since > self.cfg.slot_wait_s or now > deadline:
                    raise RuntimeError(_slot_held_message(key, lock_dir, e, now - held_since)) from None
                if now - warned >= 10.0:
                    warned = now
                    log.warning("slot %s is held by another session's engine host; waiting for it to go (at most "
                                "slot_wait_s, %.0f s)", key, self.cfg.slot_wait_s)
                time.sleep(1.0)
                continue
            log.info("executor %s (pid %d): forwarder seat %d of shard %s -> %s", self.executor_id, os.getpid(), seat,
                     key, self.client.shard.get("gpu_uuid") or self.client.shard.get("device"))
            return

    def _redirect_output(self, cfg: ServiceConfig) -> None:
        """Send this process's stdout/stderr (and so the engine worker's, started later) to
        ``<log_dir>/<executor id>.log`` when the client runs on this host; Flame's own ``.out``/``.err``
        files in the application's working directory keep what came before."""
        if not cfg.log_dir or cfg.client_host != socket.gethostname():
            return
        try:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            path = Path(cfg.log_dir) / f"{self.executor_id}.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            log.warning("cannot write the service log into %s (%s); it stays in the working directory", cfg.log_dir, e)
            return
        log.info("session %s: the output of this service process goes to %s from now on", self.session_id, path)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        log.info("executor %s (pid %d), session %s: output of this service process", self.executor_id, os.getpid(),
                 self.session_id)

    def _attach(self, sock_path: Path, lock_dir: Path, key: str, deadline: float) -> EngineClient:
        hello = {"session_id": self.session_id, "digest": self.cfg.digest, "pid": os.getpid(), "seat": self.seat}
        while True:
            try:
                return EngineClient(sock_path, hello, timeout=max(1.0, deadline - time.monotonic()))
            except (FileNotFoundError, ConnectionRefusedError, ConnectionError):
                pass  # no host listening (yet)
            except socket.timeout:
                raise EngineError(f"engine host of slot {key} not ready after {self.cfg.engine_start_timeout_s:.0f} s") from None
            # Is there a host at all? If seat 0 is free, its holder is gone: take over.
            fd0 = try_flock(lock_dir / f"{key}.seat0.lock")
            if fd0 is not None:
                os.close(fd0)
                raise _BecomeHost()
            if time.monotonic() > deadline:
                raise EngineError(f"engine host of slot {key} never opened {sock_path}")
            self._closed_while(f"waited for the engine host of slot {key}")
            time.sleep(0.2)

    def on_task_invoke(self, context) -> Optional[bytes]:
        t_recv = time.time()
        data = context.input
        kind, batch_id = pl.peek(data)  # a foreign payload fails the task here
        if kind == "ping" and pl.decode_task(data).meta.get(pl.LEAVE):
            return self._leave(batch_id, context.task_id)
        if self.role is None:
            raise RuntimeError("task before on_session_enter")
        if kind == "generate":
            self._hook("on_task", batch_id)
        ident = dict(self.ident(), t_recv=t_recv, task_id=context.task_id)
        if self.role == "host":
            out = self.host.call(self.host.handle_task(data, ident))
        else:
            out = self.client.run(data, ident)
        self.tasks_done += 1
        return out

    def _leave(self, batch_id: int, task_id) -> bytes:
        """A ping with ``leave`` (sent by a client whose session Flame can never close: its executors on a lost node
        hold Running tasks for good): answer it, then stop this process (engine included) ``LEAVE_DELAY_S`` later,
        once the answer is out. The result's meta: ``{"executor": ident, "leaving": True}``."""
        log.warning("session %s: task %s asks this service to end (the session cannot be closed: a node of it was "
                    "lost); stopping in %.1f s", self.session_id, task_id, LEAVE_DELAY_S)
        timer = threading.Timer(LEAVE_DELAY_S, self._session_gone, args=("asked to leave by the client",))
        timer.daemon = True
        timer.start()
        return pl.encode_result(batch_id, [], meta={"executor": self.ident(), "leaving": True}).data

    def on_session_leave(self) -> bool:
        # Never raise here (Flame 0.6 retries a failed leave in a tight loop); the process ends anyway.
        try:
            log.info("leaving session %s after %d task(s); largest GC pause of this service process %.1f ms",
                     self.session_id, self.tasks_done, self.gcmon.max_s * 1e3)
        except Exception:  # noqa: BLE001
            pass
        return True

    # -- process end -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._enter_watch is not None:
            self._enter_watch.stop()
        if self._frozen:
            self.gcmon.unfreeze()  # before the engine shuts down
            self._frozen = False
        st = self.gcmon.stats()
        log.info("service process %d (%s): largest GC pause %.1f ms (generation %s), %d collections", os.getpid(),
                 self.role, st["max_pause_ms"], st["max_pause_generation"], st["collections"])
        if self.client is not None:
            self.client.close()
        if self.host is not None:
            self.host.shutdown()
        if self.seat_fd is not None:  # the seat is free again (the process end would free it too)
            os.close(self.seat_fd)
            self.seat_fd = None


# ---------------------------------------------------------------------------------------------
# Process entry
# ---------------------------------------------------------------------------------------------


def node_lock_dir(lock_dir: Path) -> Path:
    """The engine-slot lock folder of this service's node: ``lock_dir``, or ``lock_dir/<node>`` on a node emulated
    on a shared host (``SUT_FLAME_NODE``, set by ``python -m sut.flame cluster --nodes N``: emulated nodes share one
    file system, and each has engine slots of its own)."""
    node = os.environ.get(NODE_ENV)
    return lock_dir / node if node else lock_dir


def _slot_held_message(key: str, lock_dir: Path, mismatch: HostMismatch, waited_s: float) -> str:
    """Why a service gave up waiting for engine slot ``key``: the holder's session (from the engine host's
    mismatch answer, JSON ``{"mismatch": true, "session_id": ...}``) and pid (``<key>.seat0.lock`` holds it)."""
    import json

    try:
        holder = json.loads(str(mismatch)).get("session_id") or "?"
    except (json.JSONDecodeError, AttributeError):
        holder = "?"
    try:
        pid = (lock_dir / f"{key}.seat0.lock").read_text().strip() or "?"
    except OSError:
        pid = "?"
    return (f"engine slot {key} on host {socket.gethostname()} is held by the engine host of another Flame session "
            f"({holder}, pid {pid}) and was not freed in {waited_s:.0f} s: another run on this host is using it "
            f"(perhaps through another Flame cluster: the slot locks in {lock_dir} are per host). Let that run end, "
            "or give the flame option slot_wait_s a longer wait")


def listen_unix(server, endpoint: str) -> None:
    """Bind ``server`` to the Unix socket ``endpoint`` so that the path appears only once it accepts
    connections: bind a temporary path next to it, then rename it into place.

    Flame v0.6.0's executor manager busy-polls for the socket file and connects the moment it exists;
    grpc creates the file at ``bind()``, before ``listen()``, and a connect in between fails the executor's
    bind ("shim creation failed: failed to connect to service ...: transport error"; seen on a loaded host).
    """
    tmp = f"{endpoint}.{os.getpid()}.tmp"
    if len(tmp.encode()) > 107:  # the Unix socket path limit: bind the endpoint directly
        server.add_insecure_port(f"unix://{endpoint}")
        return
    server.add_insecure_port(f"unix://{tmp}")
    os.rename(tmp, endpoint)


def parent_stopped_s(environ=os.environ) -> float:
    """``PARENT_STOPPED_ENV`` of ``environ`` as seconds (unset or empty: ``PARENT_STOPPED_S``; ``inf``: never).
    ``ValueError`` naming the variable and its value when it is not a number > 0: 0 or less would stop the service
    at the parent's first stopped moment and poll without a pause (``watch_parent`` polls every ``stopped_s / 4`` at
    most), NaN would stop it at once."""
    text = environ.get(PARENT_STOPPED_ENV, "").strip()
    if not text:
        return PARENT_STOPPED_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"{PARENT_STOPPED_ENV}={text!r}: expected seconds > 0 (how long the executor manager may stay "
                         f"stopped before the service stops; unset: {PARENT_STOPPED_S:g})")
    return value


def watch_parent(stop: threading.Event, poll_s: float = PARENT_POLL_S, parent: Optional[int] = None,
                 stopped_s: Optional[float] = None) -> threading.Thread:
    """Set ``stop`` when this process's parent (the executor manager that started it) has died, i.e. the process
    was re-parented: ``os.getppid()`` is no longer ``parent``, the pid read at the very start of the process, before
    its slow imports (``None``: the parent now); or when the parent has been stopped (``proc_state`` ``T``) at every
    check for ``stopped_s`` seconds (default ``PARENT_STOPPED_S``, or ``PARENT_STOPPED_ENV``). Checked at once in the
    calling thread (``stop`` is set on return when that parent is already gone, and the returned thread is then not
    started), then every ``poll_s`` seconds (at most ``stopped_s / 4``) on a daemon thread (returned, started).
    ``ValueError`` when ``poll_s`` or ``stopped_s`` is not > 0 (``parent_stopped_s``: a bad ``PARENT_STOPPED_ENV``)."""
    parent = os.getppid() if parent is None else parent
    stopped_s = parent_stopped_s() if stopped_s is None else stopped_s
    if not (poll_s > 0 and stopped_s > 0):
        raise ValueError(f"watch_parent: poll_s and stopped_s must be > 0, got {poll_s!r} and {stopped_s!r}")
    poll_s = min(poll_s, stopped_s / 4)
    since: list = [None]  # when the parent was first seen stopped (monotonic s), None while it runs

    def gone() -> bool:
        if os.getppid() == parent:
            return hung()
        log.warning("the executor manager (pid %d) that started this service is gone: stopping (the engine with it), "
                    "as Flame never ends such a service", parent)
        stop.set()
        return True

    def hung() -> bool:
        if proc_state(parent) != "T":
            since[0] = None
            return False
        now = time.monotonic()
        since[0] = now if since[0] is None else since[0]
        if now - since[0] < stopped_s:
            return False
        log.warning("the executor manager (pid %d) that started this service has been stopped for %.0f s (a hung "
                    "node): stopping (the engine with it), so that its GPU slot is free when the node resumes", parent,
                    now - since[0])
        stop.set()
        return True

    def loop() -> None:
        while not stop.wait(poll_s) and not gone():
            pass

    thread = threading.Thread(target=loop, name="parent-watch", daemon=True)
    if not gone():
        thread.start()
    return thread


def main(argv: Optional[list[str]] = None, parent: Optional[int] = None) -> int:
    """Serve the Flame instance socket named by ``FLAME_INSTANCE_ENDPOINT`` until SIGTERM / SIGINT, the death of
    the executor manager (``watch_parent``) or the loss of the session (``SessionWatch``), then shut down and end the
    process (``os._exit(0)``); 2 without it, or with a bad ``PARENT_STOPPED_ENV`` (logged, nothing served).
    ``parent``: the executor manager's pid as the entry point (``sut.flame.serve``) read it before the slow imports
    (``None``: the parent now); when that process is already gone, the socket is never published."""
    logging.basicConfig(level=os.environ.get("SUT_FLAME_LOG", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [flame-svc {os.getpid()}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    endpoint = os.environ.get("FLAME_INSTANCE_ENDPOINT")
    if not endpoint:
        log.error("FLAME_INSTANCE_ENDPOINT is not set: this program is started by Flame's executor manager")
        return 2
    try:
        stopped_s = parent_stopped_s()
    except ValueError as e:
        log.error("%s", e)
        return 2
    import grpc
    from flamepy.core.service import FlameInstanceServicer
    from flamepy.proto.shim_pb2_grpc import add_InstanceServicer_to_server

    service = VllmBatchService()
    stop = threading.Event()
    service.on_session_gone = lambda _why: stop.set()  # the watch logged why
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Our own server (not flamepy.run): the socket exists at once and the main thread stays free
    # to shut the engine down on SIGTERM.
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=4))
    add_InstanceServicer_to_server(FlameInstanceServicer(service), server)
    # before the socket: a service orphaned during its imports never serves
    watch_parent(stop, parent=parent, stopped_s=stopped_s)
    if not stop.is_set():
        listen_unix(server, endpoint)
        server.start()
        log.info("serving %s (executor %s)", endpoint, service.executor_id)
    stop.wait()  # no timeout: the signal handler or the parent watch sets the event
    log.info("stopping")
    try:
        service.shutdown()
    finally:
        server.stop(grace=1.0).wait(2.0)
    # A gRPC thread may still be inside on_session_enter (waiting for a slot, or for an engine that the shutdown
    # just ended): the interpreter's exit would join it (concurrent.futures' atexit hook) and keep a stopped
    # service alive for minutes. The process's work is done: flush and leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
