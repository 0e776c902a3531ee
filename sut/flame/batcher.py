"""The batcher of one replica: requests -> batches of ``batch_size`` -> Flame tasks, under credits.

``put`` only appends to the replica's inbox; it never blocks. The batcher's thread cuts the inbox
into batches of ``batch_size`` (a partial batch waits at most ``batch_window_ms`` for more arrivals,
or until ``flush``), encodes each (``sut.flame.payload``: prompt tokens, or QSL indices with
``payload=indices``; zlib unless ``compress`` is off), waits for a credit (at most
``inflight_per_executor`` tasks per executor of the replica are in flight: Flame has no
back-pressure) and hands it to the replica's ``TaskTracker``. Once the transport is halted (stopping
or failed) requests are dropped: the ledger has answered them already.

``check_fits`` refuses, before any session exists, a batch size whose worst case (the dataset's
longest prompts) cannot fit one Flame message.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np

from sut.errors import RunFailed
from sut.flame import payload as pl
from sut.flame.options import FlameOptions
from sut.flame.stats import FlameStats
from sut.flame.tasks import Batch, TaskTracker

log = logging.getLogger("sut.flame.transport")


def check_fits(prompts: Sequence[np.ndarray], o: FlameOptions, max_tokens: int) -> None:
    """``RunFailed`` when ``o.batch_size`` of the longest ``prompts`` would not fit one Flame task message."""
    longest = sorted(prompts, key=len, reverse=True)[: o.batch_size]
    if not longest:
        return
    ids = list(range(len(longest)))
    try:
        if o.payload == "indices":
            pl.encode_task(0, ids, indices=ids, max_tokens=max_tokens, compress=o.compress)
        else:
            pl.encode_task(0, ids, prompts=longest, max_tokens=max_tokens, compress=o.compress)
    except pl.PayloadTooLarge as e:
        raise RunFailed(f"batch_size {o.batch_size} cannot work with this dataset: {e}") from None


class Batcher:
    """Batches of one replica (see the module docstring); ``owner`` provides ``halted`` and ``fatal``."""

    def __init__(self, tracker: TaskTracker, o: FlameOptions, max_tokens: int, credits: int, stats: FlameStats, owner):
        self.tracker, self.o, self.max_tokens, self.credits = tracker, o, max_tokens, credits
        self.stats, self.owner, self.replica = stats, owner, tracker.replica
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._flush = False
        self._closing = False
        self._inflight = 0
        self._next_batch = 0
        self._thread = threading.Thread(target=self._loop, name=f"flame-batcher-{self.replica}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, requests: Sequence) -> None:
        with self._cv:
            self._inbox.extend(requests)
            self._cv.notify_all()

    def flush(self) -> None:
        with self._cv:
            self._flush = True
            self._cv.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """No batch after this; waits for the thread (not for tasks in flight)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def release(self, _tb: Optional[Batch] = None) -> None:
        """A batch's task thread ended: its credit is free again."""
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()
        self.stats.inflight_change(-1)

    def next_items(self) -> Optional[list]:
        """The next batch: ``batch_size`` requests, or fewer after the window / a flush. None = closing."""
        window = self.o.batch_window_ms / 1000.0
        with self._cv:
            while not self._inbox and not self._closing:
                self._cv.wait()
            if self._closing:
                return None
            t_first = time.monotonic()
            while len(self._inbox) < self.o.batch_size and not self._flush and not self._closing:
                left = window - (time.monotonic() - t_first)
                if left <= 0:
                    break
                self._cv.wait(left)
            items = [self._inbox.popleft() for _ in range(min(self.o.batch_size, len(self._inbox)))]
            if not self._inbox:
                self._flush = False
            return items

    def _encode(self, bid: int, items: list) -> Optional[Batch]:
        rids = [r.rid for r in items]
        asked = [int(r.max_tokens) if len(r) > 3 else 0 for r in items]  # per-request lengths travel in the meta
        meta = {"max_tokens": asked} if any(asked) else None
        try:
            if self.o.payload == "indices":
                enc = pl.encode_task(bid, rids, indices=[r.index for r in items], meta=meta,
                                     max_tokens=self.max_tokens, compress=self.o.compress)
            else:
                enc = pl.encode_task(bid, rids, prompts=[r.prompt for r in items], meta=meta,
                                     max_tokens=self.max_tokens, compress=self.o.compress)
        except pl.PayloadError as e:
            self.owner.fatal(self.replica, f"cannot build the Flame task of batch {bid} (replica {self.replica}): {e}")
            return None
        return Batch(bid, items, enc.data, enc.raw_bytes)

    def _take_credit(self) -> bool:
        with self._cv:
            while self._inflight >= self.credits and not self._closing:
                self._cv.wait()
            if self._closing or self.owner.halted:
                return False
            self._inflight += 1
        self.stats.inflight_change(+1)
        return True

    def _loop(self) -> None:
        while True:
            items = self.next_items()
            if items is None:
                return
            if self.owner.halted:
                continue  # the run has failed; the ledger already answered these requests
            tb = self._encode(self._next_batch, items)
            self._next_batch += 1
            if tb is None or not self._take_credit():
                continue
            self.stats.note_batch(self.replica, tb.batch_id, len(items))
            if not self.tracker.launch(tb):
                self.release(tb)
