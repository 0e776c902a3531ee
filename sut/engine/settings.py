"""Engine and sampling settings, model facts, and typed settings from a mapping.

``EngineSettings``: one frozen dataclass of vLLM engine settings shared by every engine of a run
(``vllm_kwargs`` gives ``vllm.LLM``'s keyword arguments). Knobs: model, dtype, max_model_len,
max_num_seqs, max_num_batched_tokens (the per-step token budget, which caps the prefill tokens of
one step: vLLM's chunked prefill), long_prefill_token_threshold (a prompt longer than this is
prefilled at most this many tokens per step; vLLM's ``SchedulerConfig``; 0/None = no cap),
enable_chunked_prefill (None = vLLM's default, on), gpu_memory_utilization (split evenly between
engines sharing one GPU), kv_cache_dtype, quantization, load_format (``dummy`` = random weights from
config.json), enforce_eager, seed, enable_prefix_caching (must stay False for MLPerf: the one guard
is ``sut.core.guard``), device (auto/cuda/cpu), engines_per_device, cpu_kvcache_gib,
num_gpu_blocks_override (a fixed number of KV-cache blocks per engine instead of what memory allows:
vLLM's ``CacheConfig.num_gpu_blocks_override``, used on the CPU backend too; None = vLLM's own),
kv_cache_memory_bytes (each engine's KV cache in bytes, no memory profiling: vLLM's
``CacheConfig.kv_cache_memory_bytes``, on the CPU backend in place of ``VLLM_CPU_KVCACHE_SPACE``; engines sharing a
GPU then start together, as no profiling can see another's allocations; None = sized by profiling),
admit_every_steps (the harness's engine loop, not vLLM's: while an engine is busy, new requests are added only
every N engine steps and only into free slots, ``max_num_seqs`` less the unfinished ones, so that the prefills
of Server's arrivals share fewer, larger steps with decode-only steps between, as Offline's do; an idle engine
admits at once; 1 (the default) = every step, as ``LLM.generate``; in-process engines and Flame services only:
``vllm serve`` runs its own loop).

``check_engine_settings`` (run when an ``EngineSettings`` is built): ``ValueError`` naming the field and
its flag for a value vLLM would refuse only once an engine starts (``--dtype float33``,
``--cpu-kvcache-gib -1``, ``--gpu-memory-utilization 1.5``, ...).

``GenerationSettings``: the reference SUT's sampling. ``read_model_info``: vocabulary size, EOS ids
and config hash of a HF model folder. ``settings_from_mapping``: a frozen settings dataclass from a
preset section plus flags, typed (no string coercion).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accuracy.jsontext import parse_json
from sut.constants import MAX_NEW_TOKENS, MIN_NEW_TOKENS
from sut.engine import vllm_names
from sut.errors import EngineError

#: Largest engine seed vLLM takes (its check: "Seed must be between 0 and 2**32 - 1").
MAX_SEED = 2**32 - 1

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
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    admit_every_steps: int = 1

    def __post_init__(self):
        """Refuse a value vLLM would refuse only after an engine started (``ValueError`` naming the field
        and its flag): see :func:`check_engine_settings`."""
        check_engine_settings(self)

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
        if self.num_gpu_blocks_override is not None:
            kw["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        if self.kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        util = self.gpu_memory_utilization
        if util is None and gpu_share > 1:
            util = 0.90  # engines sharing a GPU must split it explicitly
        if util is not None:
            kw["gpu_memory_utilization"] = round(util / gpu_share, 4)
        return kw


#: vLLM's ``--dtype`` choices: ``ModelDType`` in vllm/config/model.py (vllm-cpu 0.32.0; tests check the installed vLLM).
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
#: Engine fields that must be integers >= 1 when set (None: vLLM's default).
_POSITIVE_INTS = ("max_num_seqs", "max_num_batched_tokens", "engines_per_device", "cpu_kvcache_gib",
                  "num_gpu_blocks_override", "kv_cache_memory_bytes", "admit_every_steps")
#: Engine fields that must be non-empty strings when set (vLLM checks the value itself: its lists
#: change between releases and plugins add to them).
_NAMES = ("model", "kv_cache_dtype", "load_format", "quantization")


def _field_error(name: str, rule: str, value) -> ValueError:
    return ValueError(f"engine setting {name} must be {rule}, got {value!r} (flag --{name.replace('_', '-')}, "
                      f"preset [engine] {name})")


def check_engine_settings(es: "EngineSettings") -> None:
    """Raise ``ValueError`` naming the field and its flag for a value vLLM refuses (or one this harness
    cannot run): ``dtype`` outside :data:`VLLM_DTYPES` (any case); ``device`` not auto/cuda/cpu; a count or size
    of :data:`_POSITIVE_INTS` below 1; ``gpu_memory_utilization`` outside (0, 1] (vLLM's
    ``CacheConfig``: gt=0, le=1); ``max_num_batched_tokens`` below ``max_num_seqs`` (both set; vLLM's
    ``SchedulerConfig``), or below ``max_model_len`` with ``enable_chunked_prefill`` false; ``max_model_len`` not
    above ``MAX_NEW_TOKENS``; ``long_prefill_token_threshold`` outside [0, ``max_model_len``]; ``seed`` below 0;
    an empty name of :data:`_NAMES`; a ``load_format``,
    ``kv_cache_dtype`` or ``quantization`` outside the installed vLLM's names (``sut.engine.vllm_names``: read from
    its source, not checked when they cannot be read).
    Types are ``settings_from_mapping``'s concern; a bool is refused where a number is due.
    """
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not (isinstance(es.dtype, str) and es.dtype.lower() in VLLM_DTYPES):  # vLLM lower-cases it
        raise _field_error("dtype", f"one of {', '.join(VLLM_DTYPES)}", es.dtype)
    if es.device not in ("auto", "cuda", "cpu"):
        raise _field_error("device", "auto, cuda or cpu", es.device)
    for name in _POSITIVE_INTS:
        v = getattr(es, name)
        if v is not None and not (number(v) and v >= 1 and int(v) == v):
            raise _field_error(name, ">= 1 (an integer)", v)
    util = es.gpu_memory_utilization
    if util is not None and not (number(util) and 0 < util <= 1):
        raise _field_error("gpu_memory_utilization", "in (0, 1] (vLLM's range)", util)
    seqs, tokens = es.max_num_seqs, es.max_num_batched_tokens
    if seqs is not None and tokens is not None and tokens < seqs:  # vLLM's SchedulerConfig refuses it at start
        raise _field_error("max_num_batched_tokens", f">= max_num_seqs ({seqs}): each step schedules one token per "
                           "running sequence at least (vLLM's rule)", tokens)
    if not (number(es.max_model_len) and es.max_model_len > MAX_NEW_TOKENS):
        raise _field_error("max_model_len", f"> {MAX_NEW_TOKENS} (it covers the longest prompt + {MAX_NEW_TOKENS} "
                                            "new tokens)", es.max_model_len)
    v = es.long_prefill_token_threshold
    if v is not None and not (number(v) and 0 <= v <= es.max_model_len):  # vLLM's SchedulerConfig, at start
        raise _field_error("long_prefill_token_threshold", f"in [0, max_model_len {es.max_model_len}]", v)
    if es.enable_chunked_prefill is False and tokens is not None and tokens < es.max_model_len:
        raise _field_error("max_num_batched_tokens", f">= max_model_len ({es.max_model_len}) with "
                           "enable_chunked_prefill false: a prompt must fit one step (vLLM's rule)", tokens)
    if es.seed is not None and not (number(es.seed) and 0 <= es.seed <= MAX_SEED):
        raise _field_error("seed", f"in [0, {MAX_SEED}] (vLLM's range, 2**32 - 1)", es.seed)
    for name in _NAMES:
        v = getattr(es, name)
        if (v is not None or name == "model") and not (isinstance(v, str) and v.strip()):
            raise _field_error(name, "a non-empty string", v)
        names = vllm_names.choices(name) if v is not None else None  # None: vLLM's lists could not be read
        if names and v not in names:
            raise _field_error(name, f"one of the installed vLLM's names ({', '.join(names)})", v)


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

    def __post_init__(self):
        if not 1 <= self.max_tokens <= 1 << 20:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        ids = self.eos_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or \
                not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"eos_token_ids must be a list of token ids (non-negative integers), got {ids!r}")
        object.__setattr__(self, "eos_token_ids", tuple(ids))

    @property
    def effective_min_tokens(self) -> int:
        """The ``min_tokens`` every engine is asked for: ``max_tokens`` with ``ignore_eos`` (fixed length)."""
        return self.max_tokens if self.ignore_eos else self.min_tokens

    @property
    def output_lengths(self) -> tuple[int, int]:
        """``(fewest, most)`` generated ids a complete answer holds: ``(max_tokens, max_tokens)`` with
        ``ignore_eos``, else ``(max(1, min_tokens), max_tokens)`` (an answer has at least its EOS id)."""
        return max(1, self.effective_min_tokens), self.max_tokens

    def lengths_for(self, asked: int = 0) -> tuple[int, int]:
        """``output_lengths`` of a request that asks its own ``asked`` new tokens (``Request.max_tokens``;
        0: the settings' own): ``(asked, asked)`` with ``ignore_eos``, else ``(max(1, min(min_tokens, asked)),
        asked)``."""
        if not asked:
            return self.output_lengths
        return (asked, asked) if self.ignore_eos else (max(1, min(self.min_tokens, asked)), asked)

    def sampling_params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=0.0,
            top_p=1.0,
            max_tokens=self.max_tokens,
            min_tokens=self.effective_min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.eos_token_ids),
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )


@dataclass(frozen=True)
class ModelInfo:
    """Facts read from a HF model folder: vocabulary size, EOS ids, config hash."""

    path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config_sha256: str
    max_position_embeddings: int
    #: The longest max_model_len vLLM accepts for this config without an override: max_position_embeddings when
    #: the config has no rope_scaling or Llama 3's (vLLM's ``_get_and_verify_max_len`` scales the others); 0:
    #: unknown (not checked here; vLLM checks it at engine start).
    max_model_len_limit: int = 0


#: Weight files vLLM's default loader looks for per ``load_format`` (vLLM ``DefaultModelLoader._prepare_weights``:
#: ``auto`` tries ``*.safetensors`` then ``*.bin``); other formats are not checked here.
WEIGHT_PATTERNS = {"auto": ("*.safetensors", "*.bin"), "safetensors": ("*.safetensors",), "pt": ("*.pt",),
                   "npcache": ("*.bin",)}


def check_weights_present(es: "EngineSettings") -> None:
    """``EngineError`` when ``es.model`` is a folder without the weight files its ``load_format`` loads
    (:data:`WEIGHT_PATTERNS`), so that an engine would fail only after it started; the message names the
    ``--load-format dummy`` way (random weights, a throughput figure). Nothing is checked for other formats
    or a model that is not a local folder."""
    patterns = WEIGHT_PATTERNS.get(es.load_format)
    folder = Path(es.model)
    if not patterns or not folder.is_dir() or any(next(folder.glob(pat), None) for pat in patterns):
        return
    raise EngineError(f"{folder}: no model weights ({' or '.join(patterns)}) for load_format {es.load_format!r}: "
                      "give a folder with weights, or --load-format dummy for random weights (a throughput figure, "
                      "not the model under test; the CPU preset loadgen_configs/cpu_tiny.toml sets it)")


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
        cfg = parse_json(raw)  # too deep: a JSONDecodeError
    except json.JSONDecodeError as e:
        raise EngineError(f"{cfg_path}: malformed JSON: {e}") from None
    if "vocab_size" not in cfg:
        raise EngineError(f"{cfg_path}: field 'vocab_size' missing")
    eos = None
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = parse_json(gen_path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
            raise EngineError(f"{gen_path}: malformed: {e}") from None
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        raise EngineError(f"{d}: no eos_token_id in generation_config.json or config.json")
    try:
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        vocab_size = int(cfg["vocab_size"])
    except (TypeError, ValueError) as e:
        raise EngineError(f"{d}: eos_token_id / vocab_size are not integers: {e}") from None
    if not eos_ids:  # no stop id for the engine, and no answer cut short could be told from a finished one
        raise EngineError(f"{d}: eos_token_id is an empty list (generation_config.json or config.json): the model "
                          "needs at least one EOS id")
    return ModelInfo(
        path=str(d),
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        config_sha256=hashlib.sha256(raw).hexdigest(),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 0)),
        max_model_len_limit=_max_model_len_limit(cfg),
    )


def _max_model_len_limit(cfg: dict) -> int:
    """See :attr:`ModelInfo.max_model_len_limit` (``cfg``: a parsed ``config.json``)."""
    rope = cfg.get("rope_scaling")
    rope_type = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    limit = cfg.get("max_position_embeddings")
    if (rope is None or rope_type == "llama3") and isinstance(limit, int) and not isinstance(limit, bool):
        return max(limit, 0)
    return 0


def settings_from_mapping(cls, values: dict):
    """Build a frozen settings dataclass from a mapping (a preset section plus flags).

    Raises ``ValueError`` naming the field for an unknown key or a value of the wrong type (a
    preset's ``max_samples = "4"`` is refused, not coerced); ints are accepted where a float is due.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        near = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        guess = "; ".join(f"did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m)
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}{f' ({guess})' if guess else ''}; "
                         f"known: {', '.join(sorted(names))}")
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
