"""Where engines run: one ``EngineSlot`` per visible GPU x ``engines_per_device``, or CPU core groups.

``plan_engines`` reads the visible GPUs (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``); a worker
pins itself with its slot's ``env`` (``CUDA_VISIBLE_DEVICES``, or the vLLM CPU thread binding and
``CPU_ENV``). The slot order is the replica order of every transport (the same GPU serves replica
``r`` on the local and the flame transport).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sut.engine.settings import EngineSettings
from sut.errors import EngineError


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
    _check_cpu_kv_memory(settings, k)
    groups = np.array_split(np.array(cores), k)
    for grp in groups:
        bind = f"{grp[0]}-{grp[-1]}" if len(grp) > 1 else f"{grp[0]}"
        env = dict(CPU_ENV, VLLM_CPU_OMP_THREADS_BIND=bind)
        if settings.kv_cache_memory_bytes is None:  # vLLM's CPU platform lets this replace kv_cache_memory_bytes
            env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kvcache_gib)
        slots.append(EngineSlot(len(slots), "cpu", bind, 1, tuple(sorted(env.items()))))
    return slots


def _check_cpu_kv_memory(settings: EngineSettings, engines: int) -> None:
    """``EngineError`` when the CPU engines' KV caches (``engines x cpu_kvcache_gib`` GiB, or
    ``kv_cache_memory_bytes`` each) exceed the host's physical memory: vLLM refuses each engine only after it
    started ("less than requested"). Hosts whose memory size cannot be read are not checked."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    each = settings.kv_cache_memory_bytes or settings.cpu_kvcache_gib * 2 ** 30
    what = (f"kv_cache_memory_bytes {settings.kv_cache_memory_bytes}" if settings.kv_cache_memory_bytes
            else f"cpu_kvcache_gib {settings.cpu_kvcache_gib}")
    if host > 0 and engines * each > host:
        raise EngineError(f"{engines} CPU engine(s) x {what} = {engines * each / 2 ** 30:,.1f} GiB of KV cache, more "
                          f"than this host's {host / 2 ** 30:,.1f} GiB of memory")


def default_step_tokens(kind: str, memory_mib: float = 0.0, name: str = "", server: bool = False) -> int:
    """vLLM's per-step token budget when ``max_num_batched_tokens`` is unset, for one engine (tensor parallel 1)
    on a ``kind`` ("cpu" / "cuda") device of ``memory_mib`` MiB named ``name``: ``vllm.LLM`` (the harness's
    engines), or ``vllm serve`` when ``server``. Source: ``EngineArgs.get_batch_defaults`` (vLLM 0.26-0.32):
    CPU 4,096 / 2,048; a GPU of >= 160 GiB 16,384 / 16,384; >= 70 GiB (not an A100) 16,384 / 8,192; else 8,192 /
    2,048."""
    if kind == "cpu":
        return 2048 if server else 4096
    if memory_mib >= 160 * 1024:
        return 16384
    if memory_mib >= 70 * 1024 and "a100" not in name.lower():
        return 8192 if server else 16384
    return 2048 if server else 8192


def _gpu_memory(devices: list[str]) -> list[tuple[float, str]]:
    """``(memory MiB, name)`` of each GPU in ``devices`` (indices or UUIDs as ``plan_engines`` gives them) by
    ``nvidia-smi``; [] when it cannot tell (the check that uses it is then skipped)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,name",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    rows = [[f.strip() for f in line.split(",", 3)] for line in out.splitlines() if line.count(",") >= 3]
    try:
        found = [(float(mem), name) for idx, uuid, mem, name in rows if idx in devices or uuid in devices]
    except ValueError:
        return []
    return found if len(found) == len(set(devices)) else []


def check_step_budget(settings: EngineSettings, slots: list[EngineSlot], server: bool = False) -> None:
    """``EngineError`` when ``max_num_batched_tokens`` is unset and ``max_num_seqs`` exceeds the budget vLLM
    would pick on these slots (``default_step_tokens``, at least ``max_model_len`` with chunked prefill off): vLLM
    refuses a budget below ``max_num_seqs`` only once the engine has started. GPUs whose memory ``nvidia-smi``
    cannot tell are not checked."""
    if settings.max_num_batched_tokens is not None or not slots:
        return
    if slots[0].kind == "cpu":
        budget = default_step_tokens("cpu", server=server)
    else:
        gpus = _gpu_memory(sorted({s.device for s in slots}))
        if not gpus:
            return
        budget = min(default_step_tokens("cuda", mem, name, server) for mem, name in gpus)
    if settings.enable_chunked_prefill is False:  # vLLM then raises its default to a whole prompt's length
        budget = max(budget, settings.max_model_len)
    if settings.max_num_seqs > budget:
        raise EngineError(f"max_num_seqs {settings.max_num_seqs} with max_num_batched_tokens unset: vLLM's default "
                          f"per-step budget here is {budget:,} tokens ({'vllm serve' if server else 'vllm.LLM'} on "
                          f"{slots[0].kind}), below max_num_seqs, which vLLM refuses once the engine starts; give "
                          f"--max-num-batched-tokens >= {settings.max_num_seqs} (in a preset: [engine] "
                          "max_num_batched_tokens)")


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo ("cpu" when it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
