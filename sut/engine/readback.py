"""What a running engine really uses, read back from vLLM: engine arguments, prefix caching, device
identity and KV-cache capacity (the record ``run.json`` lists under ``engines``; a transport's
``ReplicaRecord.info``)."""

from __future__ import annotations

import os
from typing import Optional

from sut.engine.devices import EngineSlot, cpu_name


def kv_cache_capacity(cache_config) -> dict:
    """The KV cache vLLM allocated: ``{"blocks", "block_size", "tokens", "tokens_from", "vllm_tokens"}``.

    ``blocks`` is ``cache_config.num_gpu_blocks`` (device blocks: GPU memory, or the CPU backend's
    ``VLLM_CPU_KVCACHE_SPACE``), ``block_size`` tokens per block, ``tokens`` blocks x block size
    (``tokens_from="blocks"``: what the cache holds, the figure a working set is sized against), else vLLM's
    own ``kv_cache_size_tokens`` (``"vllm"``). ``vllm_tokens`` is that figure as vLLM reports it (the "KV cache
    size: N tokens" of its log), kept beside: vLLM derives it from the concurrency a ``max_model_len`` request
    gets (its blocks rounded up per request), so it reads below blocks x block size when ``max_model_len`` is no
    multiple of the block size (4,096 blocks x 128 at max_model_len 408: 506,538, not 524,288; at the
    eviction preset's 8K documents on a GPU, 65,514 for 65,536). ``None``: not known.
    """
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    bs = getattr(cache_config, "block_size", None)
    reported = getattr(cache_config, "kv_cache_size_tokens", None)
    tokens, source = reported, "vllm"
    if blocks is not None and bs is not None:
        tokens, source = int(blocks) * int(bs), "blocks"
    return {"blocks": None if blocks is None else int(blocks), "block_size": None if bs is None else int(bs),
            "tokens": None if tokens is None else int(tokens), "tokens_from": None if tokens is None else source,
            "vllm_tokens": None if reported is None else int(reported)}


def kv_bytes_per_block(cfg, torch_mod) -> Optional[int]:
    """Bytes one KV-cache block takes over all layers: ``2 (K and V) x block_size x KV heads x head size x
    element size x layers`` (vLLM's full-attention page size, ``FullAttentionSpec.page_size_bytes``, times
    the layers); the element size is the KV cache dtype's (``auto``: the model's). None when vLLM's
    config does not give one of these (another vLLM, another attention kind)."""
    try:
        mc, cc, pc = cfg.model_config, cfg.cache_config, cfg.parallel_config
        try:
            from vllm.utils.torch_utils import get_kv_cache_torch_dtype
        except ImportError:  # older vLLM
            from vllm.utils import get_kv_cache_torch_dtype
        elem = torch_mod.empty((), dtype=get_kv_cache_torch_dtype(cc.cache_dtype, mc.dtype)).element_size()
        per_layer = 2 * int(cc.block_size) * int(mc.get_num_kv_heads(pc)) * int(mc.get_head_size()) * elem
        return per_layer * int(mc.get_num_layers(pc))
    except (ImportError, AttributeError, TypeError, ValueError, KeyError):
        return None


def read_back(llm, vllm_mod, torch_mod, slot: EngineSlot) -> dict:
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
        "kv_cache": dict(kv_cache_capacity(cc), bytes_per_block=kv_bytes_per_block(cfg, torch_mod)),
        "device": {"kind": slot.kind, "slot": slot.device},
    }
    if slot.kind == "cuda":
        props = torch_mod.cuda.get_device_properties(0)
        info["device"].update(name=props.name, uuid=f"GPU-{props.uuid}" if hasattr(props, "uuid") else None,
                              gpu_share=slot.gpu_share)
    else:
        info["device"].update(name=cpu_name(), uuid=None)
    return info
