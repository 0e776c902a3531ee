"""Task watching for the flame transport: every WatchTask stream of every session on one asyncio loop.

flamepy 0.6.0's ``Session.run`` watches through a pool of 10 threads per connection (the 11th
task's completion is noticed late), and ``Session.watch_task`` iterates a synchronous gRPC
stream, which in grpcio wakes its thread every 100 ms (``grpc._common.MAXIMUM_WAIT_TIMEOUT``)
so that signal handlers can run. With dozens of tasks in flight that is hundreds of wake-ups a
second, each of which takes a core from the engine on a small CPU host. ``AioWatcher`` runs all
streams on one ``grpc.aio`` channel in one loop thread, with flamepy 0.6.0's generated stubs
(``flamepy.proto``): the same ``WatchTask`` RPC, no per-stream polling, and task states read as
plain integers (flamepy's ``TaskState`` has no Cancelled = 4). ``close`` cancels the watches still open (a
failed run stops with tasks in flight), so that their futures end cancelled and no pending task is left on the
loop to be destroyed ("Task was destroyed but it is pending!"); a watch asked for after ``close`` is cancelled
at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Callable, Optional
from urllib.parse import urlparse

PENDING, RUNNING, SUCCEED, FAILED, CANCELLED = 0, 1, 2, 3, 4
TERMINAL = (SUCCEED, FAILED, CANCELLED)


class AioWatcher:
    """``watch(session_id, task_id)`` -> future of ``(state or None, output)``; None = the stream ended silently."""

    def __init__(self, endpoint: str, ca_file: Optional[str] = None, connect_timeout_s: float = 10.0):
        self.endpoint, self.ca_file = endpoint, ca_file
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="flame-watch-loop", daemon=True)
        self.channel = None
        self.stub = None
        self._closing = False
        self._lock = threading.Lock()  # a watch is scheduled before close begins, or it is refused
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(connect_timeout_s), self.loop).result(connect_timeout_s + 5)
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _open(self, timeout: float) -> None:
        import grpc
        from flamepy.proto.frontend_pb2_grpc import FrontendStub

        u = urlparse(self.endpoint)
        target = f"{u.hostname or u.path}:{u.port or 8080}"
        if u.scheme == "https":
            roots = open(self.ca_file, "rb").read() if self.ca_file else None
            self.channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))
        else:
            self.channel = grpc.aio.insecure_channel(target)
        await asyncio.wait_for(self.channel.channel_ready(), timeout)
        self.stub = FrontendStub(self.channel)

    def watch(self, session_id: str, task_id: str, on_running: Optional[Callable[[], None]] = None) -> cf.Future:
        """The future of ``(state or None, output)``; cancelled (``cf.CancelledError`` from ``result``) when the
        watcher is closed before the task ends, or was closed already."""
        with self._lock:
            if not self._closing:
                return asyncio.run_coroutine_threadsafe(self._watch(session_id, task_id, on_running), self.loop)
        done = cf.Future()
        done.cancel()
        return done

    @staticmethod
    async def _cancel_watches() -> None:
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _watch(self, session_id: str, task_id: str, on_running) -> tuple[Optional[int], Optional[bytes]]:
        from flamepy.proto.frontend_pb2 import WatchTaskRequest

        call = self.stub.WatchTask(WatchTaskRequest(task_id=task_id, session_id=session_id))
        async for msg in call:
            state = int(msg.status.state)
            if state == RUNNING and on_running is not None:
                on_running()
            if state in TERMINAL:
                return state, (msg.spec.output if msg.spec.HasField("output") else None)
        return None, None

    def close(self) -> None:
        """Cancel the open watches, close the channel, stop and close the loop. Only the first call does it (a
        second, concurrent or later, returns at once); watches scheduled before it are cancelled by it."""
        with self._lock:
            first, self._closing = not self._closing, True
        if not first or self.loop.is_closed():
            return
        steps = [self._cancel_watches] + ([lambda: self.channel.close(grace=None)] if self.channel is not None else [])
        for step in steps if self._thread.is_alive() else []:
            try:  # each coroutine made only when it is scheduled: none is left never awaited
                asyncio.run_coroutine_threadsafe(step(), self.loop).result(5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
