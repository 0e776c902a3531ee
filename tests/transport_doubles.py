"""Test doubles of the dispatch core (never imported by the product).

``FakeTransport``: a ``sut.core.transport.Transport`` without engines. Each replica is one worker
thread that answers every submitted request after ``step_s`` seconds with ``out_len`` generated ids
(deterministic: ``(prompt[0] + k) % 1000 + 10`` for k = 0..out_len-1; an answer shorter than ``max_tokens`` ends
in the first EOS id of the generation settings instead, as an engine's does, unless they ignore EOS or have none),
``cached_tokens`` from a
per-replica set of seen prompt prefixes (the first ``cache_block`` tokens), and monotonic timestamps.
A request's own ``max_tokens`` (``Request.max_tokens`` > 0) replaces ``out_len`` (``per_request_max_tokens``).
``kill_replica(r)`` (the replica-loss workload's kill): replica r stops at once, drops what it holds and
reports a ``FatalEvent`` (``silent_kill``: reports nothing; ``halt_on_kill``: every replica stops answering
and submits are refused, as a transport that halts on any fatal event).
Faults: ``die_after`` (replica -> number of completions after which it reports a ``FatalEvent``),
``duplicate`` (answer a request twice), ``wrong_replica`` (report a completion as another
replica's), ``short_output`` (rid -> length), ``answers`` (rid -> the generated ids to answer instead). ``starts`` counts ``start`` calls across instances
sharing one ``log`` list (pair-protocol tests check fresh starts). What the replicas report about
themselves: ``prefix_caching_on``, or a whole read-back record (``engine_info``, e.g. one that
``sut.engine.readback.read_back`` made from vLLM's own config objects).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sut.core.transport import Transport, TransportSpec, register_transport
from sut.errors import TransportError
from sut.messages import Completion, FirstToken, ReplicaRecord


@dataclass(frozen=True)
class FakeOptions:
    replicas: int = 2
    step_s: float = 0.001
    out_len: int = 4
    cache_block: int = 16
    dispatch_chunk: int = 512
    allow_prefix_caching: bool = False
    prefix_caching_on: bool = False  # what the fake engines report
    engine_info: Optional[dict] = field(default=None, hash=False, compare=False)  # a read-back record to report instead
    die_after: Optional[dict] = None
    duplicate: Optional[int] = None
    wrong_replica: Optional[int] = None
    short_output: Optional[dict] = None
    answers: Optional[dict] = None
    silent_kill: bool = False
    halt_on_kill: bool = False
    kv_tokens: Optional[int] = None  # the KV cache every replica reports (kv_cache.tokens)
    kv_bytes_per_block: Optional[int] = None  # and its bytes per block (kv_cache.bytes_per_block)
    kv_ignore_override: bool = False  # report kv_tokens' blocks even when the engine settings fix other blocks
    engines: Optional[list] = field(default=None, hash=False, compare=False)  # gets each start's EngineSettings
    log: Optional[list] = field(default=None, hash=False, compare=False)


@register_transport("fake")
class FakeTransport(Transport):
    options_cls = FakeOptions
    per_request_max_tokens = True

    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.o: FakeOptions = spec.options or FakeOptions()
        self._queues = [queue.SimpleQueue() for _ in range(self.o.replicas)]
        self._threads: list[threading.Thread] = []
        self._seen = [set() for _ in range(self.o.replicas)]
        self._done = [0] * self.o.replicas
        self._dead = [False] * self.o.replicas
        self.stopped = False

    @property
    def replicas(self) -> int:
        return self.o.replicas

    def start(self, sink):
        if self.o.log is not None:
            self.o.log.append(("start", id(self)))
        self.sink = sink
        for r in range(self.o.replicas):
            th = threading.Thread(target=self._loop, args=(r,), daemon=True, name=f"fake-replica-{r}")
            th.start()
            self._threads.append(th)
        es = self.spec.engine
        if self.o.engines is not None:
            self.o.engines.append(es)
        fixed = getattr(es, "num_gpu_blocks_override", None)  # some tests give a bare namespace as the settings
        blocks = fixed if fixed and not self.o.kv_ignore_override else (self.o.kv_tokens or 0) // 16
        kv = {"kv_cache": {"tokens": blocks * 16, "blocks": blocks, "block_size": 16,
                           "bytes_per_block": self.o.kv_bytes_per_block}} if self.o.kv_tokens else {}
        own = [{"engine": r, "enable_prefix_caching": self.o.prefix_caching_on,
                "device": {"kind": "fake", "name": "fake", "uuid": f"FAKE-{r}"}, **kv} for r in range(self.o.replicas)]
        self.records = [ReplicaRecord(r, own[r] if self.o.engine_info is None else dict(self.o.engine_info, engine=r))
                        for r in range(self.o.replicas)]
        return self.records

    def submit(self, replica, requests):
        if self._dead[replica] or self.stopped:
            raise TransportError(f"fake replica {replica} is gone")
        self._queues[replica].put(list(requests))

    def kill_replica(self, replica: int) -> None:
        """The replica-loss workload's kill (module docstring)."""
        dead = range(self.o.replicas) if self.o.halt_on_kill else [replica]
        for r in dead:
            self._dead[r] = True
        if self.o.log is not None:
            self.o.log.append(("kill", replica))
        if not self.o.silent_kill:
            self._report_fatal(replica, f"fake replica {replica} was killed")

    def _answer(self, r: int, req) -> Completion:
        t0 = time.monotonic()
        key = bytes(np.asarray(req.prompt[: self.o.cache_block], dtype=np.int32))
        cached = self.o.cache_block if (key in self._seen[r] and len(req.prompt) >= self.o.cache_block) else 0
        self._seen[r].add(key)
        n = (self.o.short_output or {}).get(req.rid, req.max_tokens or self.o.out_len)
        ids = ((int(req.prompt[0]) + np.arange(n)) % 1000 + 10).astype(np.int32)
        gen = self.spec.generation
        if gen is not None and 0 < n < gen.max_tokens and gen.eos_token_ids and not gen.ignore_eos:
            ids[-1] = gen.eos_token_ids[0]
        if req.rid in (self.o.answers or {}):
            ids = np.asarray(self.o.answers[req.rid], dtype=np.int32)
        return Completion(req.rid, ids, cached, t0, t0, time.monotonic())

    def _loop(self, r: int) -> None:
        while True:
            batch = self._queues[r].get()
            if batch is None:
                return
            for req in batch:
                time.sleep(self.o.step_s)
                if self._dead[r]:  # killed: what it held is lost
                    break
                limit = (self.o.die_after or {}).get(r)
                if limit is not None and self._done[r] >= limit:
                    self._dead[r] = True
                    self._report_fatal(r, f"fake replica {r} died")
                    return
                c = self._answer(r, req)
                if self.spec.stream:
                    self.sink.on_first(r, [FirstToken(req.rid, int(c.token_ids[0]))])
                rep = (r + 1) % self.o.replicas if req.rid == self.o.wrong_replica else r
                self.sink.on_results(rep, [c])
                if req.rid == self.o.duplicate:
                    self.sink.on_results(r, [c])
                self._done[r] += 1

    def stats(self):
        return {"fake": {"answered": list(self._done)}}

    def stop(self):
        if not self._mark_stopped():  # a replica dying from now on is no failure (_report_fatal is quiet)
            return
        self.stopped = True
        if self.o.log is not None:
            self.o.log.append(("stop", id(self)))
        for q in self._queues:
            q.put(None)
        for th in self._threads:
            th.join(5)
