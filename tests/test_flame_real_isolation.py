"""The one-host real Flame cluster (sut.flame.cluster) can be reached from this host only: Flame v0.6.0's session
manager listens on every address, so the cluster runs in a network namespace of its own (sut.flame.netns) with a
forwarder from this host's 127.0.0.1. Checked on the listening sockets of every process of a running cluster,
and by connecting from a network namespace these tests make (joined to another of theirs by a veth pair: nothing
outside this machine, nor its own interfaces, is touched). Where no namespace can be made, the cluster starts
exposed and says so. Skipped without the binaries, or where this process may not make network namespaces."""

from __future__ import annotations

import ipaddress
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

flamepy = pytest.importorskip("flamepy")
psutil = pytest.importorskip("psutil")

from sut.flame.netns import FenceUnavailable, NetFence, interfaces, listeners, namespace_id  # noqa: E402
from tests.conftest import REPO, flame_bin_dir, sut_env  # noqa: E402
from tests.flame_standin import echo_app_attributes  # noqa: E402

pytestmark = pytest.mark.realflame

IP = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
HOST_ADDR, PEER_ADDR = "10.213.0.1", "10.213.0.2"  # inside the tests' own namespaces only
PROBE = """import socket, sys
for a in sys.argv[1:]:
    h, p = a.rsplit(":", 1)
    try:
        socket.create_connection((h, int(p)), timeout=3).close()
        print(a, "open")
    except OSError as e:
        print(a, "closed", e.__class__.__name__)
"""


def _fence_or_skip() -> NetFence:
    try:
        return NetFence.create()
    except FenceUnavailable as e:
        pytest.skip(f"this process cannot make network namespaces: {e}")


def _exposed(procs) -> list[str]:
    """The listening sockets of ``procs`` that another host could reach: on an address other than loopback, in a
    network namespace with an interface besides ``lo``; each looked up in the process's own namespace and in this
    test's (a socket stays in the namespace it was made in)."""
    out = []
    for p in procs:
        for view in (p.pid, "self"):
            try:
                others = [i for i in interfaces(view) if i != "lo"]
            except OSError:
                continue
            for ip, port in listeners(p.pid, seen_from=view):
                if others and not ipaddress.ip_address(ip).is_loopback:
                    out.append(f"{p.name()} (pid {p.pid}) on {ip}:{port} in {namespace_id(view)} with {others}")
    return out


def test_nothing_of_a_running_cluster_listens_where_another_host_can_reach_it(real_flame_factory, tmp_path):
    _fence_or_skip().close()
    cluster = real_flame_factory()
    conn = flamepy.connect(cluster.endpoint)  # this host reaches it on 127.0.0.1, through the forwarder
    conn.register_application("echo", echo_app_attributes(working_directory=str(tmp_path / "echo")))
    ssn = conn.create_session(flamepy.SessionAttributes(application="echo", min_instances=1, max_instances=1))
    assert ssn.invoke(b"hello") == b"hello"  # a service runs as well
    procs = cluster.processes()
    assert cluster.service_processes() and {cluster.fsm.pid, cluster.fem.pid} <= {p.pid for p in procs}
    assert not _exposed(procs)
    assert cluster.forwarder.pid in {p.pid for p in procs}
    assert cluster.isolation["isolated"] and cluster.isolation["netns"] == namespace_id(cluster.fsm.pid)
    assert namespace_id(cluster.fsm.pid) != namespace_id("self") and interfaces(cluster.fsm.pid) == ["lo"]
    assert {namespace_id(p.pid) for p in procs if p.pid != cluster.forwarder.pid} == {cluster.isolation["netns"]}
    assert listeners(cluster.forwarder.pid, seen_from="self") == [("127.0.0.1", cluster.port)]
    ssn.close()
    conn.close()


@pytest.fixture
def two_namespaces():
    """``(host, peer)``: two network namespaces of this test, joined by a veth pair: ``HOST_ADDR`` in host,
    ``PEER_ADDR`` in peer (a /30 of their own); both end with the test."""
    if IP is None:
        pytest.skip("no `ip` (iproute2) to join two network namespaces")
    host, peer = _fence_or_skip(), _fence_or_skip()
    holder = subprocess.Popen(peer.command([shutil.which("sleep"), "600"]), pass_fds=peer.pass_fds)
    deadline = time.monotonic() + 30  # the veth end goes to the holder's namespace: wait until it runs in it
    while Path(f"/proc/{holder.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
        time.sleep(0.05)

    def ip(ns, *args):
        subprocess.run(ns.command([IP, *args]), pass_fds=ns.pass_fds, check=True, capture_output=True, timeout=30)

    try:
        ip(host, "link", "add", "vh", "type", "veth", "peer", "name", "vp", "netns", str(holder.pid))
        ip(host, "addr", "add", f"{HOST_ADDR}/30", "dev", "vh")
        ip(host, "link", "set", "vh", "up")
        ip(peer, "addr", "add", f"{PEER_ADDR}/30", "dev", "vp")
        ip(peer, "link", "set", "vp", "up")
        yield host, peer
    finally:
        holder.kill()
        holder.wait(10)
        host.close()
        peer.close()


def _probe(ns: NetFence, *addrs: str) -> dict:
    """``{"HOST:PORT": "open" | "closed"}``: a TCP connection to each, tried from inside ``ns``."""
    out = subprocess.run(ns.command([sys.executable, "-I", "-S", "-c", PROBE, *addrs]), pass_fds=ns.pass_fds,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()}


def test_another_host_cannot_reach_a_cluster_the_cli_started(two_namespaces, tmp_path):
    """`python -m sut.flame cluster` run in a namespace of this test (its "host"): from the peer namespace (another
    "host" on its network) neither the frontend nor the backend port answers; on the host itself the frontend does."""
    host, peer = two_namespaces
    # The probe sees an exposed port: something listening on every address of the host namespace.
    control = subprocess.Popen(host.command([sys.executable, "-I", "-S", "-c", (
        "import socket, sys, time\ns = socket.create_server(('0.0.0.0', 0))\nprint(s.getsockname()[1], flush=True)\n"
        "time.sleep(600)")]), pass_fds=host.pass_fds, stdout=subprocess.PIPE, text=True)
    cli = None
    try:
        control_port = int(control.stdout.readline())
        assert _probe(peer, f"{HOST_ADDR}:{control_port}") == {f"{HOST_ADDR}:{control_port}": "open"}
        cli = subprocess.Popen(host.command([sys.executable, "-m", "sut.flame", "cluster", "--flame-bin",
                                             str(flame_bin_dir()), "--workdir", str(tmp_path / "c")]),
                               pass_fds=host.pass_fds, cwd=REPO, env=sut_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        line = cli.stdout.readline()
        assert line.startswith("FLAME_ENDPOINT=http://127.0.0.1:"), line + cli.stderr.read()[-3000:]
        port = int(line.rsplit(":", 1)[1])
        frontend, backend = f"{HOST_ADDR}:{port}", f"{HOST_ADDR}:{port + 1}"
        assert _probe(peer, frontend, backend) == {frontend: "closed", backend: "closed"}
        assert _probe(host, f"127.0.0.1:{port}") == {f"127.0.0.1:{port}": "open"}
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(30) == 0
    finally:
        for p in (cli, control):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_without_a_namespace_the_cluster_starts_exposed_and_says_so(real_flame_factory, monkeypatch, caplog):
    """Not root (or a container without CAP_SYS_ADMIN): the cluster still starts, as Flame binds it, with a
    warning that names the reason and the ports, and ``isolation`` records it."""
    def refuse():
        raise FenceUnavailable("cannot make a network namespace: Operation not permitted (needs root or CAP_SYS_ADMIN)")

    monkeypatch.setattr(NetFence, "create", staticmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="sut.flame.cluster"):
        cluster = real_flame_factory()
    assert cluster.isolation == {"isolated": False, "reason": "cannot make a network namespace: Operation not "
                                                              "permitted (needs root or CAP_SYS_ADMIN)"}
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "WITHOUT a network namespace of its own (cannot make a network namespace: Operation not permitted" in said
    assert f"listens on every interface on ports {cluster.port} and {cluster.port + 1}" in said
    assert cluster.forwarder is None and namespace_id(cluster.fsm.pid) == namespace_id("self")
    assert ("0.0.0.0", cluster.port) in listeners(cluster.fsm.pid)
    conn = flamepy.connect(cluster.endpoint)
    assert [n.status.state for n in conn.list_nodes()] == [1]
    conn.close()
