"""The Flame service of the Flame-batched SUT: vLLM behind Flame executors, several per engine.

Algorithm
---------
Flame 0.6 runs one task at a time per executor, and one service process per executor binding
(../shared/research/flame.md §1.2, §1.6). One executor with a task of 32 samples would leave an
engine nearly idle, so several executors share one engine:

* Every executor runs this same program (``python -m sut.flame.serve``). In
  ``on_session_enter`` it reads the session's common data (engine and sampling settings), plans
  the engine slots it can see with ``sut.engine.plan_engines`` (one per visible GPU, or one CPU
  core group) and takes a *seat*: an exclusive ``flock`` on ``<lock_dir>/<slot>.seat<k>.lock``,
  trying k = 0, 1, 2, ... over all slots in turn, so executors spread evenly over the engines.
* Seat 0 of a slot makes the process the slot's **engine host**: it builds the engine once (the
  same worker as the standalone SUT, ``sut.engine.EngineHandle``, pinned by the slot's
  ``CUDA_VISIBLE_DEVICES`` or CPU binding, kept in the service's process group so Flame's
  unbind ends it too) and serves a Unix socket ``<lock_dir>/<slot>.sock``. Its asyncio loop (one
  long-lived thread) takes every batch, from its own tasks and from the other executors, and
  submits all requests of a batch to the engine at once; the engine's continuous batching mixes
  the batches of all executors. The mapping of the slot to its GPU UUID is logged and returned
  with every warm-up answer.
* Any other seat makes the process a **forwarder**: it waits until the slot's host reports its
  engine ready (the answer carries the host's session id and a hash of the settings, which must
  match) and then relays each task's payload to the host and the result back.
* ``on_task_invoke`` returns the encoded result (``sut.flame.payload``): one entry per sample in
  input order, per-sample errors inside; anything that breaks the batch raises (the task fails).
* After start-up the service process freezes its heap (``gc.freeze``) and times every GC pause;
  the engine worker does the same (``EngineHandle(gc_freeze=True)``). Both unfreeze before the
  engine shuts down and log their largest pause; the values also travel in results.

The engine host dies with its executor (Flame ends the process group at unbind, at session close
or after ``delay_release`` without tasks); its forwarders then fail their tasks with a clear
message, and the client treats that as a dead service.

Test hooks: ``engine_backend = "fake"`` in the common data replaces vLLM with
``sut.flame.fake_engine`` (protocol tests); ``SUT_FLAME_FAULTS`` (JSON, see ``Faults``) injects
failures. Neither is used by a benchmark run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from sut.engine import (EngineError, EngineHandle, EngineSettings, EngineSlot, GcPauseMonitor, GenerationSettings,
                        plan_engines, read_model_info, settings_from_mapping)
from sut.flame import payload as pl

log = logging.getLogger("sut.flame.service")

PROTOCOL = 1
DEFAULT_LOCK_DIR = "/tmp/sut-flame"
LOCK_DIR_ENV = "SUT_FLAME_LOCK_DIR"
FAULTS_ENV = "SUT_FLAME_FAULTS"


# ---------------------------------------------------------------------------------------------
# Session configuration (the session's common data)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """What the client sends as the session's common data (small JSON)."""

    engine: EngineSettings
    generation: GenerationSettings
    payload: str = "tokens"  # tokens | indices
    dataset: Optional[dict] = None  # {"path", "sha256", "max_samples"} (indices mode)
    lock_dir: Optional[str] = None
    engine_backend: str = "vllm"  # vllm | fake (tests)
    fake: dict = dataclasses.field(default_factory=dict)
    engine_start_timeout_s: float = 1800.0
    allow_prefix_caching: bool = False
    log_dir: Optional[str] = None  # the client's run folder/flame-service: output goes there on the client's host
    client_host: Optional[str] = None
    digest: str = ""

    @classmethod
    def from_bytes(cls, data: Optional[bytes]) -> "ServiceConfig":
        if not data:
            raise ValueError("the session has no common data; create it with the flame SUT client")
        try:
            d = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"session common data is not JSON: {e}") from None
        if d.get("protocol") != PROTOCOL:
            raise ValueError(f"session protocol {d.get('protocol')!r} != service protocol {PROTOCOL}; "
                             "client and service must run the same code version")
        gen = dict(d["generation"])
        gen["eos_token_ids"] = tuple(gen.get("eos_token_ids") or ())
        if d.get("payload", "tokens") not in ("tokens", "indices"):
            raise ValueError(f"payload must be tokens or indices, got {d.get('payload')!r}")
        if d.get("engine_backend", "vllm") not in ("vllm", "fake"):
            raise ValueError(f"engine_backend must be vllm or fake, got {d.get('engine_backend')!r}")
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
        return cls(engine=settings_from_mapping(EngineSettings, d["engine"]),
                   generation=settings_from_mapping(GenerationSettings, gen),
                   payload=d.get("payload", "tokens"), dataset=d.get("dataset"), lock_dir=d.get("lock_dir"),
                   engine_backend=d.get("engine_backend", "vllm"), fake=dict(d.get("fake") or {}),
                   engine_start_timeout_s=float(d.get("engine_start_timeout_s", 1800.0)),
                   allow_prefix_caching=bool(d.get("allow_prefix_caching", False)), log_dir=d.get("log_dir"),
                   client_host=d.get("client_host"), digest=digest)


def make_common_data(engine: EngineSettings, generation: GenerationSettings, **extra) -> bytes:
    """The common data the client sends (inverse of ``ServiceConfig.from_bytes``)."""
    d = {"protocol": PROTOCOL, "engine": dataclasses.asdict(engine), "generation": dataclasses.asdict(generation)}
    d["generation"]["eos_token_ids"] = list(generation.eos_token_ids)
    d.update({k: v for k, v in extra.items() if v is not None})
    return json.dumps(d, sort_keys=True).encode()


# ---------------------------------------------------------------------------------------------
# Fault injection (tests only)
# ---------------------------------------------------------------------------------------------


class Faults:
    """Failures injected through ``SUT_FLAME_FAULTS`` (JSON). Keys:

    ``enter_error``: text; ``on_session_enter`` raises it.
    ``task_error``: {"batches": [ids], "times": n}; ``on_task_invoke`` raises for these batch
    ids, ``n`` times per id across all executors (counted with files in ``state_dir``).
    ``crash``: {"batches": [ids], "times": n, "delay_s": s}; the executor kills itself
    (SIGKILL) ``s`` seconds into such a task.
    ``state_dir``: folder for the counters (required with task_error / crash).
    """

    def __init__(self, spec: dict):
        self.spec = spec
        self.state_dir = Path(spec["state_dir"]) if spec.get("state_dir") else None

    @classmethod
    def from_env(cls) -> "Faults":
        raw = os.environ.get(FAULTS_ENV)
        return cls(json.loads(raw) if raw else {})

    def _fires(self, kind: str, batch_id: int) -> Optional[dict]:
        f = self.spec.get(kind)
        if not f or batch_id not in f.get("batches", []) or self.state_dir is None:
            return None
        for i in range(int(f.get("times", 1))):
            try:
                fd = os.open(self.state_dir / f"{kind}-{batch_id}-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                return f
            except FileExistsError:
                continue
        return None

    def on_enter(self) -> None:
        if self.spec.get("enter_error"):
            raise RuntimeError(self.spec["enter_error"])

    def on_task(self, batch_id: int) -> None:
        if self._fires("task_error", batch_id):
            raise RuntimeError(f"injected task failure (batch {batch_id})")
        f = self._fires("crash", batch_id)
        if f:
            time.sleep(float(f.get("delay_s", 0.0)))
            log.error("injected crash: killing this service process (pid %d) in batch %d", os.getpid(), batch_id)
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Seats: which process hosts which engine
# ---------------------------------------------------------------------------------------------


def slot_keys(slots: list[EngineSlot]) -> list[str]:
    """A stable file-name key per slot, e.g. ``cuda-0.e0`` or ``cpu-0-1.e0``."""
    seen: dict[str, int] = {}
    keys = []
    for s in slots:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{s.kind}-{s.device}")
        k = seen.get(base, 0)
        seen[base] = k + 1
        keys.append(f"{base}.e{k}")
    return keys


def _try_flock(path: Path) -> Optional[int]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def take_seat(lock_dir: Path, keys: list[str], start: int = 0) -> tuple[int, int, int]:
    """Lock the first free seat, trying seat k of every slot before seat k+1.

    Returns ``(slot index, seat, fd)``; the lock lasts until ``fd`` is closed or the process ends.
    """
    for k in itertools.count(start):
        for i, key in enumerate(keys):
            fd = _try_flock(lock_dir / f"{key}.seat{k}.lock")
            if fd is not None:
                return i, k, fd
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Host <-> forwarder frames over a Unix socket
# ---------------------------------------------------------------------------------------------

_FRAME = struct.Struct("<4sBI")
_FRAME_MAGIC = b"SFEH"
F_HELLO, F_TASK, F_OK, F_ERR = 1, 2, 3, 4
MAX_FRAME = 64 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("engine host closed the connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, ftype: int, body: bytes) -> None:
    sock.sendall(_FRAME.pack(_FRAME_MAGIC, ftype, len(body)) + body)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    magic, ftype, n = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if magic != _FRAME_MAGIC or n > MAX_FRAME:
        raise ConnectionError("bad frame from the engine host")
    return ftype, _recv_exact(sock, n)


async def _arecv_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    magic, ftype, n = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if magic != _FRAME_MAGIC or n > MAX_FRAME:
        raise ConnectionError("bad frame from a forwarder")
    return ftype, await reader.readexactly(n)


def _asend_frame(writer: asyncio.StreamWriter, ftype: int, body: bytes) -> None:
    writer.write(_FRAME.pack(_FRAME_MAGIC, ftype, len(body)) + body)


def _pack_task(ident: dict, data: bytes) -> bytes:
    ib = json.dumps(ident).encode()
    return struct.pack("<I", len(ib)) + ib + data


def _unpack_task(body: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<I", body, 0)
    return json.loads(body[4:4 + n]), body[4 + n:]


# ---------------------------------------------------------------------------------------------
# Engine host: the engine behind one asyncio loop
# ---------------------------------------------------------------------------------------------


class EngineHost:
    """Owns one engine (slot) and one long-lived asyncio loop; serves local and forwarded batches."""

    def __init__(self, cfg: ServiceConfig, slot: EngineSlot, key: str, sock_path: Path, session_id: str, ident: dict):
        self.cfg, self.slot, self.key, self.sock_path = cfg, slot, key, sock_path
        self.session_id, self.ident = session_id, ident
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="engine-host-loop", daemon=True)
        self._submit_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="engine-submit")
        self._futures: dict[int, asyncio.Future] = {}
        self._rid = itertools.count(1)
        self._ready: Optional[asyncio.Event] = None
        self._fatal: Optional[str] = None
        self._stopping = False
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

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> dict:
        """Open the socket at once (forwarders wait on it), then build the engine; blocks until ready."""
        self._loop_thread.start()
        self._call(self._open())
        try:
            info = self._start_engine()
        except BaseException as e:
            self._fatal = f"engine host {self.key} (pid {os.getpid()}) could not start its engine: {e}"
            self.loop.call_soon_threadsafe(self._ready.set)
            raise
        self.loop.call_soon_threadsafe(self._ready.set)
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
        if cfg.engine.enable_prefix_caching and not cfg.allow_prefix_caching:
            raise EngineError("enable_prefix_caching=True is not allowed in an MLPerf run (cross-query KV reuse is prohibited)")
        if cfg.engine_backend == "fake":
            from sut.flame.fake_engine import FakeEngineHandle

            self.vocab_size = 128256
            handle = FakeEngineHandle(self.slot, cfg.engine, cfg.generation, **cfg.fake)
        else:
            self.vocab_size = read_model_info(cfg.engine.model).vocab_size
            handle = EngineHandle(self.slot, cfg.engine, cfg.generation, own_process_group=False, gc_freeze=True)
        self.max_prompt_len = cfg.engine.max_model_len - cfg.generation.max_tokens
        if cfg.payload == "indices":
            self.dataset = _load_dataset(cfg, self.vocab_size)
        t0 = time.monotonic()
        handle.start()
        self.handle = handle
        try:
            info = handle.wait_ready(cfg.engine_start_timeout_s)
        except BaseException:
            handle.shutdown()
            raise
        if info.get("enable_prefix_caching") and not cfg.allow_prefix_caching:
            handle.shutdown()
            raise EngineError(f"engine on {self.key} reports enable_prefix_caching=True; refusing to run")
        handle.watch(self._on_done, self._on_fatal, self._on_stats)
        self.info = info
        dev = info.get("device") or {}
        self.shard = {"key": self.key, "node": socket.gethostname(), "slot": self.slot.index, "kind": self.slot.kind,
                      "device": self.slot.device, "gpu_uuid": dev.get("uuid"), "device_name": dev.get("name"),
                      "host_pid": os.getpid(), "engine_pid": info.get("pid"), "session_id": self.session_id}
        log.info("engine ready in %.1f s: shard %s on %s -> %s (%s), engine pid %s, host pid %d", time.monotonic() - t0,
                 self.key, self.shard["node"], self.shard["gpu_uuid"] or f"{self.slot.kind}:{self.slot.device}",
                 self.shard["device_name"], info.get("pid"), os.getpid())
        return info

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
    def _on_done(self, _engine: int, results: list) -> None:
        self.loop.call_soon_threadsafe(self._resolve, results)

    def _resolve(self, results: list) -> None:
        for rid, ids in results:
            fut = self._futures.pop(int(rid), None)
            if fut is not None and not fut.done():
                fut.set_result(ids)

    def _on_fatal(self, message: str) -> None:
        if self._stopping:
            return
        self._fatal = f"engine {self.key} on {socket.gethostname()} died: {message}"
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
        return self._call(ask(), timeout + 1.0)

    # -- the async engine ------------------------------------------------------------------
    async def generate(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        """Submit all prompts at once; return their generated ids in input order."""
        if self._fatal:
            raise EngineError(self._fatal)
        if not prompts:
            return []
        batch, futs = [], []
        for p in prompts:
            rid = next(self._rid)
            fut = self.loop.create_future()
            self._futures[rid] = fut
            futs.append(fut)
            batch.append((rid, np.asarray(p, dtype=np.int32)))
        try:
            await self.loop.run_in_executor(self._submit_pool, self.handle.submit, batch)
        except Exception:
            for rid, _ in batch:
                self._futures.pop(rid, None)
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
        t0 = time.monotonic()
        outs = await self.generate([prompts[i] for i in valid])
        engine_s = time.monotonic() - t0
        by_pos = dict(zip(valid, outs))
        samples = []
        for i in range(len(task)):
            rid = int(task.request_ids[i])
            if errors[i] is None:
                samples.append(pl.SampleResult(rid, True, token_ids=by_pos[i]))
            else:
                samples.append(pl.SampleResult(rid, False, error=errors[i]))
        meta = {"executor": ident, "shard": self.shard["key"], "node": self.shard["node"],
                "engine_gc_max_pause_ms": self.engine_gc.get("max_pause_ms"),
                "t": {"recv": t_recv, "engine_s": round(engine_s, 6), "service_s": round(time.time() - t_recv, 6)}}
        out = pl.encode_result(task.batch_id, samples, meta=meta).data
        self.loop.run_in_executor(self._submit_pool, self._ask_stats)  # refreshes engine_gc for later results
        return out

    def _ask_stats(self) -> None:
        try:
            self.handle.request_stats()
        except Exception:  # noqa: BLE001 - statistics only
            pass

    def _resolve_prompts(self, task: pl.TaskInput) -> tuple[list, list]:
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
            if errors[i] is not None:
                continue
            if len(p) == 0:
                errors[i] = "empty prompt"
            elif len(p) > self.max_prompt_len:
                errors[i] = (f"prompt has {len(p)} tokens, more than max_model_len - max_tokens = {self.max_prompt_len}")
            else:
                lo, hi = int(p.min()), int(p.max())
                if lo < 0 or hi >= self.vocab_size:
                    errors[i] = f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})"
        return prompts, errors

    # -- forwarders --------------------------------------------------------------------------
    async def _serve_forwarder(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ftype, body = await _arecv_frame(reader)
            if ftype != F_HELLO:
                return
            hello = json.loads(body)
            await self._ready.wait()
            if self._fatal:
                _asend_frame(writer, F_ERR, self._fatal.encode())
                return
            if hello.get("session_id") != self.session_id or hello.get("digest") != self.cfg.digest:
                _asend_frame(writer, F_ERR, json.dumps({"mismatch": True, "session_id": self.session_id}).encode())
                return
            _asend_frame(writer, F_OK, json.dumps({"shard": self.shard, "engine": self.info}).encode())
            log.info("forwarder pid %s (seat %s) attached to shard %s", hello.get("pid"), hello.get("seat"), self.key)
            while True:
                try:
                    ftype, body = await _arecv_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if ftype != F_TASK:
                    return
                ident, data = _unpack_task(body)
                try:
                    out = await self.handle_task(data, ident)
                    _asend_frame(writer, F_OK, out)
                except Exception as e:  # noqa: BLE001 - the forwarder fails its task with this text
                    _asend_frame(writer, F_ERR, f"{type(e).__name__}: {e}".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            return
        finally:
            try:
                await writer.drain()
            except Exception:  # noqa: BLE001
                pass
            writer.close()


def _load_dataset(cfg: ServiceConfig, vocab_size: int):
    from sut.dataset import load_dataset

    ds = cfg.dataset or {}
    if not ds.get("path"):
        raise ValueError("payload=indices needs the dataset path in the session's common data")
    dataset = load_dataset(ds["path"], vocab_size, cfg.engine.max_model_len, ds.get("max_samples"))
    if ds.get("sha256") and dataset.sha256 != ds["sha256"]:
        raise ValueError(f"the service's copy of {ds['path']} has sha256 {dataset.sha256[:12]}..., the client's "
                         f"{ds['sha256'][:12]}...; payload=indices needs the same file on both sides")
    return dataset


# ---------------------------------------------------------------------------------------------
# Forwarder: relays tasks to the slot's engine host
# ---------------------------------------------------------------------------------------------


class HostMismatch(RuntimeError):
    """The slot's engine host belongs to another session or other settings."""


class EngineClient:
    """Blocking connection from a forwarder to its engine host (one task at a time)."""

    def __init__(self, sock_path: Path, hello: dict, timeout: float):
        self.sock_path, self.hello = sock_path, hello
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5.0)
        self.sock.connect(str(sock_path))
        send_frame(self.sock, F_HELLO, json.dumps(hello).encode())
        self.sock.settimeout(timeout)  # the host answers once its engine is ready
        ftype, body = recv_frame(self.sock)
        if ftype == F_ERR:
            text = body.decode("utf-8", "replace")
            try:
                if json.loads(text).get("mismatch"):
                    raise HostMismatch(text)
            except (json.JSONDecodeError, AttributeError):
                pass
            raise EngineError(text)
        info = json.loads(body)
        self.shard, self.engine_info = info["shard"], info["engine"]
        self.sock.settimeout(None)
        self.broken: Optional[str] = None

    def run(self, data: bytes, ident: dict) -> bytes:
        if self.broken:
            raise EngineError(self.broken)
        try:
            send_frame(self.sock, F_TASK, _pack_task(ident, data))
            ftype, body = recv_frame(self.sock)
        except (OSError, ConnectionError) as e:
            self.broken = (f"engine host of shard {self.shard['key']} (pid {self.shard['host_pid']}) is gone: {e}; "
                           "this executor cannot serve tasks any more")
            raise EngineError(self.broken) from None
        if ftype == F_ERR:
            raise RuntimeError(body.decode("utf-8", "replace"))
        return body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# The Flame service
# ---------------------------------------------------------------------------------------------


def _base_service_class():
    import flamepy

    return flamepy.FlameService


class VllmBatchService(_base_service_class()):
    """FlameService: batches of samples in, generated ids out (see the module docstring)."""

    def __init__(self, faults: Optional[Faults] = None):
        self.faults = faults or Faults.from_env()
        self.role: Optional[str] = None
        self.cfg: Optional[ServiceConfig] = None
        self.host: Optional[EngineHost] = None
        self.client: Optional[EngineClient] = None
        self.seat_fd: Optional[int] = None
        self.seat: Optional[int] = None
        self.session_id: Optional[str] = None
        self.gcmon = GcPauseMonitor("service").install()
        self._frozen = False
        self.tasks_done = 0
        endpoint = os.environ.get("FLAME_INSTANCE_ENDPOINT", "")
        self.executor_id = Path(endpoint).name.removesuffix(".sock") if endpoint else f"pid{os.getpid()}"

    def ident(self) -> dict:
        return {"id": self.executor_id, "pid": os.getpid(), "node": socket.gethostname(), "role": self.role,
                "seat": self.seat, "gc_max_pause_ms": round(self.gcmon.max_s * 1e3, 3), "tasks": self.tasks_done}

    # -- Flame callbacks ---------------------------------------------------------------------
    def on_session_enter(self, context) -> bool:
        t0 = time.monotonic()
        self.faults.on_enter()
        if self.session_id is not None:
            raise RuntimeError(f"this service process already entered session {self.session_id}")
        self.cfg = cfg = ServiceConfig.from_bytes(context.common_data())
        self.session_id = context.session_id
        self._redirect_output(cfg)
        lock_dir = Path(cfg.lock_dir or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
        lock_dir.mkdir(parents=True, exist_ok=True)
        slots = plan_engines(cfg.engine)
        keys = slot_keys(slots)
        longest = max(len(str(lock_dir / f"{k}.sock").encode()) for k in keys)
        if longest > 104:
            raise ValueError(f"lock_dir {lock_dir} is too long: the engine sockets in it would have {longest}-byte "
                             "paths, over the Unix socket limit (108); set a shorter lock_dir / SUT_FLAME_LOCK_DIR")
        deadline = time.monotonic() + cfg.engine_start_timeout_s
        while True:
            idx, seat, fd = take_seat(lock_dir, keys)
            self.seat, self.seat_fd = seat, fd
            sock_path = lock_dir / f"{keys[idx]}.sock"
            if seat == 0:
                self.role = "host"
                log.info("executor %s (pid %d): engine host of slot %s (%s:%s)", self.executor_id, os.getpid(), keys[idx],
                         slots[idx].kind, slots[idx].device)
                self.host = EngineHost(cfg, slots[idx], keys[idx], sock_path, self.session_id, {})
                self.host.start()
                break
            self.role = "forwarder"
            try:
                self.client = self._attach(sock_path, lock_dir, keys[idx], deadline)
            except _BecomeHost:
                os.close(fd)
                continue
            except HostMismatch as e:
                os.close(fd)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"slot {keys[idx]} is held by another session's engine host: {e}") from None
                log.warning("slot %s is held by another session's engine host; waiting for it to go", keys[idx])
                time.sleep(1.0)
                continue
            log.info("executor %s (pid %d): forwarder seat %d of shard %s -> %s", self.executor_id, os.getpid(), seat,
                     keys[idx], self.client.shard.get("gpu_uuid") or self.client.shard.get("device"))
            break
        self.gcmon.freeze()  # start-up is over: the long-lived heap stays out of later collections
        self._frozen = True
        log.info("session %s entered as %s in %.1f s", self.session_id, self.role, time.monotonic() - t0)
        return True

    def _redirect_output(self, cfg: ServiceConfig) -> None:
        """Send this process's stdout/stderr (and so the engine worker's, started later) to
        ``<log_dir>/<executor id>.log`` when the client runs on this host; Flame's own ``.out``/``.err``
        files in the application's working directory keep what came before."""
        if not cfg.log_dir or cfg.client_host != socket.gethostname():
            return
        try:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            path = Path(cfg.log_dir) / f"{self.executor_id}.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            log.warning("cannot write the service log into %s (%s); it stays in the working directory", cfg.log_dir, e)
            return
        log.info("session %s: the output of this service process goes to %s from now on", self.session_id, path)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        log.info("executor %s (pid %d), session %s: output of this service process", self.executor_id, os.getpid(),
                 self.session_id)

    def _attach(self, sock_path: Path, lock_dir: Path, key: str, deadline: float) -> EngineClient:
        hello = {"session_id": self.session_id, "digest": self.cfg.digest, "pid": os.getpid(), "seat": self.seat}
        while True:
            try:
                return EngineClient(sock_path, hello, timeout=max(1.0, deadline - time.monotonic()))
            except (FileNotFoundError, ConnectionRefusedError, ConnectionError):
                pass  # no host listening (yet)
            except socket.timeout:
                raise EngineError(f"engine host of slot {key} not ready after {self.cfg.engine_start_timeout_s:.0f} s") from None
            # Is there a host at all? If seat 0 is free, its holder is gone: take over.
            fd0 = _try_flock(lock_dir / f"{key}.seat0.lock")
            if fd0 is not None:
                os.close(fd0)
                raise _BecomeHost()
            if time.monotonic() > deadline:
                raise EngineError(f"engine host of slot {key} never opened {sock_path}")
            time.sleep(0.2)

    def on_task_invoke(self, context) -> Optional[bytes]:
        t_recv = time.time()
        if self.role is None:
            raise RuntimeError("task before on_session_enter")
        data = context.input
        kind, batch_id = pl.peek(data)  # a foreign payload fails the task here
        if kind == "generate":
            self.faults.on_task(batch_id)
        ident = dict(self.ident(), t_recv=t_recv, task_id=context.task_id)
        if self.role == "host":
            out = self.host._call(self.host.handle_task(data, ident))
        else:
            out = self.client.run(data, ident)
        self.tasks_done += 1
        return out

    def on_session_leave(self) -> bool:
        # Never raise here (Flame 0.6 retries a failed leave in a tight loop); the process ends anyway.
        try:
            log.info("leaving session %s after %d task(s); largest GC pause of this service process %.1f ms",
                     self.session_id, self.tasks_done, self.gcmon.max_s * 1e3)
        except Exception:  # noqa: BLE001
            pass
        return True

    # -- process end -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._frozen:
            self.gcmon.unfreeze()  # before the engine shuts down
            self._frozen = False
        st = self.gcmon.stats()
        log.info("service process %d (%s): largest GC pause %.1f ms (generation %s), %d collections", os.getpid(),
                 self.role, st["max_pause_ms"], st["max_pause_generation"], st["collections"])
        if self.client is not None:
            self.client.close()
        if self.host is not None:
            self.host.shutdown()


class _BecomeHost(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Process entry
# ---------------------------------------------------------------------------------------------


def listen_unix(server, endpoint: str) -> None:
    """Bind ``server`` to the Unix socket ``endpoint`` so that the path appears only once it accepts
    connections: bind a temporary path next to it, then rename it into place.

    Flame v0.6.0's executor manager busy-polls for the socket file and connects the moment it exists;
    grpc creates the file at ``bind()``, before ``listen()``, and a connect in between fails the executor's
    bind ("shim creation failed: failed to connect to service ...: transport error"; seen on a loaded host).
    """
    tmp = f"{endpoint}.{os.getpid()}.tmp"
    if len(tmp.encode()) > 107:  # the Unix socket path limit: bind the endpoint directly
        server.add_insecure_port(f"unix://{endpoint}")
        return
    server.add_insecure_port(f"unix://{tmp}")
    os.rename(tmp, endpoint)


def main(argv: Optional[list[str]] = None) -> int:
    """Serve the Flame instance socket named by ``FLAME_INSTANCE_ENDPOINT`` until SIGTERM."""
    logging.basicConfig(level=os.environ.get("SUT_FLAME_LOG", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [flame-svc {os.getpid()}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    endpoint = os.environ.get("FLAME_INSTANCE_ENDPOINT")
    if not endpoint:
        log.error("FLAME_INSTANCE_ENDPOINT is not set: this program is started by Flame's executor manager")
        return 2
    import grpc
    from flamepy.core.service import FlameInstanceServicer
    from flamepy.proto.shim_pb2_grpc import add_InstanceServicer_to_server

    service = VllmBatchService()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Our own server (not flamepy.run): the socket exists at once and the main thread stays free
    # to shut the engine down on SIGTERM.
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=4))
    add_InstanceServicer_to_server(FlameInstanceServicer(service), server)
    listen_unix(server, endpoint)
    server.start()
    log.info("serving %s (executor %s)", endpoint, service.executor_id)
    stop.wait()  # no timeout: an idle executor should not wake up (the signal handler sets the event)
    log.info("stopping")
    try:
        service.shutdown()
    finally:
        server.stop(grace=1.0)
    return 0
