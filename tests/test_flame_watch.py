"""sut/flame/watch.py: the one-loop WatchTask watcher against a real gRPC server (flamepy 0.6.0's Frontend service,
its WatchTask never answering): closing it with watches open cancels them, leaves no pending task on its loop
("Task was destroyed but it is pending!"), and a watch asked for after the close is cancelled at once."""

import concurrent.futures as cf
import gc
import logging
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")
frontend_grpc = pytest.importorskip("flamepy.proto.frontend_pb2_grpc")


class _SilentFrontend(frontend_grpc.FrontendServicer):
    """WatchTask streams that send nothing until the test ends (a task that stays Running)."""

    def __init__(self):
        self.release, self.opened = threading.Event(), threading.Semaphore(0)

    def WatchTask(self, request, context):  # noqa: N802 - the RPC's name
        self.opened.release()
        self.release.wait(30)
        return iter(())


@pytest.fixture
def frontend():
    servicer = _SilentFrontend()
    server = grpc.server(cf.ThreadPoolExecutor(8))
    frontend_grpc.add_FrontendServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", servicer
    servicer.release.set()
    server.stop(None)


@pytest.mark.timeout(60)
def test_close_cancels_open_watches_and_leaves_no_pending_task(frontend, caplog):
    from sut.flame.watch import AioWatcher

    endpoint, servicer = frontend
    w = AioWatcher(endpoint)
    futures = [w.watch("s1", str(i)) for i in range(3)]
    for _ in futures:
        assert servicer.opened.acquire(timeout=10)  # every stream is open on the server
    assert not any(f.done() for f in futures)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        w.close()
        gc.collect()
    assert all(f.cancelled() for f in futures)
    for f in futures:
        with pytest.raises(cf.CancelledError):
            f.result(0)
    assert w.loop.is_closed() and not w._thread.is_alive()
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
    late = w.watch("s1", "9")
    assert late.cancelled()


@pytest.mark.timeout(60)
def test_a_session_watching_through_a_closed_watcher_reads_cancelled(frontend):
    """The tracker thread blocked on a watch wakes when the transport closes the watcher, with the task read as
    cancelled (its session was closed), not as an error that is retried."""
    from sut.flame.session import _ST_CANCELLED, ReplicaSession
    from sut.flame.watch import AioWatcher

    endpoint, servicer = frontend
    w = AioWatcher(endpoint)
    rs = ReplicaSession.__new__(ReplicaSession)
    rs.watcher, rs.session = w, type("Session", (), {"id": "s1"})()
    with cf.ThreadPoolExecutor(1) as pool:
        got = pool.submit(rs._watch_once, "t1", None)
        assert servicer.opened.acquire(timeout=10)
        t0 = time.monotonic()
        w.close()
        assert got.result(10) == (_ST_CANCELLED, None) and time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_closes_at_once_and_watches_during_the_close_all_end(frontend):
    """Two threads closing together: one does the work, neither raises; watches asked for while it closes are
    either scheduled before it (then cancelled by it) or refused: every future ends."""
    from sut.flame.watch import AioWatcher

    endpoint, _ = frontend
    for _ in range(5):
        w = AioWatcher(endpoint)
        futures, stop = [], threading.Event()

        def keep_watching():
            while not stop.is_set():
                futures.append(w.watch("s", "t"))
                time.sleep(0.0005)

        with cf.ThreadPoolExecutor(4) as pool:
            watchers = [pool.submit(keep_watching) for _ in range(2)]
            time.sleep(0.05)
            closers = [pool.submit(w.close) for _ in range(2)]
            for c in closers:
                c.result(20)
            stop.set()
            for x in watchers:
                x.result(10)
        assert futures and all(f.done() for f in futures)
        assert w.loop.is_closed()
