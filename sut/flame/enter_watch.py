"""While a service enters its session (a slot wait, an engine start: minutes), stop that when the session closes.

Flame v0.6.0 unbinds an executor only once its ``OnSessionEnter`` has returned. A run stopped during its warm-up
(Ctrl-C, a replica that failed) closes its sessions at once, but a service waiting for an engine slot went on
waiting up to ``slot_wait_s`` (300 s) and an engine host went on starting its engine (minutes on a GPU) before
Flame could end them, holding executors and the slot against the next run (breaker, session 10).

``EnterWatch`` asks the session manager every ``poll_s`` (``ENTER_POLL_S``, 2 s) whether the session is still
open, from a daemon thread, until ``done()``. The executor manager gives every service the session manager's
address in ``FLAME_ENDPOINT``; without it, or while the session manager cannot be asked, nothing happens. When
Flame lists the session Closed, or no longer knows it, ``closed`` is set and ``on_closed()`` is called once (the
service then ends its engine start, and its slot wait gives up).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

log = logging.getLogger("sut.flame.service")

#: How often (s) a service that is entering its session asks whether the session is still open.
ENTER_POLL_S = 2.0


class EnterWatch:
    """Watch session ``session_id`` until ``done()``; ``closed`` is set when it closed (module docstring)."""

    def __init__(self, session_id: str, on_closed: Callable[[], None], endpoint: Optional[str] = None,
                 poll_s: float = ENTER_POLL_S):
        self.session_id, self.on_closed, self.poll_s = session_id, on_closed, poll_s
        self.endpoint = endpoint or os.environ.get("FLAME_ENDPOINT")
        self.closed = threading.Event()
        self._done = threading.Event()
        self._conn = None

    def start(self) -> "EnterWatch":
        if self.endpoint:
            threading.Thread(target=self._loop, name="enter-watch", daemon=True).start()
        return self

    def done(self) -> None:
        self._done.set()

    def _loop(self) -> None:
        while not self._done.wait(self.poll_s):
            if self._is_closed():
                self.closed.set()
                if not self._done.is_set():
                    log.warning("session %s was closed while this service entered it: ending the entry", self.session_id)
                    self.on_closed()
                return

    def _is_closed(self) -> bool:
        """True when Flame lists the session Closed or does not know it; False when open or unknown."""
        import flamepy

        from sut.flame.endpoint import connect

        try:
            if self._conn is None:
                self._conn, _ = connect(self.endpoint)
            return self._conn.get_session(self.session_id).state == flamepy.SessionState.CLOSED
        except flamepy.FlameError as e:
            return "not found" in (e.message or "").lower()
        except Exception:  # noqa: BLE001 - cannot ask now: keep entering
            return False
