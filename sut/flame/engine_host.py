"""The engine host: one engine (slot) behind one long-lived asyncio loop, for its own tasks and its forwarders'.

Algorithm
---------
``start`` opens the slot's Unix socket at once (forwarders wait on it), then builds the engine: the
prefix-caching guard (``sut.core.guard.check_settings``) first, then ``sut.engine.EngineHandle``
(the local transport's worker, kept in the service's process group so that Flame's unbind ends it
too) or the session's ``engine_factory`` (``sut.flame.service_config``). Every batch, from this
executor's tasks and from the forwarders', is decoded, its prompts are checked (length, vocabulary:
per-sample errors travel in the result), and **all its requests are submitted to the engine at once**
(asynchronous admission: the engine's continuous batching mixes the batches of every executor); the
answers come back as ``sut.messages.Completion`` records and are encoded in input order, each
with the engine's cached prompt tokens and its queued / first-token / done times.

A dead engine fails every waiting batch and, two seconds later, the process (forwarders must see the
host go). So does an engine that has answered nothing for ``engine_stall_s`` with requests outstanding (stopped or
hung): its process group is ended first (Flame v0.6.0 cannot cancel a running task, so a hung engine held its
session open and its services for good; found by a fault test with a SIGSTOPped engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from sut.core import guard
from sut.engine import EngineHandle, EngineSlot, read_model_info
from sut.errors import EngineError
from sut.flame import hostlink as hl
from sut.flame import payload as pl
from sut.flame.service_config import ServiceConfig, load_callable
from sut.messages import Completion, Request

log = logging.getLogger("sut.flame.service")


def build_engine(cfg: ServiceConfig, slot: EngineSlot):
    """The engine handle of ``slot``: the session's ``engine_factory``, else the local transport's worker."""
    if cfg.engine_factory:
        factory = load_callable(cfg.engine_factory)
        return factory(slot, cfg.engine, cfg.generation, gc_freeze=cfg.gc_freeze, detail=cfg.detail,
                       **cfg.engine_factory_args)
    return EngineHandle(slot, cfg.engine, cfg.generation, own_process_group=False, gc_freeze=cfg.gc_freeze,
                        detail=cfg.detail)


class EngineHost:
    """Owns one engine (slot) and one asyncio loop; serves local and forwarded batches."""

    def __init__(self, cfg: ServiceConfig, slot: EngineSlot, key: str, sock_path: Path, session_id: str):
        self.cfg, self.slot, self.key, self.sock_path, self.session_id = cfg, slot, key, sock_path, session_id
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="engine-host-loop", daemon=True)
        self._submit_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="engine-submit")
        self._futures: dict[int, asyncio.Future] = {}
        self._last_progress = time.monotonic()  # the last answer, or the start of work after an idle spell
        self._rid = itertools.count(1)
        self._last_rid = 0  # the engine host's latest request id (ids run 1.._last_rid)
        self._ready: Optional[asyncio.Event] = None
        self._fatal: Optional[str] = None
        self._stopping = False
        self._abort_start = False
        self._server = None
        self.handle = None
        self.info: dict = {}
        self.shard: dict = {}
        self.engine_gc: dict = {}
        self._stats_waiters: list[asyncio.Future] = []
        self.vocab_size = 0
        self.max_prompt_len = 0
        self.dataset = None

    # -- life cycle (called from a gRPC thread) --------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro, timeout: Optional[float] = None):
        """Run ``coro`` on the host's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> dict:
        """Open the socket at once (forwarders wait on it), then build the engine; blocks until ready."""
        self._loop_thread.start()
        self.call(self._open())
        try:
            info = self._start_engine()
        except BaseException as e:
            self._fatal = f"engine host {self.key} (pid {os.getpid()}) could not start its engine: {e}"
            self.loop.call_soon_threadsafe(self._ready.set)
            raise
        self.loop.call_soon_threadsafe(self._ready.set)
        self.loop.call_soon_threadsafe(self._watch_progress)
        return info

    async def _open(self) -> None:
        self._ready = asyncio.Event()
        try:
            self.sock_path.unlink()
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._serve_forwarder, path=str(self.sock_path))
        os.chmod(self.sock_path, 0o600)

    def _start_engine(self) -> dict:
        cfg = self.cfg
        guard.check_settings(cfg.engine.enable_prefix_caching, cfg.allow_prefix_caching)
        self.vocab_size = read_model_info(cfg.engine.model).vocab_size
        self.max_prompt_len = cfg.engine.max_model_len - cfg.generation.max_tokens
        if cfg.payload == "indices":
            self.dataset = _load_dataset(cfg, self.vocab_size)
        t0 = time.monotonic()
        handle = build_engine(cfg, self.slot)
        handle.start()
        self.handle = handle
        try:
            if self._abort_start:  # abort_start ran before the handle existed
                raise EngineError(f"engine start of slot {self.key} ended: the session closed")
            info = handle.wait_ready(cfg.engine_start_timeout_s)
        except BaseException:
            handle.shutdown()
            raise
        handle.watch(self._on_done, self._on_fatal, self._on_stats)
        self.info = info
        dev = info.get("device") or {}
        self.shard = {"key": self.key, "node": socket.gethostname(), "slot": self.slot.index, "replica": cfg.slot,
                      "kind": self.slot.kind, "device": self.slot.device, "gpu_uuid": dev.get("uuid"),
                      "device_name": dev.get("name"), "host_pid": os.getpid(), "engine_pid": info.get("pid"),
                      "session_id": self.session_id}
        log.info("engine ready in %.1f s: shard %s (replica %d) on %s -> %s (%s), engine pid %s, host pid %d",
                 time.monotonic() - t0, self.key, cfg.slot, self.shard["node"],
                 self.shard["gpu_uuid"] or f"{self.slot.kind}:{self.slot.device}", self.shard["device_name"],
                 info.get("pid"), os.getpid())
        return info

    def abort_start(self) -> None:
        """End an engine start in progress (its session closed); ``start`` then raises. Any thread; no-op once
        the engine is ready."""
        self._abort_start = True
        handle = self.handle
        if handle is not None and not self.info:
            handle.shutdown()

    def shutdown(self) -> None:
        self._stopping = True
        if self.handle is not None and not self._fatal:
            try:
                st = self.engine_stats(timeout=0.5)  # the group's SIGTERM may already have ended the worker
                if st:
                    log.info("engine %s: largest GC pause %.1f ms over %d collections", self.key,
                             st.get("max_pause_ms", 0.0), st.get("collections", 0))
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
            self.handle.shutdown()
        if self._server is not None:
            try:
                self.loop.call_soon_threadsafe(self._server.close)
            except RuntimeError:
                pass
        try:
            self.sock_path.unlink()
        except OSError:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._submit_pool.shutdown(wait=False)

    # -- engine callbacks (engine watcher thread) ------------------------------------------
    def _on_done(self, _engine: int, results: list[Completion]) -> None:
        self.loop.call_soon_threadsafe(self._resolve, results)

    def _watch_progress(self) -> None:
        """On the loop, every ``engine_stall_s / 4`` (at most 5 s): end an engine that has answered nothing for
        ``engine_stall_s`` with requests outstanding (``_end_hung_engine``, in a thread of its own)."""
        stall = self.cfg.engine_stall_s
        if self._fatal or self._stopping:
            return
        if self._futures and time.monotonic() - self._last_progress > stall:
            threading.Thread(target=self._end_hung_engine, args=(len(self._futures),), daemon=True).start()
            return
        self.loop.call_later(min(5.0, stall / 4), self._watch_progress)

    def _end_hung_engine(self, outstanding: int) -> None:
        why = (f"it answered nothing for {self.cfg.engine_stall_s:.0f} s with {outstanding} request(s) outstanding "
               f"(stopped or hung; flame option engine_stall_s): its process group was ended")
        log.error("engine %s: %s", self.key, why)
        self._end_engine(why, "died")  # a stopped group at once; a hung one after 2 s, then SIGTERM, SIGKILL

    def _resolve(self, results: list[Completion]) -> None:
        self._last_progress = time.monotonic()
        for c in results:
            fut = self._futures.pop(int(c.rid), None)
            if fut is None:
                self._stray_answer(int(c.rid))
                return
            if not fut.done():
                fut.set_result(c)

    def _stray_answer(self, rid: int) -> None:
        """On the loop: the engine answered request ``rid`` (the engine host's id), which no batch waits for: answered
        twice, or never submitted. Such an engine cannot be trusted with any answer (one request answered twice
        leaves another unanswered: the run failed only at its stall limit), so its process group is ended and every
        waiting batch fails at once, naming the request (``_on_fatal``). Ignored after a failure or during the stop:
        nothing waits for answers then."""
        if self._fatal or self._stopping:
            return
        what = (f"answered request {rid} twice" if 0 < rid <= self._last_rid else
                f"answered request {rid}, which was never submitted to it (the engine host's requests run "
                f"1..{self._last_rid})")
        why = f"{what}; an engine answers each request once: its process group was ended"
        self._fatal = self._fatal_message(why, "failed")  # new batches fail at once; later strays are ignored
        log.error("engine %s: %s", self.key, why)
        threading.Thread(target=self._end_engine, args=(why, "failed"), daemon=True).start()

    def _end_engine(self, why: str, verb: str) -> None:
        """End the engine's process group (a stopped one at once, a hung one within seconds), then fail as
        ``_on_fatal``. Blocks: its own thread."""
        self.handle.shutdown(timeout=2.0)
        self._on_fatal(why, verb)

    def _fatal_message(self, message: str, verb: str = "died") -> str:
        return f"engine {self.key} on {socket.gethostname()} {verb}: {message}"

    def _on_fatal(self, message: str, verb: str = "died") -> None:
        """The engine died (``verb`` "died": the handle's ``on_fatal``) or was ended: fail every waiting batch and,
        2 s later, this process."""
        if self._stopping:
            return
        self._fatal = self._fatal_message(message, verb)
        log.error("%s", self._fatal)
        self.loop.call_soon_threadsafe(self._fail_all)
        # Later tasks must fail fast, and forwarders must see the host go: leave shortly.
        threading.Timer(2.0, lambda: os._exit(1)).start()

    def _fail_all(self) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(EngineError(self._fatal))
        self._futures.clear()

    def _on_stats(self, stats: dict) -> None:
        def deliver():
            self.engine_gc = stats
            waiters, self._stats_waiters = self._stats_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(stats)
        self.loop.call_soon_threadsafe(deliver)

    def engine_stats(self, timeout: float = 5.0) -> dict:
        async def ask():
            fut = self.loop.create_future()
            self._stats_waiters.append(fut)
            self.handle.request_stats()
            return await asyncio.wait_for(fut, timeout)
        return self.call(ask(), timeout + 1.0)

    # -- the async engine ------------------------------------------------------------------
    async def generate(self, prompts: list[np.ndarray], asked: Optional[list] = None) -> list[Completion]:
        """Submit all prompts at once; their ``Completion``s in input order (request ids are the host's own).
        ``asked``: each prompt's own output length (``Request.max_tokens``; 0 = the session's)."""
        if self._fatal:
            raise EngineError(self._fatal)
        if not prompts:
            return []
        batch, futs = [], []
        if not self._futures:  # work starts after an idle spell: the stall clock starts now
            self._last_progress = time.monotonic()
        for i, p in enumerate(prompts):
            rid = self._last_rid = next(self._rid)
            fut = self.loop.create_future()
            self._futures[rid] = fut
            futs.append(fut)
            batch.append(Request(rid, np.asarray(p, dtype=np.int32), -1, int(asked[i]) if asked else 0))
        try:
            await self.loop.run_in_executor(self._submit_pool, self.handle.submit, batch)
        except Exception:
            for req in batch:
                self._futures.pop(req.rid, None)
            raise
        return list(await asyncio.gather(*futs))

    async def handle_task(self, data: bytes, ident: dict) -> bytes:
        """Decode a task, run it, encode the result (in input order)."""
        t_recv = ident.get("t_recv", time.time())
        task = pl.decode_task(data)
        if task.kind == pl.KIND_PING:
            hold = float(task.meta.get("hold_ms", 0.0)) / 1000.0
            if hold > 0:
                await asyncio.sleep(min(hold, 5.0))  # keeps one executor from answering every warm-up ping
            meta = {"executor": ident, "shard": self.shard, "engine": self.info, "engine_gc": self.engine_gc}
            return pl.encode_result(task.batch_id, [], meta=meta).data
        prompts, errors = self._resolve_prompts(task)
        valid = [i for i in range(len(task)) if errors[i] is None]
        asked = task.meta.get("max_tokens")  # per-request output lengths (the batcher's meta), else None
        t0 = time.monotonic()
        outs = await self.generate([prompts[i] for i in valid], [asked[i] for i in valid] if asked else None)
        engine_s = time.monotonic() - t0
        by_pos = dict(zip(valid, outs))
        samples = []
        for i in range(len(task)):
            rid = int(task.request_ids[i])
            c = by_pos.get(i)
            if c is None:
                samples.append(pl.SampleResult(rid, False, error=errors[i]))
            else:
                samples.append(pl.SampleResult(rid, True, token_ids=c.token_ids, cached_tokens=c.cached_tokens,
                                               t_queued=c.t_queued, t_first=c.t_first, t_done=c.t_done))
        meta = {"executor": ident, "shard": self.shard["key"], "node": self.shard["node"], "replica": self.cfg.slot,
                "engine_gc_max_pause_ms": self.engine_gc.get("max_pause_ms"),
                "t": {"recv": t_recv, "engine_s": round(engine_s, 6), "service_s": round(time.time() - t_recv, 6)}}
        out = pl.encode_result(task.batch_id, samples, meta=meta, compress=self.cfg.compress).data
        self.loop.run_in_executor(self._submit_pool, self._ask_stats)  # refreshes engine_gc for later results
        return out

    def _ask_stats(self) -> None:
        try:
            self.handle.request_stats()
        except Exception:  # noqa: BLE001 - statistics only
            pass

    def _resolve_prompts(self, task: pl.TaskInput) -> tuple[list, list]:
        """``(prompts, errors)`` per sample: a prompt, or the text of why the engine cannot take it."""
        n = len(task)
        prompts: list = [None] * n
        errors: list = [None] * n
        if task.indices is not None:
            if self.dataset is None:
                raise pl.PayloadError("task carries dataset indices, but this session uses payload=tokens")
            for i, q in enumerate(task.indices):
                if int(q) >= len(self.dataset):
                    errors[i] = f"dataset index {int(q)} out of range (the service's dataset has {len(self.dataset)} samples)"
                else:
                    prompts[i] = self.dataset.prompts[int(q)]
        else:
            prompts = list(task.prompts)
        for i, p in enumerate(prompts):
            if errors[i] is None:
                errors[i] = self._prompt_error(p)
        return prompts, errors

    def _prompt_error(self, p: np.ndarray) -> Optional[str]:
        if len(p) == 0:
            return "empty prompt"
        if len(p) > self.max_prompt_len:
            return f"prompt has {len(p)} tokens, more than max_model_len - max_tokens = {self.max_prompt_len}"
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= self.vocab_size:
            return f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})"
        return None

    # -- forwarders --------------------------------------------------------------------------
    async def _serve_forwarder(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ftype, body = await hl.arecv_frame(reader)
            if ftype != hl.F_HELLO:
                return
            hello = json.loads(body)
            await self._ready.wait()
            if self._fatal:
                hl.asend_frame(writer, hl.F_ERR, self._fatal.encode())
                return
            if hello.get("session_id") != self.session_id or hello.get("digest") != self.cfg.digest:
                hl.asend_frame(writer, hl.F_ERR, json.dumps({"mismatch": True, "session_id": self.session_id}).encode())
                return
            hl.asend_frame(writer, hl.F_OK, json.dumps({"shard": self.shard, "engine": self.info}).encode())
            log.info("forwarder pid %s (seat %s) attached to shard %s", hello.get("pid"), hello.get("seat"), self.key)
            await self._relay(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            return
        finally:
            try:
                await writer.drain()
            except Exception:  # noqa: BLE001
                pass
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one forwarder's tasks until it hangs up."""
        while True:
            try:
                ftype, body = await hl.arecv_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if ftype != hl.F_TASK:
                return
            ident, data = hl.unpack_task(body)
            try:
                hl.asend_frame(writer, hl.F_OK, await self.handle_task(data, ident))
            except Exception as e:  # noqa: BLE001 - the forwarder fails its task with this text
                hl.asend_frame(writer, hl.F_ERR, f"{type(e).__name__}: {e}".encode())
            await writer.drain()


def _load_dataset(cfg: ServiceConfig, vocab_size: int):
    from sut.data.dataset import load_dataset

    ds = cfg.dataset or {}
    if not ds.get("path"):
        raise ValueError("payload=indices needs the dataset path in the session's common data")
    dataset = load_dataset(ds["path"], vocab_size, cfg.engine.max_model_len, ds.get("max_samples"),
                           reserve=cfg.generation.max_tokens)
    if ds.get("sha256") and dataset.sha256 != ds["sha256"]:
        raise ValueError(f"the service's copy of {ds['path']} has sha256 {dataset.sha256[:12]}..., the client's "
                         f"{ds['sha256'][:12]}...; payload=indices needs the same file on both sides")
    return dataset
