"""Engine-free replicas: the ``sim`` transport of the harness's own measurements (``python -m sut
bench-harness``: ``sut.run.bench_harness``; ``scripts/bench/bench_routing.py`` at fleet scale).

``SimTransport`` is a ``sut.core.transport.Transport`` whose replicas run no model. ``replicas``
replicas are spread over ``nodes`` emulated nodes in contiguous blocks (replica ``r`` on node
``r * nodes // replicas``, the way GPUs sit in hosts); each node is one thread that delivers the
results of all its replicas, as one host's client loop would. Two modes:

* ``instant``: every submitted chunk is answered at once, in one ``on_results`` call (and one
  ``on_first`` call before it when streaming): the harness's own cost per sample, nothing else.
* ``step``: every replica emulates a continuous-batching engine, one step per ``tick()``: each running
  sequence decodes one token; finished sequences leave; the rest of ``step_tokens`` (vLLM's
  ``max_num_batched_tokens``, 8,192) goes to chunked prefill of waiting requests in arrival order while
  fewer than ``max_seqs`` sequences run. A request whose prefill completes yields its first token in that
  step and finishes ``out_len - 1`` steps later. Each step's first tokens and completions of a replica
  go out as one ``on_first`` and one ``on_results`` call (engine-step-sized batches). Ticks are
  lock-step: ``tick()`` returns once every node has stepped all its replicas, so the routing decisions,
  and therefore the balance figures, do not depend on thread timing. The caller ticks (``tick_s`` 0), or
  the transport's own ticker thread does, every ``tick_s`` seconds of wall time (a real-time engine for
  LoadGen; a tick that comes late is not made up for).

Answers: ``answer_len`` generated ids (``out_len`` when 0), all below any EOS id; the first token is the
first of them.

Work (tokens): a request costs ``prefill + out_len - 1`` tokens, ``prefill`` = prompt length less the
prefix the replica already holds (``cache_docs``: a per-replica set of the documents it has seen, blocks
of ``CACHE_BLOCK`` tokens; at least one token is always computed). ``outstanding_tokens()`` = work
submitted minus work done, per replica (read between ticks, it is exact).

CPU accounting: ``sim_cpu_s()`` is the CPU time the simulated replicas used (node threads outside the
sink calls, the ticker thread, and the work bookkeeping in ``submit``), so a caller can take it off the
process's CPU time to get the harness's own.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from sut.core.transport import Transport, TransportSpec, register_transport
from sut.errors import TransportError
from sut.messages import Completion, FirstToken, ReplicaRecord

MODES = ("instant", "step")
#: vLLM's KV-cache block size (tokens): a cached prefix is reused in whole blocks.
CACHE_BLOCK = 16
_TICK = object()


@dataclass(frozen=True)
class SimOptions:
    """Shape of the simulated fleet (module docstring). ``doc_of`` / ``prefix_tokens``: per QSL index,
    the document whose prefix the prompt carries (-1: none) and that prefix's length in tokens (used
    when ``cache_docs``). ``tick_s``: seconds between the ticker thread's ticks (step mode; 0: the caller
    ticks). ``answer_len``: generated ids per answer (0: ``out_len``)."""

    replicas: int = 64
    nodes: int = 8
    mode: str = "instant"
    step_tokens: int = 8192
    max_seqs: int = 64
    out_len: int = 128
    cache_docs: bool = False
    doc_of: Optional[np.ndarray] = None
    prefix_tokens: Optional[np.ndarray] = None
    tick_s: float = 0.0
    answer_len: int = 0

    def __post_init__(self):
        if not 1 <= self.nodes <= self.replicas:
            raise ValueError(f"nodes must be in [1, replicas={self.replicas}], got {self.nodes}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.step_tokens < 1 or self.max_seqs < 1 or self.out_len < 2:
            raise ValueError("step_tokens >= 1, max_seqs >= 1 and out_len >= 2 are required")
        if self.cache_docs and (self.doc_of is None or self.prefix_tokens is None):
            raise ValueError("cache_docs needs doc_of and prefix_tokens")
        if self.tick_s < 0 or self.answer_len < 0:
            raise ValueError("tick_s >= 0 and answer_len >= 0 are required")


class _Replica:
    """One emulated engine (step mode): ``waiting`` [prefill tokens left, rid]; ``running`` (finish tick, rid)."""

    __slots__ = ("waiting", "running")

    def __init__(self):
        self.waiting: collections.deque = collections.deque()
        self.running: collections.deque = collections.deque()

    def step(self, t: int, o: SimOptions) -> tuple[int, list, list]:
        """One engine step at tick ``t``: ``(tokens of work done, rids with a first token, rids finished)``."""
        running, waiting = self.running, self.waiting
        used = len(running)  # one decode token per running sequence, the finishing ones included
        done = []
        while running and running[0][0] <= t:
            done.append(running.popleft()[1])
        budget, firsts = o.step_tokens - used, []
        while waiting and budget > 0 and len(running) < o.max_seqs:
            item = waiting[0]
            take = min(item[0], budget)
            item[0] -= take
            budget -= take
            used += take
            if item[0] == 0:
                waiting.popleft()
                firsts.append(item[1])
                running.append((t + o.out_len - 1, item[1]))
        return used, firsts, done


@register_transport("sim")
class SimTransport(Transport):
    """Engine-free replicas over emulated nodes (module docstring). Options: ``SimOptions``."""

    options_cls = SimOptions

    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.o: SimOptions = spec.options or SimOptions()
        n, k = self.o.replicas, self.o.nodes
        self.node_of = [r * k // n for r in range(n)]
        self._members = [[r for r in range(n) if self.node_of[r] == j] for j in range(k)]
        self._inbox = [queue.SimpleQueue() for _ in range(k)]
        self._engines = [_Replica() for _ in range(n)]
        self._seen: list[set] = [set() for _ in range(n)]
        self.submitted = [0] * n  # tokens of work handed to each replica
        self.consumed = [0] * n  # tokens of work each replica has done
        self._node_cpu = [0.0] * k  # node threads' CPU seconds outside the sink calls
        self._submit_cpu = 0.0
        self._ticker_cpu = 0.0
        self._barrier = threading.Barrier(k + 1)
        self._threads: list[threading.Thread] = []
        self.t = 0  # ticks so far
        ids = np.arange(self.o.answer_len or self.o.out_len, dtype=np.int32) % 1000 + 10  # below any EOS id
        self._ids, self._first_id = ids, int(ids[0])

    @property
    def replicas(self) -> int:
        return self.o.replicas

    def start(self, sink):
        self.sink = sink
        for j in range(self.o.nodes):
            th = threading.Thread(target=self._node_loop, args=(j,), daemon=True, name=f"sim-node-{j}")
            th.start()
            self._threads.append(th)
        if self.o.mode == "step" and self.o.tick_s > 0:
            th = threading.Thread(target=self._ticker, daemon=True, name="sim-ticker")
            th.start()
            self._threads.append(th)
        self.records = [ReplicaRecord(r, {"engine": r, "node": f"node-{self.node_of[r]:02d}",
                                          "enable_prefix_caching": False,
                                          "device": {"kind": "sim", "name": "sim", "uuid": f"SIM-{r:04d}"}})
                        for r in range(self.o.replicas)]
        return self.records

    def submit(self, replica: int, requests: Sequence) -> None:
        if self._stopped:
            raise TransportError(f"sim replica {replica} is gone (transport stopped)")
        c0 = time.thread_time()
        o, seen, base = self.o, self._seen[replica], self.o.out_len - 1
        items, work = [], 0
        for req in requests:
            prefill = len(req.prompt)
            if o.cache_docs:
                doc = int(o.doc_of[req.index])
                if doc >= 0:
                    if doc in seen:
                        prefill = max(1, prefill - int(o.prefix_tokens[req.index]) // CACHE_BLOCK * CACHE_BLOCK)
                    seen.add(doc)
            items.append([prefill, req.rid])
            work += prefill + base
        self.submitted[replica] += work
        self._submit_cpu += time.thread_time() - c0
        self._inbox[self.node_of[replica]].put((replica, items))

    def tick(self) -> None:
        """Every replica does one engine step (step mode; instant mode: a sync point). Blocks until all did."""
        self.t += 1
        for q in self._inbox:
            q.put(_TICK)
        self._barrier.wait()

    def outstanding_tokens(self) -> list[int]:
        """Per replica, tokens of work submitted and not done yet (exact between ticks)."""
        return [s - c for s, c in zip(self.submitted, self.consumed)]

    def sim_cpu_s(self) -> float:
        """CPU seconds the simulated replicas used so far (exact after a ``tick()``)."""
        return sum(self._node_cpu) + self._submit_cpu + self._ticker_cpu

    def _ticker(self) -> None:
        """Tick every ``tick_s`` seconds until ``stop`` (a late tick moves the schedule, no burst after it)."""
        c0, due = time.thread_time(), time.monotonic()
        while not self._stopped:
            due += self.o.tick_s
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                due = time.monotonic()
            try:
                self.tick()
            except threading.BrokenBarrierError:
                return
            self._ticker_cpu = time.thread_time() - c0

    # -- node threads --------------------------------------------------------------------------
    def _node_loop(self, j: int) -> None:
        inbox, step = self._inbox[j], self.o.mode == "step"
        c0, in_sink = time.thread_time(), 0.0
        while True:
            msg = inbox.get()
            if msg is None:
                return
            if msg is _TICK:
                if step:
                    in_sink += self._step_node(j)
                self._node_cpu[j] = time.thread_time() - c0 - in_sink
                try:
                    self._barrier.wait()
                except threading.BrokenBarrierError:
                    return
                continue
            r, items = msg
            if step:
                self._engines[r].waiting.extend(items)
            else:
                self.consumed[r] += sum(p for p, _ in items) + len(items) * (self.o.out_len - 1)
                in_sink += self._deliver(r, [rid for _, rid in items], [rid for _, rid in items])

    def _step_node(self, j: int) -> float:
        """One engine step of every replica of node ``j``; returns the CPU seconds spent in the sink."""
        in_sink = 0.0
        for r in self._members[j]:
            used, firsts, done = self._engines[r].step(self.t, self.o)
            self.consumed[r] += used
            if firsts or done:
                in_sink += self._deliver(r, firsts, done)
        return in_sink

    def _deliver(self, r: int, firsts: list, done: list) -> float:
        """Send one step's first tokens (when streaming) and completions of replica ``r``; returns the CPU
        seconds the sink took."""
        ids, first = self._ids, self._first_id
        fs = [FirstToken(rid, first) for rid in firsts] if self.spec.stream and firsts else None
        cs = [Completion(rid, ids) for rid in done] if done else None
        c0 = time.thread_time()
        if fs:
            self.sink.on_first(r, fs)
        if cs:
            self.sink.on_results(r, cs)
        return time.thread_time() - c0

    def stop(self) -> None:
        if not self._mark_stopped():
            return
        for q in self._inbox:
            q.put(None)
        self._barrier.abort()
        for th in self._threads:
            th.join(5)
