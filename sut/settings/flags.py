"""Flag tables shared by the command lines: the engine flags (``python -m sut run``, ``python -m
sut.locality``, the benchmark scripts) and the backend option flags, built from the metadata of each
backend's options dataclass.

Engine flags::

    from sut.settings.flags import add_engine_flags, engine_defaults, engine_settings_from_args

    e = parser.add_argument_group("engine (vLLM)")
    add_engine_flags(e, defaults=engine_defaults(), skip=("seed",), help={"device": "auto | cuda | cpu (default auto)"})
    a = parser.parse_args(argv)
    es = engine_settings_from_args(a, {"enable_prefix_caching": True, "max_model_len": 9000})
    # flags given win over the base mapping; BadInput (exit 2) without a model, or naming a
    # value of the wrong type or range (sut.engine.settings_from_mapping / check_engine_settings)

Backend option flags (options convention: a field with its own flag declares
``field(default=..., metadata={"flag": "--batch-size", "help": "..."})``, optionally ``"metavar"``
and ``"choices"``; the flag's type comes from the field's annotation: int, float, str, bool
(``--x`` / ``--no-x``), ``Optional[...]`` of those, anything else a JSON value)::

    table = add_backend_flags(parser, {"flame": FlameOptions, "vllm": StandaloneOptions})
    a = parser.parse_args(argv)
    values, foreign = backend_options_from_args(a, "vllm")
    # values: {"dispatch_chunk": 256} (fields of --sut vllm given as flags, already typed)
    # foreign: [("--batch-size", ("flame",))] (flags given that --sut vllm does not take)

One group per backend (``"flame SUT options"``); a flag that several backends declare (same field
and type) is added once, in the first backend's group, and taken by each of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from typing import Any, Mapping, Optional, Sequence

from accuracy.jsontext import parse_json
from sut.errors import BadInput

#: EngineSettings fields offered as flags: name -> (type, help); ``--enforce-eager`` comes with them.
ENGINE_FLAGS = {
    "model": (str, "HF model folder (config.json; weights unless --load-format dummy)"),
    "dtype": (str, "auto | float32 | bfloat16 | float16 (CPU: use float32)"),
    "max_model_len": (int, "context length; must cover the longest prompt + 128 (official set: 2668)"),
    "max_num_seqs": (int, "max sequences per engine step"),
    "max_num_batched_tokens": (int, "max tokens per engine step (chunked prefill budget; caps a step's prefill tokens)"),
    "long_prefill_token_threshold": (int, "prefill a prompt longer than this at most this many tokens per step "
                                          "(vLLM; 0 = no cap; Server/Interactive TTFT)"),
    "gpu_memory_utilization": (float, "fraction of GPU memory per GPU (split between engines sharing a GPU)"),
    "kv_cache_dtype": (str, "auto | fp8"),
    "quantization": (str, "e.g. fp8 (dynamic FP8 weights)"),
    "load_format": (str, "auto | dummy (random weights from config.json: throughput only)"),
    "seed": (int, "engine seed"),
    "device": (str, "auto | cuda | cpu"),
    "engines_per_device": (int, "engines per GPU (sharing its memory) or number of CPU engines"),
    "cpu_kvcache_gib": (int, "CPU KV cache per engine, GiB"),
    "admit_every_steps": (int, "while an engine is busy, add new requests only every N engine steps, into free "
                               "slots (the harness's loop: Server's prefills in fewer, larger steps; 1 = every step; "
                               "not --sut vllm-http)"),
}
_EAGER_HELP = "no CUDA graphs / torch.compile"


def add_engine_flags(group, defaults: Optional[Mapping[str, Any]] = None, skip: Sequence[str] = (),
                     help: Optional[Mapping[str, str]] = None) -> None:  # noqa: A002 - argparse's word
    """Add ``--model``, ``--dtype``, ... (``ENGINE_FLAGS``) and ``--enforce-eager`` to ``group``
    (dest = the field name, default None = not given).

    ``defaults``: values to show as ``(default X)`` in the help (``engine_defaults()``: EngineSettings'); a
    name mapped to None shows ``(default unset: vLLM's own)``; ``skip``: field names left out; ``help``: replacement
    help texts by field name (shown as given, without a default).
    """
    help = help or {}
    for name, (typ, text) in [*ENGINE_FLAGS.items(), ("enforce_eager", (None, _EAGER_HELP))]:
        if name in skip:
            continue
        if name in help:
            text = help[name]
        elif defaults and name in defaults:
            text += f" (default {_default_text(defaults[name])})"
        kw = {"type": typ} if typ else {"action": "store_true", "default": None}
        group.add_argument("--" + name.replace("_", "-"), dest=name, help=text, **kw)


def _default_text(value) -> str:
    if value is None:
        return "unset: vLLM's own"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def engine_defaults() -> dict[str, Any]:
    """EngineSettings' default of every field that has one (None: vLLM decides), for ``add_engine_flags``."""
    from sut.engine import EngineSettings

    return {f.name: f.default for f in dataclasses.fields(EngineSettings) if f.default is not dataclasses.MISSING}


def engine_overrides(a: argparse.Namespace) -> dict:
    """The engine fields given on the command line (absent or None flags are left out)."""
    names = list(ENGINE_FLAGS) + ["enforce_eager"]
    return {n: getattr(a, n) for n in names if getattr(a, n, None) is not None}


def engine_settings_from_args(a: argparse.Namespace, base: Optional[Mapping[str, Any]] = None,
                              model_hint: str = ""):
    """``EngineSettings`` from ``base`` (a preset's ``[engine]``, a caller's defaults) overridden by the
    flags given.

    Raises ``BadInput`` (exit 2, before anything starts): "error: --model is required" + ``model_hint``
    without a model; "error: ..." naming the field and its flag for a value of the wrong type or one
    vLLM refuses (``sut.engine.settings.check_engine_settings``: a ``--dtype`` outside vLLM's choices,
    ``--cpu-kvcache-gib -1``, ...).
    """
    from sut.engine import EngineSettings, settings_from_mapping

    values = {**(base or {}), **engine_overrides(a)}
    if "model" not in values:
        raise BadInput(f"error: --model is required{model_hint}")
    try:
        return settings_from_mapping(EngineSettings, values)
    except (ValueError, TypeError) as e:
        raise BadInput(f"error: {field_source_named(str(e), engine_overrides(a))}") from None


_FIELD_SOURCES = re.compile(r" ?\(flag (--[\w-]+), preset \[engine\] (\w+)\)")


def field_source_named(message: str, flags: Mapping[str, Any]) -> str:
    """A field error's "(flag --x, preset [engine] x)" (``sut.engine.settings``) narrowed to the one source that
    gave the value: " (flag --x)" when field x is in ``flags`` (e.g. ``--admit-every-steps 0``), else nothing (the
    caller names the preset file and table); other messages unchanged."""
    m = _FIELD_SOURCES.search(message)
    if not m:
        return message
    return message.replace(m.group(0), f" (flag {m.group(1)})" if m.group(2) in flags else "")


# ------------------------------------------------------------------------------ backend option flags
@dataclasses.dataclass(frozen=True)
class BackendFlag:
    """One backend option flag: ``--batch-size`` -> field ``batch_size`` of the backends that declare it."""

    flag: str
    field: str
    dest: str
    backends: tuple[str, ...]


def json_or_str(text: str):
    """A flag value: JSON when it parses (numbers, lists, true/false), else the text as given (a too deeply
    nested text is kept as text too: ``accuracy.jsontext.parse_json``)."""
    try:
        return parse_json(text)
    except json.JSONDecodeError:
        return text


def _argparse_kwargs(annotation) -> dict:
    """argparse keywords for a field annotation (module docstring)."""
    args = [x for x in typing.get_args(annotation) if x is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation}
    return {"type": json_or_str, "metavar": "JSON"}


class JoinWithComma(argparse.Action):
    """argparse action of a repeatable list flag (``--server-url A --server-url B,C``): the values given, joined
    with commas ("A,B,C"), as one comma-separated value would be (a plain store kept only the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def option_flags(options_cls: type) -> list[tuple[str, str, dict]]:
    """``(flag, field name, argparse keywords)`` for each field of ``options_cls`` whose metadata
    names a ``flag``; ``ValueError`` for a flag that does not start with ``--``."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        flag = f.metadata.get("flag")
        if not flag:
            continue
        if not flag.startswith("--"):
            raise ValueError(f"{options_cls.__name__}.{f.name}: flag {flag!r} must start with --")
        kw = _argparse_kwargs(hints[f.name])
        if "action" not in kw:
            kw.setdefault("metavar", f.name.upper())
        kw.update({k: f.metadata[k] for k in ("metavar", "choices") if k in f.metadata})
        if f.metadata.get("repeat"):  # given again: one more comma-separated part, not a replacement
            kw["action"] = JoinWithComma
        text = f.metadata.get("help", f.name.replace("_", " "))
        if f.default is not dataclasses.MISSING and f.default is not None and "default" not in text:
            text += f" (default {f.default})"
        kw["help"] = text.replace("%", "%%") + f" (= --option {f.name}=...)"
        out.append((flag, f.name, kw))
    return out


def add_backend_flags(parser: argparse.ArgumentParser, backends: Mapping[str, Optional[type]]) -> dict[str, BackendFlag]:
    """Add one argument group per backend (``"NAME SUT options"``) with the flags of its options
    dataclass (None: a backend without options); returns the table (flag -> ``BackendFlag``), also
    kept as the parsed namespace's ``backend_flags``.

    Raises ``ValueError`` when two backends declare one flag for different fields or types.
    """
    table: dict[str, BackendFlag] = {}
    kwargs: dict[str, dict] = {}
    actions: dict[str, argparse.Action] = {}
    for name, ocls in backends.items():
        if ocls is None:
            continue
        group = None
        for flag, field_name, kw in option_flags(ocls):
            if flag in table:
                old = table[flag]
                same = old.field == field_name and {k: v for k, v in kwargs[flag].items() if k != "help"} == \
                    {k: v for k, v in kw.items() if k != "help"}
                if not same:
                    raise ValueError(f"{flag}: --sut {name} ({ocls.__name__}.{field_name}) and --sut "
                                     f"{', '.join(old.backends)} ({old.field}) declare it differently")
                table[flag] = dataclasses.replace(old, backends=old.backends + (name,))
                actions[flag].help += f" (also --sut {name})"
                continue
            group = group or parser.add_argument_group(f"{name} SUT options")
            dest = "opt" + flag.replace("-", "_")
            actions[flag] = group.add_argument(flag, dest=dest, default=None, **kw)
            table[flag] = BackendFlag(flag, field_name, dest, (name,))
            kwargs[flag] = kw
    parser.set_defaults(backend_flags=table)
    return table


def backend_options_from_args(a: argparse.Namespace, sut: str) -> tuple[dict, list[tuple[str, tuple[str, ...]]]]:
    """``(values, foreign)``: the option flags given that ``sut`` takes, as ``{field: value}``, and
    the ones it does not take, as ``[(flag, backends that take it)]`` (module docstring)."""
    values, foreign = {}, []
    for bf in (getattr(a, "backend_flags", None) or {}).values():
        val = getattr(a, bf.dest, None)
        if val is None:
            continue
        if sut in bf.backends:
            values[bf.field] = val
        else:
            foreign.append((bf.flag, bf.backends))
    return values, foreign
