"""Test doubles of the flame transport, plugged in through its extension points (never imported by the product).

* ``FakeEngineHandle``: ``engine_factory = "tests.flame_doubles:FakeEngineHandle"``. The surface of
  ``sut.engine.EngineHandle`` that the Flame engine host uses, without vLLM: each submitted batch is
  "generated" after ``step_s`` seconds (``fake_generate``: a deterministic function of the prompt), and
  every request gets a ``Completion`` with the engine's monotonic times and ``cached_tokens`` from a
  per-engine prefix cache of ``block``-token blocks (chained, like vLLM's): the number of leading
  tokens, in whole blocks, of the prompt whose blocks an earlier request on the same engine had.
  ``hang_after`` N > 0: after N batches the engine answers nothing more (a stopped or hung engine) until shut down.
  ``spoil`` (a wrong engine, every batch): ``"wide_id"`` the first answer's ids are int64 with its first id
  2**32 + 1000 (int32 would wrap it to 1000), ``"float_ids"`` its ids are float64 (int32 would truncate them),
  ``"twice"`` the second answer carries the first's request id (the first request answered twice, the second never;
  with one request, its answer comes twice), ``"unknown_rid"`` the first answer carries a request id never submitted.
* ``Faults``: ``service_hooks = "tests.flame_doubles:Faults"`` with ``service_hooks_args``:
  ``enter_error`` (text; ``on_session_enter`` raises it), ``enter_sleep_s`` (``on_session_enter`` blocks so long
  first: a slow engine start), ``task_error`` ({"batches": [ids], "times":
  n}: the task raises for these batch ids, n times per id across every executor, counted with files
  in ``state_dir``), ``crash`` ({"batches", "times", "delay_s"}: the executor kills itself with
  SIGKILL ``delay_s`` into such a task), ``exit_after`` (same keys: the task succeeds, the process kills itself
  ``delay_s`` later, while its executor waits for a task), ``state_dir`` (needed by task_error / crash).
* ``fake_options(**kw)``: the ``FlameOptions`` fields that select both (a dict for ``--option``).

The service processes import this module as ``tests.flame_doubles``: the application's
``PYTHONPATH`` starts with the repository root (``sut.flame.app.render``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from sut.engine import EngineSettings, EngineSlot, GenerationSettings
from sut.messages import Completion

log = logging.getLogger("tests.flame_doubles")

FAKE_TOKEN_BASE = 1000  # generated ids are in [1000, 2000): never an EOS id of a Llama 3 model
ENGINE_FACTORY = "tests.flame_doubles:FakeEngineHandle"
SERVICE_HOOKS = "tests.flame_doubles:Faults"


def fake_options(step_s: float = 0.05, start_s: float = 0.0, block: int = 16, faults: Optional[dict] = None) -> dict:
    """FlameOptions fields for the fake engine (and fault injection when ``faults`` is given)."""
    out = {"engine_factory": ENGINE_FACTORY, "engine_factory_args": {"step_s": step_s, "start_s": start_s, "block": block}}
    if faults:
        out.update(service_hooks=SERVICE_HOOKS, service_hooks_args=dict(faults))
    return out


def fake_generate(prompt: np.ndarray, max_tokens: int = 128, eos_id: Optional[int] = None) -> np.ndarray:
    """Deterministic "generation": 2..max_tokens ids derived from the prompt; when ``eos_id`` is given, an
    answer shorter than ``max_tokens`` ends with it (an engine ends a sequence early only at its EOS)."""
    p = np.asarray(prompt, dtype=np.int64)
    h = int((p * np.arange(1, len(p) + 1)).sum() % 1_000_003)
    n = 2 + h % max(1, max_tokens - 1)
    ids = (FAKE_TOKEN_BASE + (h + 7919 * np.arange(n)) % 1000).astype(np.int32)
    if eos_id is not None and n < max_tokens:
        ids[-1] = eos_id
    return ids


def block_hashes(prompt: np.ndarray, block: int) -> list[bytes]:
    """Chained hashes of the prompt's whole ``block``-token blocks."""
    out, h = [], b""
    p = np.asarray(prompt, dtype=np.int32)
    for i in range(len(p) // block):
        h = hashlib.sha256(h + p[i * block:(i + 1) * block].tobytes()).digest()
        out.append(h)
    return out


#: The kinds of wrong answer ``FakeEngineHandle(spoil=...)`` gives ("": right answers).
SPOILS = ("", "wide_id", "float_ids", "twice", "unknown_rid")
UNKNOWN_RID = 10**9


def spoiled(out: list[Completion], spoil: str) -> list[Completion]:
    """``out`` (one batch's answers) made wrong as ``spoil`` says (module docstring); ``out`` itself when "" or
    empty."""
    if not spoil or not out:
        return out
    first, out = out[0], list(out)
    if spoil == "wide_id":
        ids = np.asarray(first.token_ids, dtype=np.int64).copy()
        ids[0] = 2**32 + FAKE_TOKEN_BASE
        out[0] = first._replace(token_ids=ids)
    elif spoil == "float_ids":
        out[0] = first._replace(token_ids=np.asarray(first.token_ids, dtype=np.float64) + 0.7)
    elif spoil == "twice" and len(out) > 1:
        out[1] = out[1]._replace(rid=first.rid)
    elif spoil == "twice":
        out.append(first)
    elif spoil == "unknown_rid":
        out[0] = first._replace(rid=UNKNOWN_RID)
    return out


class FakeEngineHandle:
    """Same surface as ``EngineHandle``: start, wait_ready, watch, submit, request_stats, shutdown, pid."""

    def __init__(self, slot: EngineSlot, settings: EngineSettings, gen: GenerationSettings, step_s: float = 0.05,
                 start_s: float = 0.0, block: int = 16, hang_after: int = 0, spoil: str = "", **_ignored):
        if spoil not in SPOILS:
            raise ValueError(f"spoil must be one of {', '.join(SPOILS)}, got {spoil!r}")
        self.slot, self.settings, self.gen = slot, settings, gen
        self.hang_after, self.batches_done, self.spoil = int(hang_after), 0, spoil
        self.step_s, self.start_s, self.block = float(step_s), float(start_s), int(block)
        self.info: dict = {}
        self._q: "queue.Queue[Optional[list]]" = queue.Queue()
        self._on_done: Optional[Callable] = None
        self._on_stats: Optional[Callable] = None
        self._thread: Optional[threading.Thread] = None
        self._cache: set[bytes] = set()
        self._ended = threading.Event()
        self.samples_done = 0

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> dict:
        if self._ended.wait(min(self.start_s, timeout)):  # shut down while "starting", as a real worker is ended
            from sut.errors import EngineError

            raise EngineError(f"fake engine {self.slot.index} ended during start-up")
        self.info = {
            "engine": self.slot.index, "pid": os.getpid(), "vllm_version": "fake", "torch_version": "fake",
            "engine_args": {"model": self.settings.model, "max_num_seqs": self.settings.max_num_seqs,
                            "max_model_len": self.settings.max_model_len},
            "enable_prefix_caching": bool(self.settings.enable_prefix_caching),
            "device": {"kind": self.slot.kind, "slot": self.slot.device, "name": "fake-engine",
                       "uuid": f"FAKE-{self.slot.kind}-{self.slot.device}"},
            "fake": True,
        }
        return self.info

    def watch(self, on_done, on_fatal, on_stats=None, on_first=None) -> None:
        self._on_done, self._on_stats = on_done, on_stats
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def _answer(self, rid: int, prompt: np.ndarray, eos: Optional[int], t_queued: float, asked: int = 0) -> Completion:
        hashes = block_hashes(prompt, self.block)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._cache:
            hit += 1
        self._cache.update(hashes)
        ids = fake_generate(prompt, asked or self.gen.max_tokens, eos)
        t = time.monotonic()
        return Completion(int(rid), ids, hit * self.block, t_queued, t, t)

    def _loop(self) -> None:
        eos = None if self.gen.ignore_eos or not self.gen.eos_token_ids else self.gen.eos_token_ids[0]
        while True:
            item = self._q.get()
            if item is None:
                return
            t_queued, batch = item
            if self.hang_after and self.batches_done >= self.hang_after:
                self._ended.wait()  # answers nothing more, as a stopped engine
                return
            self.batches_done += 1
            time.sleep(self.step_s)
            out = [self._answer(r[0], r[1], eos, t_queued, r[3] if len(r) > 3 else 0) for r in batch]
            self.samples_done += len(out)
            self._on_done(self.slot.index, spoiled(out, self.spoil))

    def submit(self, batch) -> None:
        self._q.put((time.monotonic(), list(batch)))

    def request_stats(self) -> None:
        if self._on_stats is not None:
            self._on_stats({"name": f"fake-engine-{self.slot.index}", "pid": os.getpid(), "collections": 0,
                            "total_ms": 0.0, "max_pause_ms": 0.0, "max_pause_generation": None, "frozen_objects": 0})

    def shutdown(self, timeout: float = 30.0) -> None:
        self._ended.set()
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout)


class Faults:
    """Service hooks that inject failures (see the module docstring for the keys)."""

    def __init__(self, **spec):
        self.spec = spec
        self.state_dir = Path(spec["state_dir"]) if spec.get("state_dir") else None

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

    def on_enter(self, _service) -> None:
        if self.spec.get("enter_sleep_s"):
            log.warning("injected: on_session_enter sleeps %s s", self.spec["enter_sleep_s"])
            time.sleep(float(self.spec["enter_sleep_s"]))
        if self.spec.get("enter_error"):
            raise RuntimeError(self.spec["enter_error"])

    def on_task(self, _service, batch_id: int) -> None:
        if self._fires("task_error", batch_id):
            raise RuntimeError(f"injected task failure (batch {batch_id})")
        f = self._fires("exit_after", batch_id)
        if f:  # the task itself succeeds; the process dies while its executor waits for the next task
            delay = float(f.get("delay_s", 1.0))
            log.error("injected crash: this service process (pid %d) kills itself %.1f s after batch %d", os.getpid(),
                      delay, batch_id)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        f = self._fires("crash", batch_id)
        if f:
            time.sleep(float(f.get("delay_s", 0.0)))
            log.error("injected crash: killing this service process (pid %d) in batch %d", os.getpid(), batch_id)
            os.kill(os.getpid(), signal.SIGKILL)
