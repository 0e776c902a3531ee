"""Several Flame nodes on one host: one executor manager per node, each in a UTS namespace of its own.

Flame v0.6.0 names a node by its executor manager's host name (``uname`` nodename). Executor managers on one
host therefore make one node unless each has a host name of its own: ``node_command(name, argv)`` runs ``argv``
in a new UTS namespace whose host name is ``name`` (this file run as a script with the standard library only:
``python -I -S nodes.py exec NAME PROG ARG...`` unshares the UTS namespace, sets the host name and ``exec``s
``PROG``, so the process id is the program's). Everything the executor manager starts (services, engines)
inherits the namespace, so ``socket.gethostname()`` in a service names its node. The network namespace stays the
cluster's (``sut.flame.netns``): the nodes reach the session manager over its loopback.

What is per node (``NodePlan``): name (``<prefix>-<i>``), ``FLAME_HOME`` (logs in ``home/logs``), working folder,
executors' socket folder, ``CUDA_VISIBLE_DEVICES`` (optional: one GPU per node on a multi-GPU host), and
``SUT_FLAME_NODE`` (the service then keeps its engine-slot locks in a per-node subfolder: emulated nodes share
one file system). ``uts_unavailable()`` says why this process cannot make UTS namespaces (needs root or
``CAP_SYS_ADMIN``); None when it can.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

CLONE_NEWUTS = 0x04000000  # <linux/sched.h>
#: Set in an emulated node's executor manager (and so its services): the node's name.
NODE_ENV = "SUT_FLAME_NODE"
#: Seconds the UTS probe may take.
PROBE_TIMEOUT_S = 20.0
#: The most emulated nodes on one host (each an executor manager process; a bigger fleet is simulated:
#: docs/benchmarks.md).
MAX_NODES = 64
#: One ``CUDA_VISIBLE_DEVICES`` entry: an index, a GPU UUID or a MIG device id.
_GPU_ID = r"(\d+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+)"
_GPU_LIST = re.compile(rf"{_GPU_ID}(,{_GPU_ID})*")


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """One node of the cluster: ``name`` (its host name), ``home`` (FLAME_HOME), ``cwd`` (the executor manager's working
    folder), ``sock_dir`` (FLAME_SOCKET_DIR), ``gpus`` (CUDA_VISIBLE_DEVICES, or None to inherit), ``emulated``
    (a UTS namespace of its own; False: the one node of a one-node cluster, named by this host)."""

    name: str
    home: Path
    cwd: Path
    sock_dir: Path
    gpus: Optional[str] = None
    emulated: bool = True

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def env(self) -> dict:
        """The executor manager's environment entries of this node."""
        out = {"FLAME_HOME": str(self.home), "FLAME_SOCKET_DIR": str(self.sock_dir)}
        if self.emulated:
            out[NODE_ENV] = self.name
        if self.gpus is not None:
            out["CUDA_VISIBLE_DEVICES"] = self.gpus
        return out

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run as this node (``node_command`` when emulated, else as it is)."""
        return node_command(self.name, argv) if self.emulated else list(argv)

    def record(self, pid: Optional[int]) -> dict:
        """``{"name", "pid", "home", "logs", "gpus", "emulated"}`` (the cluster's ``nodes.json`` entry)."""
        return {"name": self.name, "pid": pid, "home": str(self.home), "logs": str(self.log_dir), "gpus": self.gpus,
                "emulated": self.emulated}


def node_names(prefix: str, n: int) -> list[str]:
    """``["<prefix>-0", ..., "<prefix>-<n-1>"]``."""
    return [f"{prefix}-{i}" for i in range(n)]


def plan_nodes(workdir: Path, sock_root: Path, prefix: str, gpus: tuple = (), n: int = 2) -> list[NodePlan]:
    """``n`` nodes under ``workdir/nodes/<name>/{home,fem}``, sockets in ``sock_root/<i>`` (short: a Unix socket
    path has at most 108 bytes); ``gpus`` is empty or one CUDA_VISIBLE_DEVICES value per node (``ValueError``
    otherwise)."""
    if gpus and len(gpus) != n:
        raise ValueError(f"{len(gpus)} GPU list(s) for {n} nodes: give one per node")
    out = []
    for i, name in enumerate(node_names(prefix, n)):
        base = workdir / "nodes" / name
        out.append(NodePlan(name, base / "home", base / "fem", sock_root / str(i), gpus[i] if gpus else None))
    return out


def parse_node_gpus(text: Optional[str], n: int) -> tuple:
    """``--node-gpus``: ``"0:1"`` (node 0 gets GPU 0, node 1 GPU 1; ``"0,1:2,3"`` two each) or ``"each"`` (node i
    gets GPU i) -> one CUDA_VISIBLE_DEVICES value per node (indices, ``GPU-`` UUIDs or ``MIG-`` ids); ``()`` for None.
    ``ValueError`` naming the mismatch or the value that is none."""
    if not text:
        return ()
    if text == "each":
        return tuple(str(i) for i in range(n))
    parts = tuple(p.strip() for p in text.split(":"))
    if len(parts) != n or not all(parts):
        raise ValueError(f"--node-gpus {text!r}: expected {n} non-empty CUDA_VISIBLE_DEVICES values separated by ':' "
                         "(one per node, e.g. 0:1), or 'each'")
    bad = next((p for p in parts if not _GPU_LIST.fullmatch(p)), None)
    if bad is not None:
        raise ValueError(f"--node-gpus {text!r}: {bad!r} is no CUDA_VISIBLE_DEVICES value (GPU indices, GPU-... UUIDs "
                         "or MIG-... ids, ',' between them)")
    owner: dict = {}
    for i, part in enumerate(parts):
        for gpu in part.split(","):
            if owner.setdefault(gpu, i) != i:
                raise ValueError(f"--node-gpus {text!r}: GPU {gpu} is given to node {owner[gpu]} and node {i} (each "
                                 "GPU to one node)")
    return parts


def host_gpus() -> Optional[dict]:
    """The names CUDA_VISIBLE_DEVICES can give this host's GPUs, each mapped to the GPU it names: every index and
    ``GPU-`` UUID that ``nvidia-smi -L`` lists to that GPU's UUID, every ``MIG-`` id to itself (physical: nvidia-smi
    reads no CUDA_VISIBLE_DEVICES, as a node's fresh value is not relative to one); None when there is no nvidia-smi
    or it fails (no NVIDIA driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    names: dict = {}
    for line in out.stdout.splitlines():
        uuid = re.search(r"\(UUID: ((?:GPU|MIG)-[^)\s]+)\)", line)
        if uuid is None:
            continue
        names[uuid[1]] = uuid[1]
        index = re.match(r"GPU (\d+):", line)
        if index is not None:
            names[index[1]] = uuid[1]
    return names


def _which_gpu(name: str, listed: dict) -> tuple[Optional[str], str]:
    """``(the GPU`` ``name`` (one CUDA_VISIBLE_DEVICES entry) names in ``listed`` (``host_gpus``), ``why not)``:
    a ``GPU-`` / ``MIG-`` id may be given by its first characters when no other listed id starts so (CUDA's
    abbreviated form); an index is one ``nvidia-smi -L`` lists."""
    if name in listed:
        return listed[name], ""
    if name.isdigit():
        return None, "is not on this host"
    starts = sorted({listed[k] for k in listed if k.startswith(name)})
    if len(starts) == 1:
        return starts[0], ""
    if starts:
        return None, f"is the start of {len(starts)} of this host's ids ({', '.join(starts)}): give enough to tell one"
    other = next((k for k in listed if k.lower().startswith(name.lower())), None)
    return None, "is not on this host" + (f" (nvidia-smi writes it {other}: give it as listed)" if other else "")


def check_node_gpus(values: tuple, listed: Optional[dict], given: str) -> None:
    """``ValueError`` naming the first GPU of ``values`` (``parse_node_gpus``) that ``listed`` (``host_gpus``) lacks
    (or a prefix of several of its ids), or one GPU given twice under two names (its index and its UUID: two nodes,
    or one node, would share it), or saying that the host has none (``listed`` None or empty): a node would report a
    GPU it does not have, and an engine placed there would fail to start. ``given``: the ``--node-gpus`` text, for
    the message."""
    if not values:
        return
    if not listed:
        raise ValueError(f"--node-gpus {given!r}: this host has no NVIDIA GPU that nvidia-smi -L lists (it lists none, "
                         "failed, e.g. a driver / library mismatch, or there is no nvidia-smi: run it to see which); "
                         "leave --node-gpus out for CPU nodes")
    indices = sorted((x for x in listed if x.isdigit()), key=int)
    owner: dict = {}
    for i, value in enumerate(values):
        for name in value.split(","):
            gpu, why = _which_gpu(name, listed)
            if gpu is None:
                raise ValueError(f"--node-gpus {given!r}: node {i}'s GPU {name} {why} (nvidia-smi -L lists GPU "
                                 f"{', '.join(indices) or 'none'} and their GPU- / MIG- ids)")
            if gpu in owner:
                j, first = owner[gpu]
                raise ValueError(f"--node-gpus {given!r}: node {i}'s GPU {name} is node {j}'s GPU {first} again "
                                 f"({gpu}; each GPU to one node, once)")
            owner[gpu] = (i, name)


def node_command(name: str, argv: list[str]) -> list[str]:
    """``argv`` (absolute program path first) run as node ``name``: a new UTS namespace with that host name."""
    return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "exec", name, *argv]


def uts_unavailable() -> Optional[str]:
    """Why this process cannot run executor managers as nodes of their own (no UTS namespaces), else None."""
    if not sys.platform.startswith("linux"):
        return f"UTS namespaces are Linux only (this is {sys.platform})"
    p = subprocess.run(node_command("probe", ["/bin/true"]), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if p.returncode == 0:
        return None
    return (p.stderr.strip() or f"exit code {p.returncode}") + " (needs root or CAP_SYS_ADMIN)"


# ---------------------------------------------------------------------------------------------- script side
def _exec_as_node(name: str, argv: list[str]) -> None:
    """Unshare the UTS namespace, set the host name to ``name``, become ``argv``; on failure exit 126 saying why."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if libc.unshare(CLONE_NEWUTS) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"cannot make a UTS namespace: {os.strerror(e)}")
        raw = name.encode()
        if libc.sethostname(raw, len(raw)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"sethostname {name}: {os.strerror(e)}")
        os.execv(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"{e.strerror or e}\n")
        os._exit(126)


def main(argv: list[str]) -> int:
    """``exec NAME PROG [ARG...]`` (see the module docstring)."""
    if len(argv) >= 3 and argv[0] == "exec":
        _exec_as_node(argv[1], argv[2:])
    sys.stderr.write("usage: nodes.py exec NAME PROG [ARG...]\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
