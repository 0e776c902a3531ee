"""What a one-host Flame v0.6.0 cluster (``sut.flame.cluster.RealCluster``) needs before it starts.

The binaries' folder (``find_bin_dir``: ``--flame-bin``, ``$FLAME_BIN`` or ../shared/flame/bin), the cluster's
settings (``ClusterSettings``), its two ports (``pick_ports``: a free frontend port p and backend port p + 1,
checked free on 0.0.0.0 as the session manager binds them; ``taken_ports_message`` for a given one) and the
``cluster.yaml`` both managers read (``cluster_yaml``). ``ClusterError``: the cluster could not start.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from pathlib import Path
from typing import Optional

from sut.constants import REPO

BIN_ENV = "FLAME_BIN"
FSM, FEM = "flame-session-manager", "flame-executor-manager"
# Below the Linux ephemeral range (32768-60999), so outgoing connections never take our ports.
PORT_RANGE = (20000, 32000)
DEFAULT_RUST_LOG = "info,flame_session_manager::scheduler::plugins=warn"


class ClusterError(RuntimeError):
    """The cluster could not start (binaries missing, ports taken, a manager exited)."""


class NodesUnavailable(ClusterError):
    """Several nodes were asked for, but this process cannot give executor managers host names of their own."""


def default_bin_dir() -> Path:
    """``$FLAME_BIN``, else ``<repo>/../shared/flame/bin`` (this repository's development set-up)."""
    return Path(os.environ.get(BIN_ENV) or (REPO.parent / "shared" / "flame" / "bin"))


def find_bin_dir(bin_dir: Optional[str | Path] = None) -> Optional[Path]:
    """The folder holding both executables (``bin_dir``, else ``default_bin_dir()``), or None."""
    d = Path(bin_dir) if bin_dir else default_bin_dir()
    if all(os.access(d / b, os.X_OK) for b in (FSM, FEM)):
        return d.resolve()
    return None


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """One one-host cluster. ``port`` 0 = two free consecutive ports in ``PORT_RANGE``; ``nodes`` executor managers
    (more than 1: emulated nodes, ``sut.flame.nodes``)."""

    bin_dir: Path
    workdir: Path
    port: int = 0
    max_executors: int = 128  # cluster.limits.max_executors (v0.6.0 parses it but does not enforce it)
    resreq: str = "cpu=1,mem=1g"  # cluster default resreq of sessions without one
    policies: tuple = ("priority", "gang")
    schedule_interval_ms: int = 100
    retry_limits: int = 5  # cluster.recovery.session.retry_limits (bind failures per session)
    rust_log: str = DEFAULT_RUST_LOG
    die_with_parent: bool = False  # Linux: the managers get SIGTERM when this process dies (the CLI; not in threads)
    start_timeout_s: float = 30.0
    stop_grace_s: float = 5.0
    env: tuple = ()  # extra (key, value) pairs for both managers (the services inherit them)
    isolate: bool = True  # a network namespace of its own (sut.flame.netns) where this process may make one
    nodes: int = 1  # executor managers; > 1: each a node of its own (sut.flame.nodes: UTS namespace, host name)
    node_prefix: str = "node"  # nodes are named <node_prefix>-0, <node_prefix>-1, ... (nodes > 1)
    node_gpus: tuple = ()  # one CUDA_VISIBLE_DEVICES value per node, or () to inherit this process's


def _port_free(port: int) -> bool:
    """True if ``port`` can be bound on 0.0.0.0 (as the session manager binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def taken_ports_message(port: int) -> Optional[str]:
    """Why ``port`` (frontend) and ``port + 1`` (backend) cannot be the cluster's: the ones in use; None when free."""
    taken = [p for p in (port, port + 1) if not _port_free(p)]
    if not taken:
        return None
    return (f"port {' and '.join(map(str, taken))} in use: the session manager needs --port {port} (frontend) and "
            f"{port + 1} (backend) free on every interface; give other ports, or none (two free ones are picked)")


def pick_ports(rng: Optional[random.Random] = None, tries: int = 200) -> int:
    """A port p such that p and p + 1 are both free now (the frontend and backend ports)."""
    rng = rng or random.Random()
    for _ in range(tries):
        p = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - 1)
        if _port_free(p) and _port_free(p + 1):
            return p
    raise ClusterError(f"no two free consecutive ports found in {PORT_RANGE}")


def cluster_yaml(s: ClusterSettings, port: int) -> str:
    """The cluster file both managers read (flame-cluster.yaml format of v0.6.0)."""
    pol = "".join(f"\n    - {p}" for p in s.policies)
    return (f"---\ncluster:\n  name: flame\n  endpoint: \"http://127.0.0.1:{port}\"\n  resreq: \"{s.resreq}\"\n"
            f"  policies:{pol}\n  storage: none\n  schedule_interval: {int(s.schedule_interval_ms)}\n"
            f"  executors:\n    shim: host\n  limits:\n    max_executors: {int(s.max_executors)}\n"
            f"  recovery:\n    session:\n      retry_limits: {int(s.retry_limits)}\n")
