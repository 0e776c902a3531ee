"""Engine layer: one vLLM engine per device, each in its own worker process.

Algorithm
---------
``EngineSettings`` (one frozen dataclass, built from the CLI or from code) → ``plan_engines``
(one ``EngineSlot`` per visible GPU, or per CPU core group) → ``EnginePool`` starts one
spawned worker process per slot. A worker pins itself (``CUDA_VISIBLE_DEVICES`` or the vLLM CPU
thread binding), builds ``vllm.LLM`` once, reads its configuration back, reports ``ready`` and
then runs the same add-request / step loop that ``LLM.generate`` runs, fed from a pipe: new
requests are added the moment they arrive and finished outputs are sent back after each step.

Knobs (``EngineSettings``): model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens (the
per-step token budget, which caps the prefill tokens of one step: vLLM's chunked prefill),
long_prefill_token_threshold (a prompt longer than this is prefilled at most this many tokens per
step; vLLM's ``SchedulerConfig``; 0/None = no cap), enable_chunked_prefill (None = vLLM's default, on),
gpu_memory_utilization (split evenly between engines sharing one GPU), kv_cache_dtype,
quantization, load_format (``dummy`` = random weights from config.json), enforce_eager, seed,
enable_prefix_caching (must stay False for MLPerf; the run refuses to start otherwise),
device (auto/cuda/cpu), engines_per_device, cpu_kvcache_gib.

Engine output: vLLM writes its own logs, warnings and tracebacks (e.g. the harmless "Chat
template warmup failed ... Tokenizer not available" of an engine started without a tokenizer)
to the worker's stdout/stderr. ``EnginePool.start(log_dir)`` sends each worker's stdout and
stderr, with those of vLLM's own child processes, to ``log_dir/engine-N.log`` instead of the
console; a start failure or an engine death carries the log's last lines in its error message.
Without ``log_dir`` (``--verbose``, the Flame service) the output goes where the parent's goes.

Failure handling: each worker runs in its own process group. The pool watches each worker's
pipe and process sentinel; an exited worker or an engine exception is reported through
``on_fatal`` at once (no polling delay), and ``shutdown`` ends every process group (SIGTERM,
then SIGKILL), so vLLM's own child processes never outlive the run.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from sut.constants import MAX_NEW_TOKENS, MIN_NEW_TOKENS

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine failed to start, died, or was configured against the rules."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSettings:
    """vLLM engine settings shared by every engine of a run.

    ``max_model_len`` must cover the longest prompt plus 128 new tokens (MLPerf
    ``max_new_tokens``); the official CNN/DailyMail set needs 2,540 + 128 = 2,668.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int = 2668
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    long_prefill_token_threshold: Optional[int] = None
    enable_chunked_prefill: Optional[bool] = None
    gpu_memory_utilization: Optional[float] = None  # None = vLLM's default (0.92 in 0.26)
    kv_cache_dtype: str = "auto"
    quantization: Optional[str] = None
    load_format: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    enable_prefix_caching: bool = False
    device: str = "auto"  # auto | cuda | cpu
    engines_per_device: int = 1
    cpu_kvcache_gib: int = 2

    def __post_init__(self):
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.engines_per_device < 1:
            raise ValueError(f"engines_per_device must be >= 1, got {self.engines_per_device}")
        if self.max_model_len <= MAX_NEW_TOKENS:
            raise ValueError(f"max_model_len must exceed {MAX_NEW_TOKENS}, got {self.max_model_len}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")

    def vllm_kwargs(self, gpu_share: int = 1) -> dict:
        """Keyword arguments for ``vllm.LLM`` (``gpu_share`` engines split one GPU's memory)."""
        kw = dict(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            kv_cache_dtype=self.kv_cache_dtype,
            load_format=self.load_format,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            skip_tokenizer_init=True,
            disable_log_stats=True,
        )
        if self.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.long_prefill_token_threshold is not None:
            kw["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        if self.enable_chunked_prefill is not None:
            kw["enable_chunked_prefill"] = self.enable_chunked_prefill
        if self.quantization:
            kw["quantization"] = self.quantization
        util = self.gpu_memory_utilization
        if util is None and gpu_share > 1:
            util = 0.90  # engines sharing a GPU must split it explicitly
        if util is not None:
            kw["gpu_memory_utilization"] = round(util / gpu_share, 4)
        return kw


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling as the reference SUT (SUT_VLLM.py): greedy, 128 max / 1 min new tokens.

    ``ignore_eos`` is a benchmark-only switch (fixed 128-token outputs for dummy weights, which
    emit EOS at random); it is never on in a compliant run.
    """

    max_tokens: int = MAX_NEW_TOKENS
    min_tokens: int = MIN_NEW_TOKENS
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def sampling_params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=0.0,
            top_p=1.0,
            max_tokens=self.max_tokens,
            min_tokens=self.max_tokens if self.ignore_eos else self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.eos_token_ids),
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )


# ---------------------------------------------------------------------------------------------
# Model and device facts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """Facts read from a HF model folder: vocabulary size, EOS ids, config hash."""

    path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config_sha256: str
    max_position_embeddings: int


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Read ``config.json`` (and ``generation_config.json`` if present) of a HF model folder.

    EOS ids come from ``generation_config.json`` ``eos_token_id`` (what the checkpoint
    generates with), else ``config.json``. Raises ``EngineError`` if the folder or
    ``config.json`` is missing or has no ``vocab_size``.
    """
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise EngineError(f"{d}: no config.json (expected a Hugging Face model folder)")
    raw = cfg_path.read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise EngineError(f"{cfg_path}: malformed JSON: {e}") from None
    if "vocab_size" not in cfg:
        raise EngineError(f"{cfg_path}: field 'vocab_size' missing")
    eos = None
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        raise EngineError(f"{d}: no eos_token_id in generation_config.json or config.json")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ModelInfo(
        path=str(d),
        vocab_size=int(cfg["vocab_size"]),
        eos_token_ids=eos_ids,
        config_sha256=hashlib.sha256(raw).hexdigest(),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
    )


@dataclass(frozen=True)
class EngineSlot:
    """Where one engine runs: a GPU (``kind='cuda'``) or a CPU core group (``kind='cpu'``)."""

    index: int
    kind: str
    device: str  # physical GPU index / UUID or CPU core list, e.g. "0" or "0-1"
    gpu_share: int = 1  # engines sharing this GPU
    env: tuple[tuple[str, str], ...] = ()


def _visible_gpus() -> list[str]:
    """Physical GPU ids visible to this process (respects CUDA_VISIBLE_DEVICES)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [g.strip() for g in cvd.split(",") if g.strip() and g.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


# Environment that vLLM's CPU backend needs on these machines (../shared/research/env_cpu.md §2):
# both cores for the worker, in-process engine (fast start, no EngineCore child), loopback only.
CPU_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def plan_engines(settings: EngineSettings) -> list[EngineSlot]:
    """One slot per visible GPU × engines_per_device, or CPU core groups on a host without GPUs.

    Raises ``EngineError`` when ``device='cuda'`` and no GPU is visible, or when more CPU
    engines are asked for than there are cores.
    """
    gpus = [] if settings.device == "cpu" else _visible_gpus()
    if settings.device == "cuda" and not gpus:
        raise EngineError("device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    k = settings.engines_per_device
    slots: list[EngineSlot] = []
    if gpus:
        for g in gpus:
            for _ in range(k):
                slots.append(EngineSlot(len(slots), "cuda", g, k, (("CUDA_VISIBLE_DEVICES", g),)))
        return slots
    cores = sorted(os.sched_getaffinity(0))
    if k > len(cores):
        raise EngineError(f"{k} CPU engines asked for, but only {len(cores)} cores are usable")
    groups = np.array_split(np.array(cores), k)
    for grp in groups:
        bind = f"{grp[0]}-{grp[-1]}" if len(grp) > 1 else f"{grp[0]}"
        env = dict(CPU_ENV, VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE=str(settings.cpu_kvcache_gib))
        slots.append(EngineSlot(len(slots), "cpu", bind, 1, tuple(sorted(env.items()))))
    return slots


# ---------------------------------------------------------------------------------------------
# Garbage-collector pauses
# ---------------------------------------------------------------------------------------------


class GcPauseMonitor:
    """Measures every garbage-collection pause of this process through ``gc.callbacks``.

    ``freeze()`` collects once and moves every object alive at that moment (model, engine,
    imported modules) into the permanent generation (``gc.freeze``), so later collections only
    walk objects created during inference; ``unfreeze()`` undoes it (call it before the engine
    shuts down, so the engine's objects can be collected again). ``stats()`` gives the count,
    the total and the largest pause, overall and per generation.
    """

    def __init__(self, name: str):
        self.name = name
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.max_gen: Optional[int] = None
        self.frozen_objects = 0
        self.freeze_s = 0.0
        self._t0: Optional[float] = None
        self._installed = False

    def install(self) -> "GcPauseMonitor":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        self.count += 1
        self.total_s += dt
        if dt > self.max_s:
            self.max_s = dt
            self.max_gen = info.get("generation")

    def freeze(self) -> int:
        """Collect, freeze, and restart the statistics (the freeze's own full collection is kept
        apart as ``freeze_ms``, so that ``max_pause_ms`` describes the pauses after start-up)."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.freeze_s = time.perf_counter() - t0
        self.count, self.total_s, self.max_s, self.max_gen = 0, 0.0, 0.0, None
        self.frozen_objects = gc.get_freeze_count()
        return self.frozen_objects

    @staticmethod
    def unfreeze() -> None:
        gc.unfreeze()

    def stats(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "collections": self.count, "total_ms": round(self.total_s * 1e3, 3),
                "max_pause_ms": round(self.max_s * 1e3, 3), "max_pause_generation": self.max_gen,
                "frozen_objects": self.frozen_objects, "freeze_ms": round(self.freeze_s * 1e3, 3)}


# ---------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------


def kv_cache_capacity(cache_config) -> dict:
    """The KV cache vLLM allocated, as it reports it: ``{"blocks", "block_size", "tokens", "tokens_from"}``.

    ``blocks`` is ``cache_config.num_gpu_blocks`` (device blocks: GPU memory, or the CPU backend's
    ``VLLM_CPU_KVCACHE_SPACE``), ``block_size`` tokens per block, ``tokens`` vLLM's own
    ``kv_cache_size_tokens`` (the "KV cache size: N tokens" of its log) where it has one
    (``tokens_from="vllm"``), else blocks x block size (``"blocks"``). ``None``: not known.
    """
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    bs = getattr(cache_config, "block_size", None)
    tokens, source = getattr(cache_config, "kv_cache_size_tokens", None), "vllm"
    if tokens is None and blocks is not None and bs is not None:
        tokens, source = int(blocks) * int(bs), "blocks"
    return {"blocks": None if blocks is None else int(blocks), "block_size": None if bs is None else int(bs),
            "tokens": None if tokens is None else int(tokens), "tokens_from": None if tokens is None else source}


def _read_back(llm, vllm_mod, torch_mod, slot: EngineSlot) -> dict:
    """What the running engine really uses, plus device identity and KV-cache capacity."""
    cfg = llm.llm_engine.vllm_config
    mc, cc, sc, lc = cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.load_config
    info = {
        "engine": slot.index,
        "pid": os.getpid(),
        "vllm_version": vllm_mod.__version__,
        "torch_version": torch_mod.__version__,
        "engine_args": {
            "model": mc.model,
            "dtype": str(mc.dtype).replace("torch.", ""),
            "max_model_len": mc.max_model_len,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "long_prefill_token_threshold": getattr(sc, "long_prefill_token_threshold", None),
            "enable_chunked_prefill": getattr(sc, "enable_chunked_prefill", None),
            "gpu_memory_utilization": getattr(cc, "gpu_memory_utilization", None),
            "kv_cache_dtype": str(cc.cache_dtype),
            "quantization": mc.quantization,
            "load_format": str(lc.load_format),
            "enforce_eager": bool(mc.enforce_eager),
            "seed": mc.seed,
            "block_size": cc.block_size,
        },
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "kv_cache": kv_cache_capacity(cc),
        "device": {"kind": slot.kind, "slot": slot.device},
    }
    if slot.kind == "cuda":
        props = torch_mod.cuda.get_device_properties(0)
        info["device"].update(name=props.name, uuid=f"GPU-{props.uuid}" if hasattr(props, "uuid") else None,
                              gpu_share=slot.gpu_share)
    else:
        info["device"].update(name=_cpu_name(), uuid=None)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


ENGINE_LOG_TAIL_LINES = 20


def engine_log_path(log_dir: str | os.PathLike, index: int | str) -> Path:
    """``log_dir/engine-<index>.log``: where engine ``index`` writes its console output."""
    return Path(log_dir) / f"engine-{index}.log"


def log_tail(path: Optional[Path], lines: int = ENGINE_LOG_TAIL_LINES, max_chars: int = 400) -> str:
    """The last ``lines`` non-empty lines of ``path`` (each cut to ``max_chars``); '' if none or unreadable."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - lines * max_chars * 2))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln[:max_chars] for ln in text.splitlines() if ln.strip()][-lines:]
    return "\n".join(kept)


def _redirect_output(path: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, inherited by vLLM's own
    child processes) at ``path``, appending, line-buffered."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):  # not a TextIOWrapper (e.g. replaced by a test runner)
            pass


class _Terminated(BaseException):
    """SIGTERM in an engine worker that shares its parent's process group."""


def _raise_terminated(*_):
    raise _Terminated()


def _worker_main(conn: mpc.Connection, settings: EngineSettings, gen: GenerationSettings, slot: EngineSlot,
                 own_process_group: bool = True, gc_freeze: bool = False, detail: bool = False,
                 log_path: Optional[Path] = None, stream: bool = False) -> None:
    """Entry point of an engine worker process (spawned).

    ``own_process_group``: start a new process group (the standalone SUT ends vLLM's children
    with one killpg); False keeps the worker in its parent's group, so that whoever ends the
    parent's group (Flame's executor manager at unbind) ends the engine too.
    ``gc_freeze``: after start-up, ``gc.freeze()`` the heap and time every GC pause; the largest
    pause is logged at shutdown and reported on a ``("stats",)`` request.
    ``detail``: per-request timings and cached-token counts in every result (see ``_serve``);
    only the synthetic-locality entry point turns it on.
    ``log_path``: stdout and stderr (vLLM's logs, warnings, tracebacks) go to this file, before vLLM
    is imported; None keeps the parent's.
    ``stream``: report each request's first generated token from the step that produced it (Server
    and Interactive scenarios; see ``_serve``).
    """
    if log_path is not None:
        _redirect_output(log_path)
    if own_process_group:
        os.setpgrp()  # own process group: the parent ends vLLM's children with one killpg
    else:
        signal.signal(signal.SIGTERM, _raise_terminated)  # the group's SIGTERM: clean exit through `finally`
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(dict(slot.env))
    try:  # show up as sut-engine-N in ps/top (setproctitle comes with vLLM)
        import setproctitle

        setproctitle.setproctitle(f"sut-engine-{slot.index} ({slot.kind}:{slot.device})")
    except Exception:  # noqa: BLE001 - cosmetic only
        pass
    gcmon = GcPauseMonitor(f"engine-{slot.index}")
    try:
        import torch
        import vllm
        from vllm import LLM

        llm = LLM(**settings.vllm_kwargs(slot.gpu_share))
        engine = llm.llm_engine
        params = gen.sampling_params()
        info = _read_back(llm, vllm, torch, slot)
        if gc_freeze:
            gcmon.install()
            info["gc_frozen_objects"] = gcmon.freeze()
        conn.send(("ready", info))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", f"engine {slot.index} failed to start:\n{traceback.format_exc()}"))
        return
    try:
        _serve(conn, engine, params, gcmon.stats, llm=llm, detail=detail, stream=stream)
    except (EOFError, BrokenPipeError, _Terminated):
        pass  # parent is gone, or the shared process group is being ended
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("error", f"engine {slot.index} failed:\n{traceback.format_exc()}"))
        except (OSError, EOFError):
            pass
    finally:
        if gc_freeze:
            gcmon.unfreeze()  # before the engine's objects are released
            gcmon.uninstall()
            st = gcmon.stats()
            print(f"engine {slot.index} (pid {os.getpid()}): largest GC pause {st['max_pause_ms']:.1f} ms "
                  f"(generation {st['max_pause_generation']}), {st['collections']} collections, "
                  f"{st['total_ms']:.0f} ms in total", flush=True)
        try:
            del llm
        except Exception:  # noqa: BLE001
            pass


def _serve(conn: mpc.Connection, engine, params, stats_fn: Optional[Callable[[], dict]] = None, llm=None,
           detail: bool = False, stream: bool = False) -> None:
    """The hot loop: the same add_request/step cycle as ``LLM.generate``, fed from a pipe.

    Messages in: ("gen", [(request_id, int32 prompt), ...]), ("stats",), ("reset_cache",) and ("stop",).
    Messages out: ("done", [(request_id, int32 output ids), ...]) after each step that finishes
    requests; ("stats", dict) in answer to ("stats",) and to ("reset_cache",) (which empties
    vLLM's prefix cache: ``{"reset_prefix_cache": bool}``). ("raw", [...]) runs one plain
    ``LLM.generate`` over the batch on an idle engine and answers ("raw_done", (seconds, [...]))
    — the baseline the overhead benchmark compares the SUT against.

    ``detail`` (synthetic-locality traces only; never in MLPerf runs): outputs are streamed as
    deltas so the first token is seen, and each result is ``(request_id, ids, info)`` with
    ``info = {"ttft_s", "e2e_s", "cached_tokens"}`` (seconds from ``add_request``; prompt tokens
    vLLM served from its prefix cache).

    ``stream`` (Server / Interactive scenarios): outputs are streamed as deltas (vLLM
    ``RequestOutputKind.DELTA``); after each step, ("first", [(request_id, first id), ...]) for the
    requests whose first token that step produced, sent before that step's ("done", ...), whose ids
    are the whole generated sequence (so it starts with the reported first id). Offline (``stream``
    False) keeps vLLM's ``FINAL_ONLY`` outputs: no per-step output objects.
    """
    if stream and detail:
        raise ValueError("stream and detail are exclusive")
    if stream:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        streamed: dict[str, list] = {}
    if detail:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        t_add: dict[str, float] = {}
        t_first: dict[str, float] = {}
        acc: dict[str, list] = {}
    while True:
        # Stage 1: intake. Block only when nothing is running.
        busy = engine.has_unfinished_requests()
        if conn.poll(0 if busy else None):
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    conn.send(("stats", stats_fn() if stats_fn else {}))
                    if not conn.poll(0):
                        break
                    continue
                if msg[0] == "reset_cache":
                    ok = bool(engine.reset_prefix_cache()) if not engine.has_unfinished_requests() else False
                    conn.send(("stats", {"reset_prefix_cache": ok}))
                    if not conn.poll(0):
                        break
                    continue
                if msg[0] == "raw":
                    conn.send(("raw_done", _raw_generate(llm, params, msg[1])))
                    if not conn.poll(0):
                        break
                    continue
                for rid, prompt in msg[1]:
                    engine.add_request(str(rid), {"prompt_token_ids": prompt.tolist()}, params)
                    if detail:
                        t_add[str(rid)] = time.monotonic()
                if not conn.poll(0):
                    break
        # Stage 2: one engine step.
        if not engine.has_unfinished_requests():
            continue
        outs = engine.step()
        # Stage 3: return finished requests.
        if stream:
            first, done = _stream_results(outs, streamed)
            if first:
                conn.send(("first", first))
        elif detail:
            done = _detail_results(outs, t_add, t_first, acc)
        else:
            done = [(int(o.request_id), np.asarray(o.outputs[0].token_ids, dtype=np.int32)) for o in outs if o.finished]
        if done:
            conn.send(("done", done))


def _stream_results(outs, acc: dict) -> tuple[list, list]:
    """Delta outputs of one step → ``(first, done)``: ``[(request_id, first generated id)]`` of the
    requests that got their first token in this step, and the finished ``[(request_id, int32 ids)]``
    (the whole sequence). ``acc`` holds each running request's ids so far (see ``_serve``)."""
    first, done = [], []
    for o in outs:
        rid = o.request_id
        ids = o.outputs[0].token_ids if o.outputs else ()
        seen = acc.get(rid)
        if seen is None:
            if not len(ids) and not o.finished:
                continue  # a prefill chunk: no token yet
            seen = acc[rid] = []
            if len(ids):
                first.append((int(rid), int(ids[0])))
        seen.extend(ids)
        if o.finished:
            done.append((int(rid), np.asarray(acc.pop(rid), dtype=np.int32)))
    return first, done


def _detail_results(outs, t_add: dict, t_first: dict, acc: dict) -> list:
    """Delta outputs of one step → finished ``(request_id, ids, info)`` (see ``_serve``)."""
    now = time.monotonic()
    done = []
    for o in outs:
        rid = o.request_id
        ids = o.outputs[0].token_ids
        if ids and rid not in t_first:
            t_first[rid] = now
        acc.setdefault(rid, []).extend(ids)
        if o.finished:
            t0 = t_add.pop(rid, now)
            info = {"ttft_s": t_first.pop(rid, now) - t0, "e2e_s": now - t0,
                    "cached_tokens": int(getattr(o, "num_cached_tokens", 0) or 0)}
            done.append((int(rid), np.asarray(acc.pop(rid), dtype=np.int32), info))
    return done


def _raw_generate(llm, params, batch) -> tuple[float, list]:
    """One ``LLM.generate`` over ``[(request id, int32 prompt)]``; returns (seconds, results)."""
    from vllm.inputs import TokensPrompt

    if llm is None or llm.llm_engine.has_unfinished_requests():
        raise EngineError("raw generate needs an idle engine")
    prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for _, p in batch]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [(rid, np.asarray(o.outputs[0].token_ids, dtype=np.int32)) for (rid, _), o in zip(batch, outs)]


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


DoneCallback = Callable[[int, list], None]  # (engine index, [(request_id, int32 ids), ...])
FatalCallback = Callable[[str], None]


class EngineHandle:
    """Parent-side handle of one engine worker: start, submit, watch, shut down."""

    def __init__(self, slot: EngineSlot, settings: EngineSettings, gen: GenerationSettings,
                 own_process_group: bool = True, gc_freeze: bool = False, detail: bool = False, stream: bool = False):
        self.slot, self.settings, self.gen = slot, settings, gen
        self.stream = stream
        self.own_process_group = own_process_group
        self.gc_freeze = gc_freeze
        self.detail = detail
        self.info: dict = {}
        self.outstanding_tokens = 0
        self.samples_done = 0
        self._conn: Optional[mpc.Connection] = None
        self._proc: Optional[mp.Process] = None
        self._send_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._stopping = False
        self._on_done: Optional[DoneCallback] = None
        self._on_fatal: Optional[FatalCallback] = None
        self._on_stats: Optional[Callable[[dict], None]] = None
        self._on_first: Optional[DoneCallback] = None
        self._raw: "queue.Queue" = queue.Queue()
        self.log_path: Optional[Path] = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def start(self, log_path: Optional[Path] = None) -> None:
        """Spawn the worker. ``log_path``: its stdout/stderr (vLLM's output) go to this file, which
        gets a header line first; None = the parent's stdout/stderr. Raises ``EngineError`` if the
        file cannot be written."""
        if log_path is not None:
            log_path = Path(log_path)
            try:
                with open(log_path, "a") as fh:
                    fh.write(f"engine {self.slot.index} ({self.slot.kind}:{self.slot.device}): vLLM's own output "
                             f"(worker and its child processes), {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            except OSError as e:
                raise EngineError(f"engine {self.slot.index}: cannot write its log {log_path}: {e.strerror}") from None
        self.log_path = log_path
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._conn = parent
        self._proc = ctx.Process(target=_worker_main, args=(child, self.settings, self.gen, self.slot,
                                                            self.own_process_group, self.gc_freeze, self.detail,
                                                            log_path, self.stream),
                                 name=f"vllm-engine-{self.slot.index}", daemon=False)
        self._proc.start()
        child.close()

    def failure(self, msg: str) -> str:
        """``msg`` with the last lines of the engine log (when there is one) after its first line, so
        the console shows why an engine died and still ends with the worker's own traceback, if any;
        ``msg`` itself is then appended to the log, which thus holds the whole story."""
        if self.log_path is None:
            return msg
        tail = log_tail(self.log_path)
        try:
            with open(self.log_path, "a") as fh:
                fh.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        except OSError:
            pass
        first, _, rest = msg.partition("\n")
        tail = tail or "(empty)"
        out = f"{first}\n--- last lines of {self.log_path} ---\n{tail}\n--- end of {self.log_path.name} ---"
        return f"{out}\n{rest}" if rest else out

    def wait_ready(self, timeout: float) -> dict:
        """Block until the worker reports ready; raise ``EngineError`` on failure or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(self.failure(f"engine {self.slot.index} not ready after {timeout:.0f} s"))
            ready = mpc.wait([self._conn, self._proc.sentinel], timeout=left)
            if self._conn in ready:
                try:
                    kind, payload = self._conn.recv()
                except EOFError:
                    self._proc.join(1)
                    raise EngineError(self.failure(f"engine {self.slot.index} exited during start-up "
                                                   f"(code {self._proc.exitcode})")) from None
                if kind == "ready":
                    self.info = payload
                    return payload
                raise EngineError(self.failure(payload))
            if self._proc.sentinel in ready:
                self._proc.join(1)
                raise EngineError(self.failure(f"engine {self.slot.index} exited during start-up "
                                               f"(code {self._proc.exitcode})"))

    def watch(self, on_done: DoneCallback, on_fatal: FatalCallback,
              on_stats: Optional[Callable[[dict], None]] = None, on_first: Optional[DoneCallback] = None) -> None:
        """Route results to ``on_done`` and death/errors to ``on_fatal`` (reported within milliseconds).

        ``on_stats`` receives the worker's answer to :meth:`request_stats`; ``on_first`` a streaming
        worker's first tokens ``(engine index, [(request_id, first id)])``, always before the
        ``on_done`` call of the same requests (one thread, in the worker's order). The watcher thread
        starts on the first call; later calls only swap the callbacks (a benchmark runs several
        SUTs over one pool).
        """
        self._on_done, self._on_fatal, self._on_stats, self._on_first = on_done, on_fatal, on_stats, on_first
        if self._watcher is not None:
            return

        def fatal(msg: str) -> None:
            msg = self.failure(msg)
            self._raw.put(EngineError(msg))
            if self._on_fatal is not None:
                self._on_fatal(msg)

        def loop():
            while True:
                ready = mpc.wait([self._conn, self._proc.sentinel])
                if self._conn in ready:
                    try:
                        kind, payload = self._conn.recv()
                    except (EOFError, OSError):
                        kind, payload = "eof", None
                    if kind == "done":
                        self._on_done(self.slot.index, payload)
                        continue
                    if kind == "first":
                        if self._on_first is not None:
                            self._on_first(self.slot.index, payload)
                        continue
                    if kind == "stats":
                        if self._on_stats is not None:
                            self._on_stats(payload)
                        continue
                    if kind == "raw_done":
                        self._raw.put(payload)
                        continue
                    if self._stopping:
                        return
                    if kind == "error":
                        fatal(payload)
                        return
                if self._stopping:
                    return
                self._proc.join(2)
                fatal(f"engine {self.slot.index} (pid {self._proc.pid}) exited unexpectedly with code {self._proc.exitcode}")
                return

        self._watcher = threading.Thread(target=loop, name=f"engine-{self.slot.index}-watch", daemon=True)
        self._watcher.start()

    def raw_generate_start(self, batch: Sequence[tuple[int, np.ndarray]]) -> None:
        """Ask the idle worker for one plain ``LLM.generate`` over ``batch`` (see ``raw_generate_result``)."""
        with self._send_lock:
            self._conn.send(("raw", list(batch)))

    def raw_generate_result(self, timeout: float = 3600.0) -> tuple[float, list]:
        """``(generate seconds, [(request id, int32 ids)])`` of the raw batch; needs ``watch`` running."""
        res = self._raw.get(timeout=timeout)
        if isinstance(res, Exception):
            raise res
        return res

    def submit(self, batch: Sequence[tuple[int, np.ndarray]]) -> None:
        """Send ``(request_id, int32 prompt)`` pairs to the worker. Raises ``EngineError`` if it is gone."""
        try:
            with self._send_lock:
                self._conn.send(("gen", list(batch)))
        except (OSError, BrokenPipeError) as e:
            raise EngineError(f"engine {self.slot.index} is gone: {e}") from None

    def reset_prefix_cache(self) -> None:
        """Ask the idle worker to empty vLLM's prefix cache; the answer (``{"reset_prefix_cache": ok}``)
        goes to ``watch``'s ``on_stats``."""
        try:
            with self._send_lock:
                self._conn.send(("reset_cache",))
        except (OSError, BrokenPipeError) as e:
            raise EngineError(f"engine {self.slot.index} is gone: {e}") from None

    def request_stats(self) -> None:
        """Ask the worker for its GC statistics; the answer goes to ``watch``'s ``on_stats``."""
        try:
            with self._send_lock:
                self._conn.send(("stats",))
        except (OSError, BrokenPipeError) as e:
            raise EngineError(f"engine {self.slot.index} is gone: {e}") from None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the worker and end its process group, or only the worker when it shares its
        parent's group (SIGTERM, then SIGKILL)."""
        self._stopping = True
        if self._proc is None or self._proc.pid is None:  # never started (or its start raised)
            return
        if self._proc.is_alive():
            try:
                with self._send_lock:
                    self._conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
            self._proc.join(timeout)
        if not self.own_process_group:
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            if self._conn is not None:
                self._conn.close()
            return
        pgid = self._proc.pid
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        self._proc.join(5)
        if self._conn is not None:
            self._conn.close()


class EnginePool:
    """All engines of a run, started in parallel; refuses prefix caching in MLPerf mode.

    Args:
        settings: engine settings shared by all engines.
        gen: sampling settings.
        allow_prefix_caching: only the synthetic-locality entry point passes True.
        start_timeout_s: how long a start may take before the run fails.
        gc_freeze: freeze each worker's heap after start-up and time its GC pauses (as the Flame
            service's engine does); off by default.
        detail: per-request TTFT, latency and cached-token counts in results (synthetic-locality
            entry point only; needs ``allow_prefix_caching``).
        stream: engines report each request's first token as soon as the step that made it returns
            (``watch(on_first=...)``; Server and Interactive scenarios).
    """

    def __init__(self, settings: EngineSettings, gen: GenerationSettings, allow_prefix_caching: bool = False,
                 start_timeout_s: float = 1800.0, gc_freeze: bool = False, detail: bool = False, stream: bool = False):
        if settings.enable_prefix_caching and not allow_prefix_caching:
            raise EngineError("enable_prefix_caching=True is not allowed in an MLPerf run (cross-query KV reuse is prohibited)")
        self.settings, self.gen = settings, gen
        self.allow_prefix_caching = allow_prefix_caching
        self.start_timeout_s = start_timeout_s
        self.slots = plan_engines(settings)
        if detail and not allow_prefix_caching:
            raise EngineError("per-request detail results are for the synthetic-locality entry point only")
        self.engines = [EngineHandle(s, settings, gen, gc_freeze=gc_freeze, detail=detail, stream=stream)
                        for s in self.slots]

    def __len__(self) -> int:
        return len(self.engines)

    def start(self, log_dir: Optional[str | os.PathLike] = None) -> list[dict]:
        """Start every engine and wait for all; on any failure shut all down and raise ``EngineError``
        (its message ends with the failing engine's last log lines).

        ``log_dir``: engine N's stdout/stderr (vLLM's logs and warnings) go to ``log_dir/engine-N.log``;
        None = the console.
        """
        t0 = time.monotonic()
        log.info("starting %d engine(s): %s", len(self.engines), [(s.kind, s.device) for s in self.slots])
        if log_dir is not None:
            log.info("vLLM's own output (logs, warnings) goes to %s (--verbose: to the console)",
                     engine_log_path(log_dir, 0 if len(self.engines) == 1 else "N"))
        # Engines on different devices start together; engines sharing one GPU start one after
        # the other, so that each one's memory profiling sees the previous one's final footprint.
        by_device: dict[str, list[EngineHandle]] = {}
        for e in self.engines:
            by_device.setdefault(f"{e.slot.kind}:{e.slot.device}", []).append(e)
        waves = [[grp[i] for grp in by_device.values() if i < len(grp)] for i in range(max(map(len, by_device.values())))]
        try:
            for wave in waves:
                for e in wave:
                    e.start(None if log_dir is None else engine_log_path(log_dir, e.slot.index))
                for e in wave:
                    e.wait_ready(self.start_timeout_s)
            infos = [e.info for e in self.engines]
        except BaseException:
            self.shutdown()
            raise
        for info in infos:
            if info["enable_prefix_caching"] and not self.allow_prefix_caching:
                self.shutdown()
                raise EngineError(f"engine {info['engine']} reports enable_prefix_caching=True; refusing to run")
        log.info("engines ready in %.1f s", time.monotonic() - t0)
        return infos

    def shutdown(self) -> None:
        threads = [threading.Thread(target=e.shutdown) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def least_loaded(self) -> EngineHandle:
        """The engine with the fewest outstanding tokens (prompt + max new tokens)."""
        return min(self.engines, key=lambda e: e.outstanding_tokens)

    def describe(self) -> list[dict]:
        return [dict(e.info, samples=e.samples_done) for e in self.engines]


def settings_from_mapping(cls, values: dict):
    """Build a frozen settings dataclass from a mapping (a preset section plus flags).

    Raises ``ValueError`` naming the field for an unknown key or a value of the wrong type (a
    preset's ``max_samples = "4"`` is refused, not coerced); ints are accepted where a float is due.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    hints = typing.get_type_hints(cls)
    for key, val in values.items():
        want = hints.get(key)
        args = typing.get_args(want)
        if val is None and type(None) in args:
            continue
        kinds = tuple(a for a in args if a is not type(None)) or (want,)
        ok = any(_is_kind(val, k) for k in kinds)
        if not ok and all(k in (int, float, bool, str) for k in kinds):
            names_ = " or ".join({int: "an integer", float: "a number", bool: "true/false", str: "a string"}[k]
                                 for k in kinds)
            raise ValueError(f"{cls.__name__}.{key} must be {names_}, got {val!r} ({type(val).__name__})")
    return cls(**values)


def _is_kind(val, kind) -> bool:
    if kind is bool:
        return isinstance(val, bool)
    if kind is int:
        return isinstance(val, int) and not isinstance(val, bool)
    if kind is float:
        return isinstance(val, (int, float)) and not isinstance(val, bool)
    if kind is str:
        return isinstance(val, str)
    return True
