"""A network namespace of its own for a one-host Flame cluster, and the loopback forwarder that lets this host in.

Why: Flame v0.6.0's session manager listens on **0.0.0.0** on the endpoint's port and on port + 1 whatever the
configuration says (``session_manager/src/apiserver/mod.rs``: ``ALL_HOST_ADDRESS``; the endpoint's host is not
used, and ``network_interface`` is a key of the object cache only). Its ``cluster.tls`` section is server TLS
only: no client certificates are asked for (tonic ``ServerTlsConfig`` with an identity alone; flamepy 0.6.0's
``FlameClientTls`` has a ``ca_file`` and nothing else), so it encrypts but authenticates nobody. Neither keeps
other hosts out; a network namespace does: inside it there is only a loopback interface.

How (Linux, root or ``CAP_SYS_ADMIN``):

- ``NetFence.create()``: a new network namespace, loopback up, made by a short-lived thread (network namespaces
  belong to threads) and held open by a file descriptor of this process; ``FenceUnavailable`` with the reason
  when the kernel refuses (not root; a container without ``CAP_SYS_ADMIN``; seccomp).
- ``fence.command(argv)`` (with ``pass_fds=fence.pass_fds``): ``argv`` run inside it, through a small Python
  wrapper that joins the namespace and ``exec``s ``argv`` (so the process id is the program's).
- ``fence.forward_command(listen_fd, port, pid)``: a forwarder process that accepts on ``listen_fd`` (a socket
  listening on 127.0.0.1:port of this host, ``loopback_listener``) and connects each connection to
  127.0.0.1:port inside the namespace, where the session manager listens; it exits when process ``pid`` (the
  session manager) ends, closing its listener first, so the port refuses connections once the session manager
  is gone. Every process of the cluster (executor manager, services, engines) inherits the namespace: they reach
  each other over its loopback and Unix sockets, and nothing else on the network.
- ``listeners(pid)``: a process's listening TCP sockets as its own namespace sees them (psutil reads the
  caller's namespace); ``namespace_id`` and ``interfaces`` tell namespaces apart and what each can reach.

This file also runs as a script, with the standard library only (``python -I -S netns.py exec FD PROG ARG...`` /
``forward LISTEN_FD NS_FD PORT PID``): that is what ``command`` and ``forward_command`` start.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

CLONE_NEWNET = 0x40000000  # <linux/sched.h>
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # <linux/sockios.h>, <net/if.h>
#: Seconds the forwarder waits, after the session manager closed a connection, to learn whether it ended.
GONE_WAIT_S = 0.25
#: Bytes one ``recv`` of the forwarder takes at most.
CHUNK = 1 << 18
_TCP_LISTEN = "0A"  # <net/tcp_states.h> TCP_LISTEN, as /proc/net/tcp writes it


class FenceUnavailable(RuntimeError):
    """This process cannot make a network namespace (the reason is the message)."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    """Move the calling thread into the network namespace ``fd``; ``OSError`` when refused."""
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def _loopback_up() -> None:
    """Set the ``lo`` interface of the calling thread's network namespace up (then it has 127.0.0.1 and ::1)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def namespace_id(pid: int | str = "self") -> str:
    """``net:[inode]`` of a process's network namespace (equal for processes that share it)."""
    return os.readlink(f"/proc/{pid}/ns/net")


def interfaces(pid: int | str = "self") -> list[str]:
    """Names of the network interfaces a process sees (``/proc/PID/net/dev``)."""
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines if ":" in line)


def _hex_address(text: str) -> str:
    """``/proc/net/tcp{,6}``'s address (hex, 32-bit words in host order) as an IP string."""
    import ipaddress

    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return str(ipaddress.ip_address(words))


def listeners(pid: int, seen_from: int | str | None = None) -> list[tuple[str, int]]:
    """``[(ip, port)]`` of the TCP sockets process ``pid`` listens on in the network namespace of process
    ``seen_from`` (default: ``pid``'s own; ``"self"``: this process's), read from ``/proc/SEEN_FROM/net/tcp{,6}``
    and ``pid``'s file descriptors (a socket belongs to the namespace it was made in, whatever namespace its
    process is in now); empty when it has none there or is gone."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        out = []
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{seen_from or pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == _TCP_LISTEN and f[9] in inodes:
                    ip, port = f[1].rsplit(":", 1)
                    out.append((_hex_address(ip), int(port, 16)))
        return sorted(set(out))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def loopback_listener(port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` of this process's namespace (inheritable); ``OSError`` if taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(128)
    except OSError:
        s.close()
        raise
    s.set_inheritable(True)
    return s


class NetFence:
    """A network namespace with loopback only, held open by ``fd`` until ``close``; see the module docstring."""

    def __init__(self, fd: int):
        self.fd = fd
        self.id = os.readlink(f"/proc/self/fd/{fd}")  # net:[inode]

    @classmethod
    def create(cls) -> "NetFence":
        """A new namespace; ``FenceUnavailable`` (with the kernel's reason) when this process may not make one."""
        if not sys.platform.startswith("linux"):
            raise FenceUnavailable(f"network namespaces are Linux only (this is {sys.platform})")
        out: dict = {}

        def make() -> None:  # a thread of its own: unshare moves only the calling thread, which then ends
            try:
                if _libc().unshare(CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, os.strerror(e))
                out["fd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                _loopback_up()
            except OSError as e:
                out["error"] = e

        t = threading.Thread(target=make, name="netns-create")
        t.start()
        t.join()
        if "error" in out:
            if "fd" in out:
                os.close(out["fd"])
            e = out["error"]
            hint = " (needs root or CAP_SYS_ADMIN)" if e.errno in (errno.EPERM, errno.EACCES) else ""
            raise FenceUnavailable(f"cannot make a network namespace: {e.strerror or e}{hint}")
        return cls(out["fd"])

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """What ``subprocess.Popen(pass_fds=...)`` must pass for ``command``."""
        return (self.fd,)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` (absolute program path first) run inside the namespace, as the same process (exec)."""
        return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "exec", str(self.fd), *argv]

    def forward_command(self, listen_fd: int, port: int, pid: int) -> list[str]:
        """The forwarder: 127.0.0.1:``port`` here (``listen_fd``) -> 127.0.0.1:``port`` inside, until ``pid`` ends.
        Popen needs ``pass_fds=(listen_fd, *fence.pass_fds)``."""
        return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "forward", str(listen_fd), str(self.fd),
                str(port), str(pid)]

    def close(self) -> None:
        """Let go of the namespace (it ends with the last process in it); idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------------------------------------- script side
def _exec_inside(ns_fd: int, argv: list[str]) -> None:
    """Join the namespace, then become ``argv``; on failure exit 126 saying why on stderr."""
    try:
        _setns(ns_fd)
        os.close(ns_fd)
        os.execv(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"netns exec {argv[0]}: {e}\n")
        os._exit(126)


def _gone(pidfd: int, wait_s: float) -> bool:
    """True when the watched process has ended (its pidfd is readable) within ``wait_s`` seconds."""
    return bool(select.select([pidfd], [], [], wait_s)[0])


def _leave(listen_fd: int) -> None:
    """The session manager ended: refuse new connections first, then end (closing every relayed connection)."""
    try:
        os.close(listen_fd)
    finally:
        os._exit(0)


def _pump(src: socket.socket, dst: socket.socket, done: threading.Event, watch: Optional[tuple[int, int]]) -> None:
    """Copy ``src`` to ``dst`` until EOF or an error; then half-close ``dst``. ``watch`` (pidfd, listen_fd): the
    session manager's side: when it closed first and the session manager has ended, ``_leave``."""
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    if watch is not None and not done.is_set() and _gone(watch[0], GONE_WAIT_S):
        _leave(watch[1])
    done.set()
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _relay(client: socket.socket, port: int, pidfd: int, listen_fd: int) -> None:
    """One accepted connection <-> a new connection to 127.0.0.1:``port`` of the namespace."""
    try:
        up = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        if _gone(pidfd, GONE_WAIT_S):
            _leave(listen_fd)
        client.close()
        return
    up.settimeout(None)
    for s in (client, up):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    done = threading.Event()
    t = threading.Thread(target=_pump, args=(client, up, done, None), daemon=True)
    t.start()
    _pump(up, client, done, (pidfd, listen_fd))
    t.join()
    client.close()
    up.close()


def _forward(listen_fd: int, ns_fd: int, port: int, pid: int) -> int:
    """Accept on ``listen_fd`` (this host's 127.0.0.1:port) and relay into the namespace until ``pid`` ends."""
    listener = socket.socket(fileno=listen_fd)
    _setns(ns_fd)  # from here on, every socket this process makes is inside the namespace
    os.close(ns_fd)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0
    while True:
        ready = select.select([listener, pidfd], [], [])[0]
        if pidfd in ready:
            _leave(listen_fd)
        try:
            client, _ = listener.accept()
        except OSError:
            continue
        threading.Thread(target=_relay, args=(client, port, pidfd, listen_fd), daemon=True).start()


def main(argv: list[str]) -> int:
    """``exec NS_FD PROG [ARG...]`` or ``forward LISTEN_FD NS_FD PORT PID`` (see the module docstring)."""
    if len(argv) >= 3 and argv[0] == "exec":
        _exec_inside(int(argv[1]), argv[2:])
    if len(argv) == 5 and argv[0] == "forward":
        return _forward(int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]))
    sys.stderr.write("usage: netns.py exec NS_FD PROG [ARG...] | forward LISTEN_FD NS_FD PORT PID\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
