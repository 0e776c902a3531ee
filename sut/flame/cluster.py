"""A one-host real Flame v0.6.0 cluster (session manager + one executor manager per node) for tests and benchmarks.

``RealCluster`` starts Flame's own binaries (``flame-session-manager``, ``flame-executor-manager``,
built at tag v0.6.0; see ../shared/flame/README.md) on free loopback ports with their own
``FLAME_HOME``, socket folder and log folder, both in one new process group, and stops them and
everything they started (service processes, engine workers) on ``stop``::

    with RealCluster(ClusterSettings(bin_dir=find_bin_dir(), workdir=tmp)) as cluster:
        conn = flamepy.connect(cluster.endpoint)        # "http://127.0.0.1:<port>"

What the cluster needs before it starts (``ClusterSettings``, ``ClusterError``, the binaries' folder
``find_bin_dir``, the ports ``pick_ports``, ``cluster.yaml``) is in ``sut.flame.cluster_config``; this module
imports those names, so they may be imported from here too.

CLI: ``python -m sut.flame cluster --workdir DIR [--flame-bin DIR] [--port N] [--policies P,...] [--nodes N
[--node-prefix P] [--node-gpus G:G...]]`` prints ``FLAME_ENDPOINT=...``, ``FLAME_NODES=...`` and
``FLAME_NODES_FILE=...`` and serves until Ctrl-C / SIGTERM.

Nodes (``ClusterSettings.nodes``): one executor manager, named by this host, by default; with N > 1, N executor
managers, each a node of its own (``sut.flame.nodes``: UTS namespace and host name ``<prefix>-<i>``, its own
``FLAME_HOME``, working and socket folders, logs in ``nodes/<name>/home/logs``), all in the cluster's network
namespace and the session manager's process group. ``<workdir>/nodes.json`` lists each node's name, executor
manager pid, home, logs, GPUs and UTS namespace (``kill_executor_manager(node=...)`` / ``kill -9 PID``: a lost node;
``node_processes(node)``: what runs on it).

Facts of v0.6.0 this module designs for: the frontend listens on the endpoint's port and the
executor-manager backend on port + 1, both on **0.0.0.0** whatever host the endpoint names, and nothing in
its configuration changes that or authenticates a client (``sut.flame.netns``). So the cluster runs in a
network namespace of its own (``sut.flame.netns.NetFence``: loopback only; every manager, service and engine
inside), and a forwarder makes the frontend reachable on this host's 127.0.0.1:port only: the endpoint is
the same URL inside and outside. Where the namespace cannot be made (not root, no ``CAP_SYS_ADMIN``), the
cluster runs without it, exposed, with a warning saying so (``isolation`` records which). Ports are checked
free on every address, and the listening sockets are checked to belong to the session manager this module
started; executors' Unix sockets go to ``$FLAME_SOCKET_DIR``
(default /var/flame/executors, shared by every cluster of a host: each cluster here gets its own);
the host shim starts every service in its own process group, so ``stop`` finds them by a marker in
their environment (``SUT_FLAME_CLUSTER``, inherited from the executor manager) and ends their
groups too. ``storage: none`` keeps all state in memory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from sut.exits import interrupt_unless_held, stops_held
from sut.flame.cluster_config import (
    BIN_ENV,
    FEM,
    FSM,
    ClusterError,
    ClusterSettings,
    NodesUnavailable,
    cluster_yaml,
    default_bin_dir,
    find_bin_dir,
    pick_ports,
    taken_ports_message,
)
from sut.flame.endpoint import DeadlineStub
from sut.flame.netns import FenceUnavailable, NetFence, listeners, loopback_listener
from sut.flame.nodes import (
    MAX_NODES,
    NodePlan,
    check_node_gpus,
    host_gpus,
    parse_node_gpus,
    plan_nodes,
    uts_unavailable,
)

log = logging.getLogger("sut.flame.cluster")
MARK_ENV = "SUT_FLAME_CLUSTER"
#: Seconds one node listing of the start-up poll may take (a stop signal waits for it: ``stops_held``).
READY_POLL_TIMEOUT_S = 2.0
EXPOSED_WARNING = ("the Flame cluster runs WITHOUT a network namespace of its own (%s): Flame v0.6.0's session "
                   "manager listens on every interface on ports %d and %d, with no authentication, and anyone who "
                   "reaches them can run commands on this host; firewall them, or run as root (docs/flame.md, "
                   "Security)")


def marked_processes(mark: str) -> list:
    """psutil Processes whose environment carries ``SUT_FLAME_CLUSTER=<mark>`` (ours only)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(MARK_ENV) == mark:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


class RealCluster:
    """A running one-host Flame cluster; see the module docstring. Not thread-safe."""

    def __init__(self, settings: ClusterSettings):
        self.s = settings
        self.workdir = Path(settings.workdir).resolve()
        self.mark = uuid.uuid4().hex[:12]
        self.port: Optional[int] = None
        self.endpoint: Optional[str] = None
        self.fsm: Optional[subprocess.Popen] = None
        self.fem: Optional[subprocess.Popen] = None  # the first node's executor manager
        self.nodes: list[NodePlan] = []
        self.fems: dict[str, subprocess.Popen] = {}  # node name -> its executor manager
        self.node_uts: dict[str, Optional[str]] = {}  # node name -> "uts:[inode]" of its executor manager
        self.forwarder: Optional[subprocess.Popen] = None  # 127.0.0.1:port here -> the namespace's session manager
        self.fence: Optional[NetFence] = None
        # {"isolated": True, "netns": "net:[inode]", "how": ...} or {"isolated": False, "reason": ...}
        self.isolation: dict = {}
        self.sock_dir: Optional[Path] = None
        self.home = self.workdir / "home"
        # The managers write their logs there themselves ($FLAME_HOME/logs/{fsm,fem}-<host>.<date>), and
        # the same lines to stdout, which goes nowhere: one copy on disk. stderr (panics): <name>.stderr.
        self.log_dir = self.home / "logs"
        self._stopped = False

    # ------------------------------------------------------------------ start
    def start(self) -> "RealCluster":
        """Start the session manager and one executor manager per node; returns once every node is Ready.
        ``ClusterError`` (``NodesUnavailable``: several nodes asked for where UTS namespaces cannot be made)."""
        for b in (FSM, FEM):
            if not os.access(Path(self.s.bin_dir) / b, os.X_OK):
                raise ClusterError(f"{Path(self.s.bin_dir) / b} is missing or not executable")
        if self.s.nodes > 1:
            why = uts_unavailable()
            if why:
                raise NodesUnavailable(f"{self.s.nodes} nodes need a UTS namespace (host name) each: {why}")
        # Executor sockets: <dir>/<36-char executor id>.sock must stay under the 108-byte limit.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="flsk-", dir="/tmp"))
        self.nodes = self._plan_nodes()
        for d in [self.log_dir, self.home] + [d for n in self.nodes for d in (n.log_dir, n.cwd, n.sock_dir)]:
            d.mkdir(parents=True, exist_ok=True)
        try:
            self._make_fence()
            self._start_managers()
            self._wait_node_ready()
            self._write_nodes_file()
        except BaseException:
            self.stop()
            raise
        log.info("flame cluster %s up at %s (workdir %s; %s)", self.mark, self.endpoint, self.workdir,
                 f"in {self.isolation['netns']}, loopback only" if self.fence else "NOT isolated")
        return self

    def _plan_nodes(self) -> list[NodePlan]:
        """One node named by this host (``nodes`` 1: FLAME_HOME ``home``, working folder ``fem``), else
        ``sut.flame.nodes.plan_nodes``; ``ClusterError`` for a GPU list that does not fit."""
        gpus = tuple(self.s.node_gpus)
        if self.s.nodes == 1:
            if len(gpus) > 1:
                raise ClusterError(f"{len(gpus)} GPU lists for 1 node")
            return [NodePlan(socket.gethostname(), self.home, self.workdir / "fem", self.sock_dir,
                             gpus[0] if gpus else None, emulated=False)]
        try:
            return plan_nodes(self.workdir, self.sock_dir, self.s.node_prefix, gpus, self.s.nodes)
        except ValueError as e:
            raise ClusterError(str(e)) from None

    def _write_nodes_file(self) -> None:
        """``<workdir>/nodes.json``: the endpoint, the session manager's pid and each node's record
        (``NodePlan.record``: name, executor manager pid, FLAME_HOME, logs, GPUs)."""
        import json

        self.node_uts = {n.name: _uts_of(self.fems[n.name].pid) for n in self.nodes}
        rec = {"endpoint": self.endpoint, "session_manager_pid": self.fsm.pid,
               "nodes": [dict(n.record(self.fems[n.name].pid), uts=self.node_uts[n.name]) for n in self.nodes]}
        (self.workdir / "nodes.json").write_text(json.dumps(rec, indent=1) + "\n")

    def _make_fence(self) -> None:
        """The cluster's network namespace (``self.fence``), or, where none can be made or ``isolate`` is off, a
        warning: ``self.isolation`` says which."""
        if not self.s.isolate:
            self.isolation = {"isolated": False, "reason": "isolate=False"}
            return
        try:
            self.fence = NetFence.create()
        except FenceUnavailable as e:
            self.isolation = {"isolated": False, "reason": str(e)}
            return
        self.isolation = {"isolated": True, "netns": self.fence.id,
                          "how": "network namespace of its own (loopback only); the frontend port forwarded from "
                                 "this host's 127.0.0.1"}

    def _env(self, node: Optional[NodePlan] = None) -> dict:
        """The managers' environment (``node``: that node's executor manager's)."""
        env = dict(os.environ)
        env.update(FLAME_HOME=str(self.home), FLAME_SOCKET_DIR=str(self.sock_dir), RUST_LOG=self.s.rust_log)
        if node is not None:
            env.update(node.env())
        env[MARK_ENV] = self.mark
        env.pop("FLAME_ENDPOINT", None)
        if self.fence is not None:  # nothing to download from in there: fail at once, from the cache only
            env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(dict(self.s.env))
        return env

    def _popen(self, argv: list[str], log_name: str, cwd: Path, pass_fds: tuple = (), inside: bool = True,
               node: Optional[NodePlan] = None, **kw) -> subprocess.Popen:
        """``argv`` started (``inside``: in the cluster's namespace, when there is one; ``node``: as that node, its
        stderr in the node's log folder), stderr to ``<log_dir>/<log_name>.stderr``; ``kw`` go to ``Popen``."""
        log_dir = self.log_dir
        if node is not None:
            argv, log_dir = node.command(argv), node.log_dir
        if inside and self.fence is not None:
            argv, pass_fds = self.fence.command(argv), pass_fds + self.fence.pass_fds
        with open(log_dir / f"{log_name}.stderr", "ab") as err:
            return subprocess.Popen(argv, cwd=cwd, env=self._env(node), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, pass_fds=pass_fds,
                                    preexec_fn=self._preexec(), **kw)

    def _start_managers(self) -> None:
        attempts = 1 if self.s.port else 5
        taken = taken_ports_message(self.s.port) if self.s.port else None
        if taken:
            raise ClusterError(taken)
        for attempt in range(attempts):
            port = self.s.port or pick_ports()
            cfg = self.workdir / "cluster.yaml"
            cfg.write_text(cluster_yaml(self.s, port))
            why = self._start_session_manager(port, cfg)
            if why is None:
                break
            if attempt + 1 == attempts:
                raise ClusterError(f"the session manager did not start on port {port}: {why}; "
                                   f"logs in {self.log_dir}:\n{self.log_tail('fsm')}")
            log.warning("session manager on port %d: %s; trying other ports", port, why)
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        if self.fence is None:
            log.warning(EXPOSED_WARNING, self.isolation["reason"], port, port + 1)
        for node in self.nodes:  # all in the session manager's process group
            self.fems[node.name] = self._popen([str(Path(self.s.bin_dir) / FEM), "--config", str(cfg)], "fem", node.cwd,
                                               node=node, process_group=self.fsm.pid)
        self.fem = self.fems[self.nodes[0].name]

    def _start_session_manager(self, port: int, cfg: Path) -> Optional[str]:
        """Start the session manager on ``port`` (and, in a namespace, the forwarder from this host's
        127.0.0.1:port); None once it listens, else why not (then nothing of this attempt runs)."""
        listener = None
        if self.fence is not None:
            try:  # taken first: the port is ours on this host before the session manager starts
                listener = loopback_listener(port)
            except OSError as e:
                return f"127.0.0.1:{port}: {e.strerror or e}"
        try:
            self.fsm = self._popen([str(Path(self.s.bin_dir) / FSM), "--config", str(cfg)], "fsm", self.home,
                                   process_group=0)
            why = self._wait_listening(port)
            if why is None and listener is not None:
                self.forwarder = self._popen(self.fence.forward_command(listener.fileno(), port, self.fsm.pid),
                                             "forwarder", self.workdir, pass_fds=(listener.fileno(), self.fence.fd),
                                             inside=False, process_group=self.fsm.pid)
        finally:
            if listener is not None:
                listener.close()  # the forwarder holds it now (or nobody: the attempt failed)
        if why is not None:
            self._end(self.fsm)
            self.fsm = None
        return why

    def _wait_listening(self, port: int) -> Optional[str]:
        """None once *our* session manager listens on port and port + 1 (in its own network namespace), else why
        not."""
        deadline = time.monotonic() + self.s.start_timeout_s
        while time.monotonic() < deadline:
            if self.fsm.poll() is not None:
                return f"it exited with code {self.fsm.returncode}"
            mine = {p for _, p in listeners(self.fsm.pid)}
            if {port, port + 1} <= mine:
                return None
            time.sleep(0.05)
        return f"not listening on {port} and {port + 1} after {self.s.start_timeout_s:.0f} s"

    def _wait_node_ready(self) -> None:
        """Return once Flame lists every node Ready (one node: any Ready node); ``ClusterError`` when a manager exits
        or ``start_timeout_s`` passes. A stop signal during a gRPC wait (the channel's readiness, up to 10 s; a
        listing, ``READY_POLL_TIMEOUT_S``; the channel's close) is raised after it (``stops_held``: raised inside, it hung
        the channel's clean-up), and the connection is closed either way."""
        import flamepy

        deadline = time.monotonic() + self.s.start_timeout_s
        want = {n.name for n in self.nodes if n.emulated}
        conn = None
        try:
            with stops_held():
                conn = flamepy.connect(self.endpoint)
            conn._frontend = DeadlineStub(conn._frontend, READY_POLL_TIMEOUT_S)
            ready = self._poll_ready(conn, want, deadline)
        finally:
            if conn is not None:
                with stops_held():  # its close waits for gRPC's threads too
                    conn.close()
        if ready is not None:
            raise ClusterError(f"nodes Ready after {self.s.start_timeout_s:.0f} s: {sorted(ready) or 'none'} "
                               f"(expected {sorted(want) or 'one'}); logs in {self.log_dir} and nodes/*/home/logs")

    def _poll_ready(self, conn, want: set, deadline: float) -> Optional[set]:
        """None once ``conn`` lists the nodes ``want`` Ready (empty: any); the nodes Ready at ``deadline`` if not.
        ``ClusterError`` when a manager exits."""
        import flamepy

        ready: set = set()
        while time.monotonic() < deadline:
            for node in self.nodes:
                p = self.fems[node.name]
                if p.poll() is not None:
                    raise ClusterError(f"the executor manager of node {node.name} exited with code {p.returncode}; "
                                       f"logs in {node.log_dir}:\n{self.log_tail('fem', node=node.name)}")
            if self.fsm.poll() is not None:
                raise ClusterError(f"the session manager exited with code {self.fsm.returncode}:\n{self.log_tail('fsm')}")
            try:
                with stops_held():
                    ready = {n.metadata.name for n in conn.list_nodes() if n.status.state == 1}  # NodeState Ready
            except flamepy.FlameError:
                pass
            if ready and want <= ready:
                return None
            time.sleep(0.1)
        return ready

    # ------------------------------------------------------------------ inspection
    def log_text(self, which: str = "fsm", node: Optional[str] = None) -> str:
        """The log of the session manager (``fsm``) or the executor managers (``fem``; ``node``: that node's only):
        their own files, then stderr, node by node."""
        dirs = [self.log_dir]
        if which == "fem" and self.nodes:
            dirs = [n.log_dir for n in self.nodes if node is None or n.name == node]
        out = []
        for d in dirs:
            for f in sorted(d.glob(f"{which}-*")) + [d / f"{which}.stderr"]:
                try:
                    out.append(f.read_text(errors="replace"))
                except OSError:
                    pass
        return "".join(out)

    def log_tail(self, which: str = "fsm", n: int = 4000, node: Optional[str] = None) -> str:
        """The last ``n`` characters of ``log_text(which, node)``."""
        return self.log_text(which, node)[-n:]

    def processes(self) -> list:
        """Every live process of this cluster: the managers, the services and their children."""
        return marked_processes(self.mark)

    def service_processes(self) -> list:
        """The live processes started by the executor manager (services, engine workers)."""
        managers = {p.pid for p in (self.fsm, self.forwarder, *self.fems.values()) if p is not None}
        return [p for p in self.processes() if p.pid not in managers]

    def _conn(self):
        import flamepy

        if getattr(self, "_flame_conn", None) is None:
            self._flame_conn = flamepy.connect(self.endpoint)
        return self._flame_conn

    def session_state(self, session_id: str) -> dict:
        """``{"state": "Open"|"Closed", "counts": {task state name: n}}`` of a session, as Flame reports it."""
        ssn = self._conn().get_session(session_id)
        counts = {"Pending": 0, "Running": 0, "Succeed": 0, "Failed": 0, "Cancelled": 0}
        for t in self.tasks(session_id):
            counts[t["state"]] += 1
        return {"state": "Open" if int(ssn.state) == 0 else "Closed", "counts": counts}

    def session_events(self, session_id: str) -> list[tuple[int, str]]:
        """``[(code, message)]`` of a session's events (1001 bind failed, 1002 retry limit reached)."""
        return [(ev.code, ev.message) for ev in (self._conn().get_session(session_id).events or [])]

    def tasks(self, session_id: str) -> list[dict]:
        """The session's tasks in id order: ``{"id", "state" (name), "state_code"}``. Read with the raw
        ListTask stream: flamepy 0.6.0 cannot parse the Cancelled state (4)."""
        from flamepy.proto.frontend_pb2 import ListTaskRequest

        names = {0: "Pending", 1: "Running", 2: "Succeed", 3: "Failed", 4: "Cancelled"}
        out = [{"id": t.metadata.id, "state_code": int(t.status.state), "state": names[int(t.status.state)]}
               for t in self._conn()._frontend.ListTask(ListTaskRequest(session_id=session_id))]
        return sorted(out, key=lambda t: int(t["id"]))

    def executors(self) -> list[dict]:
        """Executors Flame lists now: ``{"id", "state" (e.g. "Bound"), "session_id", "node"}``."""
        from flamepy.proto import types_pb2

        return [{"id": e.metadata.id, "state": types_pb2.ExecutorState.Name(e.status.state).removeprefix("Executor"),
                 "session_id": e.status.session_id or None, "node": e.spec.node} for e in self._conn().list_executors()]

    @staticmethod
    def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return bool(predicate())

    def kill_session_manager(self, sig: int = signal.SIGKILL) -> None:
        """Fault injection: signal the session manager process only (the forwarder, if any, ends with it and its
        port refuses connections once this returns)."""
        self.fsm.send_signal(sig)
        self.fsm.wait(10)
        if self.forwarder is not None:
            self._end(self.forwarder)

    def restart_session_manager(self) -> None:
        """Fault injection: start the session manager again (after ``kill_session_manager``) on the same ports
        and config, in the cluster's network namespace with a new forwarder when it has one (the old forwarder
        ended with the old manager); returns once it listens. With ``storage: none`` it knows no session of before.
        ``ClusterError``."""
        deadline, why = time.monotonic() + 10, None
        while time.monotonic() < deadline:  # the old forwarder lets go of 127.0.0.1:port as it ends
            why = self._start_session_manager(self.port, self.workdir / "cluster.yaml")
            if why is None:
                return
            time.sleep(0.2)
        raise ClusterError(f"the session manager did not start again on port {self.port}: {why}")

    def kill_executor_manager(self, sig: int = signal.SIGKILL, node: Optional[str] = None) -> None:
        """Fault injection: signal the executor manager of ``node`` (default: the first node) only (its services
        live on until they notice), and wait for it to end unless ``sig`` is ``SIGSTOP`` (a hung node: it stays, and
        ``stop`` ends it); ``KeyError`` for an unknown node."""
        p = self.fems[node] if node is not None else self.fem
        p.send_signal(sig)
        if sig != signal.SIGSTOP:
            p.wait(10)

    def node_processes(self, node: str) -> list:
        """Live processes of ``node``: its executor manager and every process in its UTS namespace (the services
        and engines it started; an emulated node only, else this host's cluster processes)."""
        p, uts = self.fems[node], self.node_uts.get(node)
        return [q for q in self.processes() if q.pid == p.pid or (uts is not None and _uts_of(q.pid) == uts)]

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """End the managers (and the forwarder: their process group), then every process that still carries this
        cluster's mark, then let go of the network namespace; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        others = self.service_processes()
        for p in (*self.fems.values(), self.fsm):
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid if p is self.fsm else os.getpgid(p.pid), signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in (*self.fems.values(), self.fsm, self.forwarder):
            if p is not None:
                self._end(p)
        self._end_marked(others)
        if self.fence is not None:
            self.fence.close()
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        log.info("flame cluster %s stopped; logs in %s", self.mark, self.log_dir)

    def _preexec(self):
        """``die_with_parent``: a function for ``Popen(preexec_fn=...)`` asking Linux to send the manager SIGTERM when
        the thread that starts it ends (the CLI's main thread: so a SIGKILLed ``python -m sut.flame cluster``
        leaves no manager behind; one whose parent died before the ``prctl`` exits at once); else None. Not for processes with other threads (preexec_fn is unsafe there)."""
        if not self.s.die_with_parent or not sys.platform.startswith("linux"):
            return None

        parent = os.getpid()

        def die_with_parent() -> None:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before prctl: no signal will come
                os._exit(1)

        return die_with_parent

    def _end(self, p: subprocess.Popen) -> None:
        try:
            p.wait(self.s.stop_grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def _end_marked(self, seen: list) -> None:
        """SIGTERM the process groups of the cluster's remaining processes, then SIGKILL what is left."""
        import psutil

        own = os.getpgid(0)
        procs = {p.pid: p for p in seen + self.processes()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in procs.values() if p.is_running()]
            if not alive:
                return
            for p in alive:
                try:
                    pg = os.getpgid(p.pid)
                    if pg != own:
                        os.killpg(pg, sig)
                    else:
                        p.send_signal(sig)
                except (ProcessLookupError, PermissionError, psutil.Error):
                    pass
            _, alive = psutil.wait_procs(alive, timeout=self.s.stop_grace_s)
            procs = {p.pid: p for p in alive + self.processes()}
        left = [p.pid for p in procs.values() if p.is_running()]
        if left:
            log.error("flame cluster %s: processes %s survived SIGKILL", self.mark, left)

    def __enter__(self) -> "RealCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _uts_of(pid: int) -> Optional[str]:
    """``uts:[inode]`` of a process's UTS namespace (None when it is gone)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


def _check_nodes(a) -> tuple:
    """``--node-gpus`` as one CUDA_VISIBLE_DEVICES value per node; ``BadInput`` (exit 2) naming a bad ``--nodes``,
    ``--node-prefix`` or ``--node-gpus``, or why this process cannot make nodes of their own (no UTS namespaces)."""
    import re

    from sut.errors import BadInput

    if not 1 <= a.nodes <= MAX_NODES:
        raise BadInput(f"error: --nodes {a.nodes}: expected 1 to {MAX_NODES} (at most {MAX_NODES} emulated nodes on "
                       "one host: each is an executor manager process)")
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?", a.node_prefix):
        raise BadInput(f"error: --node-prefix {a.node_prefix!r}: expected a host-name label (lower-case letters, digits, "
                       "'-' inside; at most 42 characters)")
    try:
        gpus = parse_node_gpus(a.node_gpus, a.nodes)
        check_node_gpus(gpus, host_gpus() if gpus else None, a.node_gpus)
    except ValueError as e:
        raise BadInput(f"error: {e}") from None
    why = uts_unavailable() if a.nodes > 1 else None
    if why:
        raise BadInput(f"error: --nodes {a.nodes}: each node needs a UTS namespace (host name) of its own, and this "
                       f"process cannot make one: {why}")
    return gpus


#: One ``--resreq`` entry as the session manager parses it: ``key=<digits>[unit]`` (flamepy checks key and unit).
_RESREQ_ENTRY = re.compile(r"\s*[A-Za-z]+\s*=\s*[0-9]+[A-Za-z]*\s*")


def _check_args(a) -> Path:
    """The Flame binaries' folder; ``BadInput`` (exit 2, before anything starts) naming a bad or taken ``--port``,
    ``--resreq``, ``--workdir`` or node option (``_check_nodes``), or a folder without the binaries."""
    import flamepy

    from sut.errors import BadInput

    for flag, value in (("--workdir", a.workdir), ("--flame-bin", a.flame_bin)):
        if value is not None and not value.strip():  # '' would be the current folder (or the default binaries)
            raise BadInput(f"error: {flag} {value!r}: expected a folder, got an empty path")
    if not 0 <= a.port <= 65534:
        raise BadInput(f"error: --port {a.port}: expected 0 (two free ports) or a port in 1..65534 (the backend "
                       "port is --port + 1)")
    taken = taken_ports_message(a.port) if a.port else None
    if taken:
        raise BadInput(f"error: --port {a.port}: {taken}")
    try:
        flamepy.ResourceRequirement.from_string(a.resreq)
        bad = [p for p in a.resreq.split(",") if not _RESREQ_ENTRY.fullmatch(p)]
        if bad:  # int() takes '-1', '+1', '1_0'; the session manager (Rust, u64) exits 1 on them at every start
            raise ValueError(f"{bad[0].strip()!r}: a value must be a whole number of plain digits (and a mem unit)")
    except ValueError as e:
        raise BadInput(f"error: --resreq {a.resreq!r}: {e} (e.g. cpu=1,mem=1g)") from None
    bin_dir = find_bin_dir(a.flame_bin)
    if bin_dir is None:  # checked before the work folder is made: a failed start leaves nothing behind
        raise BadInput(f"error: no {FSM} and {FEM} in {a.flame_bin or default_bin_dir()}; pass --flame-bin or set "
                       f"{BIN_ENV}")
    try:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"error: --workdir {a.workdir}: cannot create it ({e.strerror or e})") from None
    return bin_dir


#: In the work folder: held (``flock``) by the cluster command that runs there, with its pid.
WORKDIR_LOCK = ".cluster.lock"


def _lock_workdir(workdir: Path):
    """The open, locked ``WORKDIR_LOCK`` of ``workdir`` (keep it open while the cluster runs); ``BadInput`` when
    another cluster command holds it (two clusters in one folder would share ``cluster.yaml``)."""
    import fcntl

    from sut.errors import BadInput

    f = open(workdir / WORKDIR_LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise BadInput(f"error: --workdir {workdir}: in use by another cluster (pid {holder}); give another folder"
                       ) from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


#: Scheduler policies of Flame v0.6.0 (session_manager/src/scheduler/plugins; shim is always on).
KNOWN_POLICIES = ("priority", "drf", "gang")


def _check_policies(text: str) -> tuple:
    """``--policies`` as a tuple; ``BadInput`` (exit 2) for an empty list or a policy v0.6.0 does not have."""
    from sut.errors import BadInput

    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in KNOWN_POLICIES]
    if not out or bad:
        raise BadInput(f"error: --policies {text!r}: expected some of {', '.join(KNOWN_POLICIES)}, comma-separated")
    return out


def _parser():
    from sut.exits import ShortUsageParser

    p = ShortUsageParser(prog="python -m sut.flame cluster", description=main.__doc__)
    p.add_argument("--flame-bin", help=f"folder with {FSM} and {FEM} (default: ${BIN_ENV}, else ../shared/flame/bin)")
    p.add_argument("--workdir", required=True, help="cluster folder: cluster.yaml, nodes.json, home/ (FLAME_HOME; logs "
                   "in home/logs), fem/; with --nodes N > 1 each node's in nodes/<name>/{home,fem}")
    p.add_argument("--port", type=int, default=0, help="frontend port (backend: port + 1; default: two free ports)")
    p.add_argument("--resreq", default=ClusterSettings.resreq, help="default session resource request")
    p.add_argument("--policies", default=",".join(ClusterSettings.policies), help="Flame scheduler policies, comma-"
                   "separated (default %(default)s; add drf so that a session's resource request must fit a node: the "
                   "way to spread executors over nodes, docs/multinode.md)")
    p.add_argument("--nodes", type=int, default=1, help="executor managers, each a node of its own (more than 1: "
                   "each in a UTS namespace with host name <prefix>-<i>; needs root or CAP_SYS_ADMIN; default 1)")
    p.add_argument("--node-prefix", default=ClusterSettings.node_prefix, help="node names: <prefix>-0, <prefix>-1, ... "
                   "(default node)")
    p.add_argument("--node-gpus", help="CUDA_VISIBLE_DEVICES per node, ':'-separated (e.g. 0:1; 0,1:2,3), or 'each' "
                   "(node i gets GPU i); default: every node inherits this process's")
    return p


def _serve(cluster: RealCluster, done) -> int:
    """Wait for ``done``; 1 once the session manager (or its forwarder) or the last executor manager exits (an
    executor manager that exits while others run is logged: its node is lost, the cluster goes on)."""
    lost: set = set()
    while not done.wait(0.5):
        if any(p is not None and p.poll() is not None for p in (cluster.fsm, cluster.forwarder)):
            log.error("the Flame session manager (or the forwarder to it) exited; stopping (logs in %s)", cluster.log_dir)
            return 1
        for name, p in cluster.fems.items():
            if p.poll() is not None and name not in lost:
                lost.add(name)
                log.error("the executor manager of node %s (pid %d) exited with code %s: Flame lists the node NotReady "
                          "within ~30 s", name, p.pid, p.returncode)
        if len(lost) == len(cluster.fems):
            log.error("no executor manager is left; stopping (logs in %s)", cluster.workdir)
            return 1
    return 0


def main(argv: list[str]) -> int:
    """``python -m sut.flame cluster``: run a cluster in the foreground until Ctrl-C / SIGTERM. Prints
    ``FLAME_ENDPOINT=<url>``, ``FLAME_NODES=<name>,...`` and ``FLAME_NODES_FILE=<workdir>/nodes.json`` once every
    node is Ready."""
    import threading

    a = _parser().parse_args(argv)
    gpus, policies = _check_nodes(a), _check_policies(a.policies)  # before _check_args makes the work folder
    bin_dir = _check_args(a)
    lock = _lock_workdir(Path(a.workdir))  # noqa: F841 - held until this process ends
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    done = threading.Event()

    def interrupt(*_) -> None:  # while the cluster starts: stop starting it (RealCluster.start stops what it started)
        interrupt_unless_held("stop signal while the cluster started")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        cluster = RealCluster(ClusterSettings(bin_dir=bin_dir, workdir=Path(a.workdir), port=a.port, resreq=a.resreq,
                                              die_with_parent=True, nodes=a.nodes, node_prefix=a.node_prefix,
                                              node_gpus=gpus, policies=policies)).start()
    except ClusterError as e:
        print(f"error: {e}")
        return 1
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"FLAME_ENDPOINT={cluster.endpoint}", flush=True)
    print(f"FLAME_NODES={','.join(n.name for n in cluster.nodes)}", flush=True)
    print(f"FLAME_NODES_FILE={cluster.workdir / 'nodes.json'}", flush=True)
    try:
        return _serve(cluster, done)
    finally:
        cluster.stop()
