"""A service watches its session for its whole life: a close while it enters, a session Flame no longer knows after.

**While entering.** Flame v0.6.0 unbinds an executor only once its ``OnSessionEnter`` has returned. A run stopped
during its warm-up (Ctrl-C, a replica that failed) closes its sessions at once, but a service waiting for an engine
slot went on waiting up to ``slot_wait_s`` (300 s) and an engine host went on starting its engine (minutes on a GPU)
before Flame could end them, holding executors and the slot against the next run. When Flame lists the session
Closed, or no longer knows it, ``closed`` is set and ``on_closed()`` is called once (the service then ends its engine
start, and its slot wait gives up); Flame ends the process once the entry returns.

**After entering.** A session manager restarted with ``storage: none`` (or any that lost the session) knows nothing
of the sessions of before, and Flame v0.6.0 never ends their services: the executor manager keeps their executors
Bound and retries them in a loop, and an engine host would hold its engine slot (and the engine's memory) against
every later run on the host (measured: minutes, until the next run's slot wait of 300 s failed it). So the watch
goes on after ``entered()``: when the session manager answers that it does not know the session (gRPC
``NOT_FOUND``), or cannot be asked for :data:`UNREACHABLE_S` in a row (it is gone: no task can reach the service
any more), ``on_gone(reason)`` is called once and the watch ends; the service then stops (engine included).
A session that is merely Closed is left to Flame, which unbinds and ends its services itself (a service that ended
on its own while Flame unbinds it would leave its executor stuck in Unbinding).

**Bound.** A service ends within :data:`GONE_BOUND_S` (55 s) of its session manager's first answer that it does
not know the session: one poll (:data:`POLL_S`), one call (:data:`ASK_TIMEOUT_S`) and the service's shutdown, at most
:data:`SHUTDOWN_BOUND_S` (the engine's ``Stop``, then its process group's SIGTERM and SIGKILL:
``sut.engine.handle.EngineHandle.shutdown``). Measured on the real v0.6.0 control plane: ~5 s with the tests' fake
engine, 19 s with the tiny vLLM engine on 2 busy CPU cores. Within :data:`UNREACHABLE_S` more when the session
manager cannot be asked at all.

The session manager's address comes from ``FLAME_ENDPOINT``, which the executor manager gives every service;
without it nothing is watched. Calls go through flamepy 0.6.0's generated stub (``GetSession``) with a deadline, so
that an unknown session reads as ``NOT_FOUND`` (flamepy's ``Connection.get_session`` turns every error into one
message without the status) and a call never blocks the watch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("sut.flame.service")

#: How often (s) a service asks the session manager about its session.
POLL_S = 2.0
#: Deadline (s) of one ``GetSession`` call.
ASK_TIMEOUT_S = 5.0
#: A session manager that cannot be asked for this long (s) in a row counts as gone, with its sessions.
UNREACHABLE_S = 60.0
#: The longest a service's shutdown takes (s): its engine's ``Stop`` (30 s), then 10 s after SIGTERM and 5 s after
#: SIGKILL of its process group (``EngineHandle.shutdown``, ``READY_TERM_WAIT_S``), and 3 s for the gRPC server.
SHUTDOWN_BOUND_S = 30.0 + 10.0 + 5.0 + 3.0
#: Seconds within which a service whose session Flame no longer knows has ended (module docstring).
GONE_BOUND_S = POLL_S + ASK_TIMEOUT_S + SHUTDOWN_BOUND_S
#: Kept for callers of the former name of the poll interval.
ENTER_POLL_S = POLL_S

OPEN, CLOSED, GONE = "open", "closed", "gone"


class SessionWatch:
    """Watch session ``session_id`` from a daemon thread (module docstring).

    Args:
        on_closed: called once when the session closes (or is gone) before ``entered()``.
        on_gone: called once with the reason when the session is gone after ``entered()`` (None: only logged).
        endpoint: the session manager (default ``FLAME_ENDPOINT``; none: nothing is watched).
        poll_s, unreachable_s: as :data:`POLL_S`, :data:`UNREACHABLE_S`.
    """

    def __init__(self, session_id: str, on_closed: Callable[[], None], endpoint: Optional[str] = None,
                 poll_s: float = POLL_S, on_gone: Optional[Callable[[str], None]] = None,
                 unreachable_s: float = UNREACHABLE_S):
        self.session_id, self.on_closed, self.on_gone = session_id, on_closed, on_gone
        self.poll_s, self.unreachable_s = poll_s, unreachable_s
        self.endpoint = endpoint or os.environ.get("FLAME_ENDPOINT")
        self.closed = threading.Event()  # closed or gone while entering
        self.gone = threading.Event()  # gone after entering
        self._entered = threading.Event()
        self._stop = threading.Event()
        self._stub = None

    def start(self) -> "SessionWatch":
        if self.endpoint:
            threading.Thread(target=self._loop, name="session-watch", daemon=True).start()
        return self

    def entered(self) -> None:
        """The entry is over (returned or failed): from now on only a gone session counts."""
        self._entered.set()

    done = entered  # the entry-only name

    def stop(self) -> None:
        """End the watch (the service is shutting down anyway)."""
        self._stop.set()

    def _loop(self) -> None:
        unreachable_since: Optional[float] = None
        while not self._stop.wait(self.poll_s):
            state = self.state()
            now = time.monotonic()
            unreachable_since = (unreachable_since or now) if state is None else None
            if not self._entered.is_set():
                if state in (CLOSED, GONE) and not self.closed.is_set():
                    self.closed.set()
                    log.warning("session %s was closed while this service entered it: ending the entry",
                                self.session_id)
                    self.on_closed()
                continue
            if state == GONE:
                why = f"the Flame session manager at {self.endpoint} no longer knows session {self.session_id}"
            elif unreachable_since is not None and now - unreachable_since >= self.unreachable_s:
                why = (f"the Flame session manager at {self.endpoint} has not answered for "
                       f"{now - unreachable_since:.0f} s (session {self.session_id})")
            else:
                continue
            self.gone.set()
            log.warning("%s (restarted, or lost it): stopping this service (the engine with it), as Flame never "
                        "ends the services of a session it lost", why)
            if self.on_gone is not None:
                self.on_gone(why)
            return

    def state(self) -> Optional[str]:
        """The session's state now (:func:`session_state`)."""
        try:
            if self._stub is None:
                self._stub = frontend_stub(self.endpoint)
        except Exception:  # noqa: BLE001 - cannot ask now
            return None
        return session_state(self._stub, self.session_id)


def session_state(stub, session_id: str, timeout: float = ASK_TIMEOUT_S) -> Optional[str]:
    """:data:`OPEN`, :data:`CLOSED`, :data:`GONE` (the session manager answers ``NOT_FOUND``), or None when it cannot
    be asked now (no answer within ``timeout`` seconds, or another error). ``stub``: :func:`frontend_stub`'s."""
    import grpc
    from flamepy.proto.frontend_pb2 import GetSessionRequest

    try:
        reply = stub.GetSession(GetSessionRequest(session_id=session_id), timeout=timeout)
    except grpc.RpcError as e:
        return GONE if e.code() == grpc.StatusCode.NOT_FOUND else None
    except Exception:  # noqa: BLE001 - cannot ask now
        return None
    return OPEN if int(reply.status.state) == 0 else CLOSED


def frontend_stub(endpoint: str):
    """A ``FrontendStub`` on a channel to ``endpoint`` (``sut.flame.endpoint.frontend_channel``)."""
    from flamepy.proto.frontend_pb2_grpc import FrontendStub

    from sut.flame.endpoint import frontend_channel

    return FrontendStub(frontend_channel(endpoint))


EnterWatch = SessionWatch  # the entry-only name
