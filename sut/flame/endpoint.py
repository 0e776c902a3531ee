"""Where the Flame control plane is and whether it answers: ``resolve_endpoint`` (option, else ``FLAME_ENDPOINT``,
else ``~/.flame/flame.yaml``), ``connect`` (a flamepy connection), ``reachable`` (the session manager's frontend
port accepts a TCP connection), ``check_control_plane`` (the preflight before a run: it accepts one, and answers
Flame's ``ListApplication`` call within its deadline: ``ask_control_plane``) and ``lost_cause`` (a lost
task's message, naming an unreachable session manager or one that no longer knows the session) and
``endpoint_exposure`` (the endpoint is not loopback and has no TLS: a warning for the console and run.json).

flamepy 0.6.0 gives its unary calls (list, get, create, close) no deadline: a session manager that is stopped
(SIGSTOP) or hung accepts the TCP connection and never answers, and a call waited for good (found by a fault test:
a stopped session manager held a failed run's stop forever). ``connect`` gives each unary call of the connection
:data:`RPC_TIMEOUT_S`; ``no_answer`` tells such a timeout from other errors (watch streams keep no deadline)."""

from __future__ import annotations

import socket
from typing import Optional
from urllib.parse import urlparse

from sut.errors import RunFailed
from sut.exits import stops_held

#: Seconds Flame's session manager has to accept a TCP connection, and then to answer a Flame call, before a run
#: starts (``check_control_plane``).
PREFLIGHT_TIMEOUT_S = 3.0
#: Seconds a unary call to the session manager may take before it counts as unanswered (``connect``): a healthy one
#: answers in milliseconds; the largest listings of a run (a few hundred executors) stay far below this.
RPC_TIMEOUT_S = 20.0
#: Frontend calls that stream (no deadline: a task's watch lasts as long as the task).
STREAMING_RPCS = frozenset({"WatchTask", "ListTask"})
#: What whoever reaches a Flame v0.6.0 frontend can do (docs/flame.md, Security).
FLAME_RISK = ("Flame v0.6.0 authenticates no client: whoever reaches its session manager (this port and the next) can "
              "run commands on its executor hosts; https (cluster.tls) would encrypt the traffic, not keep others out")


#: What the test stand-in of a Flame cluster (``tests/flame_standin``) puts in every node's ``status.info.os``, so
#: that a run against it says so: its timings say nothing about a real Flame cluster.
STANDIN_MARK = "flame-standin"
STANDIN_NOTE = ("the Flame control plane was the test stand-in (tests/flame_standin), not Flame v0.6.0: its timings "
                "say nothing about a real Flame cluster")


def control_plane_kind(conn) -> str:
    """``"stand-in"`` when a node of the cluster ``conn`` reaches carries :data:`STANDIN_MARK`, ``"flame"`` when
    none does, ``"unknown"`` when the nodes cannot be listed (the run goes on; the record says so)."""
    try:
        with stops_held():
            nodes = conn.list_nodes()
    except Exception:  # noqa: BLE001 - a record field, never a reason to fail the run
        return "unknown"
    return "stand-in" if any(STANDIN_MARK in (n.status.info.os or "") for n in nodes) else "flame"


def resolve_endpoint(endpoint: Optional[str] = None) -> str:
    """Option, else ``FLAME_ENDPOINT``, else ``~/.flame/flame.yaml``; ``RunFailed`` if none, or if that file
    cannot be read."""
    if endpoint:
        return endpoint
    import yaml
    from flamepy import FlameContext, FlameError

    try:
        ctx = FlameContext()  # reads ~/.flame/flame.yaml, then FLAME_ENDPOINT overrides it
    except FlameError as e:
        raise RunFailed(f"cannot read the Flame endpoint from ~/.flame/flame.yaml: {e.message}") from None
    except (OSError, ValueError, TypeError, AttributeError, KeyError, yaml.YAMLError) as e:  # unreadable, bad YAML
        raise RunFailed(f"cannot read the Flame endpoint from ~/.flame/flame.yaml: {e}") from None
    if not ctx._endpoint:
        raise RunFailed("no Flame endpoint: pass --flame-endpoint / --option endpoint=http://HOST:8080, set "
                        "FLAME_ENDPOINT, or write ~/.flame/flame.yaml; to start a cluster on this host: "
                        "python -m sut.flame cluster (docs/flame.md)")
    return ctx._endpoint


def connect(endpoint: Optional[str] = None):
    """``(flamepy Connection, endpoint)``; ``RunFailed`` with the reason if Flame cannot be reached."""
    import flamepy

    ep = resolve_endpoint(endpoint)
    tls = flamepy.FlameContext().tls if ep.startswith("https://") else None
    try:
        with stops_held():  # its wait for the channel (up to 10 s): a Ctrl-C raised inside hangs the channel's clean-up
            conn = flamepy.connect(ep, tls)
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot connect to Flame at {ep}: {e.message}") from None
    stub = getattr(conn, "_frontend", None)  # flamepy 0.6.0's FrontendStub (its calls take gRPC's timeout=)
    if stub is not None:
        conn._frontend = DeadlineStub(stub, RPC_TIMEOUT_S)
    return conn, ep


class DeadlineStub:
    """A gRPC stub whose unary calls get ``timeout_s`` unless given one (streaming calls, :data:`STREAMING_RPCS`,
    are passed through). A call past it raises gRPC's ``DEADLINE_EXCEEDED`` (flamepy: a ``FlameError`` whose message
    says "Deadline Exceeded": ``no_answer``)."""

    def __init__(self, stub, timeout_s: float):
        self._stub, self._timeout_s = stub, timeout_s

    def __getattr__(self, name: str):
        call = getattr(self._stub, name)
        if name in STREAMING_RPCS or not callable(call):
            return call

        def with_deadline(request, *args, **kwargs):
            kwargs.setdefault("timeout", self._timeout_s)
            return call(request, *args, **kwargs)
        return with_deadline


def no_answer(msg: str) -> bool:
    """True when ``msg`` (a flamepy error's message) is a call that got no answer within its deadline."""
    return "deadline exceeded" in str(msg).lower()


def reachable(endpoint: Optional[str], timeout: float = 2.0) -> bool:
    """True if the session manager's frontend port accepts a TCP connection within ``timeout`` seconds
    (False also for a URL whose port is not a number)."""
    u = urlparse(endpoint or "")
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 8080), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def check_control_plane(endpoint: Optional[str] = None, timeout: float = PREFLIGHT_TIMEOUT_S) -> str:
    """The resolved endpoint (``resolve_endpoint``); ``RunFailed`` when there is none, or its session manager does not
    accept a TCP connection within ``timeout`` seconds (``reachable``), or then answers no Flame call within
    ``timeout`` seconds (``ask_control_plane``: another kind of server, a silent or stopped one)."""
    ep = resolve_endpoint(endpoint)
    try:
        u = urlparse(ep)  # "http://[::1": ValueError "Invalid IPv6 URL"
        port_ok = u.port is not None or not u.netloc.endswith(":")
    except ValueError:  # also a port that is not a number or past 65535
        u, port_ok = urlparse(""), False
    if u.scheme not in ("http", "https") or not u.hostname or not port_ok or u.path not in ("", "/"):
        raise RunFailed(f"malformed Flame endpoint {ep!r}: expected http://HOST:PORT (or https://), e.g. "
                        "http://127.0.0.1:8080")
    if not reachable(ep, timeout):
        raise RunFailed(f"no Flame session manager answers at {ep} (nothing accepts a connection there within "
                        f"{timeout:g} s): start one (e.g. `python -m sut.flame cluster`) or pass another "
                        "--flame-endpoint / FLAME_ENDPOINT")
    why = ask_control_plane(ep, timeout)
    if why:
        raise RunFailed(f"no Flame session manager answers at {ep}: {why}; pass the session manager's frontend port "
                        "(--flame-endpoint / FLAME_ENDPOINT), or start one (e.g. `python -m sut.flame cluster`)")
    return ep


def ask_control_plane(endpoint: str, timeout: float = PREFLIGHT_TIMEOUT_S) -> Optional[str]:
    """None when the server at ``endpoint`` answers Flame's ``ListApplication`` call (flamepy 0.6.0's generated stub,
    the cheapest call of the session manager's frontend) within ``timeout`` seconds; else why not, in words. A port
    that accepts TCP is not enough: an HTTP server, a silent listener or the executor managers' backend port took
    the TCP check, and the run failed only after its run folder existed (flamepy's ``connect`` waits 10 s)."""
    import grpc
    from flamepy.proto.frontend_pb2 import ListApplicationRequest
    from flamepy.proto.frontend_pb2_grpc import FrontendStub

    try:
        channel = frontend_channel(endpoint)
    except Exception as e:  # noqa: BLE001 - an unreadable CA file, a bad flame.yaml: said in words
        return f"cannot open a gRPC channel to it ({e})"
    try:
        with stops_held():  # a stop signal waits for the call's deadline (sut.exits.stops_held)
            FrontendStub(channel).ListApplication(ListApplicationRequest(), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (f"it accepts a connection but answered no Flame call within {timeout:g} s (a server of another "
                    "kind, or a stopped session manager)")
        return (f"it accepts a connection but gives no Flame answer (a server of another kind, or the executor "
                f"managers' backend port, frontend + 1: Flame's ListApplication call got {e.code().name}: "
                f"{e.details()})")
    finally:
        with stops_held():
            channel.close()
    return None


def frontend_channel(endpoint: str):
    """A gRPC channel to ``endpoint`` as flamepy's ``connect`` opens it, without its 10 s wait for the channel (https:
    the CA file of ``flame.yaml`` / ``FLAME_CA_FILE``, else the system's CAs); the caller closes it. The one channel
    builder of the preflight and the services' session watch (``enter_watch.frontend_stub``)."""
    import grpc

    u = urlparse(endpoint)
    host = f"[{u.hostname}]" if ":" in (u.hostname or "") else u.hostname
    target = f"{host}:{u.port or 8080}"
    if u.scheme != "https":
        return grpc.insecure_channel(target)
    import flamepy

    tls = flamepy.FlameContext().tls
    roots = None
    if tls is not None and tls.ca_file:
        with open(tls.ca_file, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


def lost_cause(endpoint: Optional[str], msg: str, session_id: Optional[str] = None) -> str:
    """``msg``, prefixed with the likely cause when the session manager is unreachable, or (``session_id`` given)
    answers that it does not know the session (a restarted one: ``storage: none`` loses every session)."""
    if endpoint and not reachable(endpoint):
        return (f"the Flame session manager at {endpoint} is unreachable (it stopped, or the network failed); "
                f"with storage none its sessions are lost: {msg}")
    if endpoint and session_id and _unknown_session(endpoint, session_id):
        from sut.flame.enter_watch import GONE_BOUND_S

        return (f"the Flame session manager at {endpoint} no longer knows session {session_id} (it was restarted, "
                f"and with storage none a restart loses every session): the session's services end by themselves "
                f"within {GONE_BOUND_S:.0f} s, engines included; Flame's executor manager keeps retrying the lost "
                f"executors (an error line for each, many a second) until it is restarted: {msg}")
    return msg


def endpoint_exposure(endpoint: str) -> dict:
    """``sut.core.exposure.exposure`` of a Flame endpoint: ``{"url", "loopback", "tls", "warning"}``, with a warning
    when the endpoint is not loopback and not https; the warning is also logged."""
    import logging

    from sut.core.exposure import exposure

    rec = exposure(endpoint, "Flame endpoint", FLAME_RISK)
    if rec["warning"]:
        logging.getLogger("sut.flame").warning("%s", rec["warning"])
    return rec


def _unknown_session(endpoint: str, session_id: str) -> bool:
    """True when the session manager at ``endpoint`` answers ``NOT_FOUND`` for ``session_id``."""
    from sut.flame.enter_watch import GONE, frontend_stub, session_state

    try:
        return session_state(frontend_stub(endpoint), session_id) == GONE
    except Exception:  # noqa: BLE001 - a message helper: no answer, no claim
        return False
