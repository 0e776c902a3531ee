"""Reading ``run.json`` records back: field types, EOS ids, and the engine a run really used.

``test06-verify`` and ``package`` (``sut/record/test06.py``) trust nothing in a run record: a record
may be old, hand-edited or corrupt. :func:`check_record` checks the type of every field they
read (a string where a list of ids is due would otherwise be iterated digit by digit),
:func:`eos_ids` checks EOS ids against the vocabulary, and :func:`engines_used` reduces the
engines' read-back records (``engines[*].engine_args`` and ``device``, written by the engine
workers from the running vLLM engines) to what identifies the engine, so that runs are compared by
the engine that ran (``device`` ``cpu``), not by how it was asked for (``--device auto``).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from accuracy.boundedread import FOLDER, MISSING, NOT_REGULAR, BoundedReadError, read_regular
from accuracy.jsontext import parse_json
from accuracy.loadgen_log import MAX_LOG_BYTES, NOT_MLPERF, not_mlperf, not_mlperf_kind
from sut.constants import LLAMA3_VOCAB
from sut.errors import ComplianceError

#: MLPerf scenario names (LoadGen's four, plus Interactive: Server with tighter latency targets); TEST06
#: checks the first token in every scenario but Offline
MLPERF_SCENARIOS = ("Offline", "Server", "Interactive", "SingleStream", "MultiStream")

_OBJ, _STR, _BOOL, _INT, _NUM, _STRS, _INTS, _OBJS = ("an object", "a string", "true/false",
                                                      "an integer (within +-2**53)", "a finite number",
                                                      "a list of strings", "a list of integers", "a list of objects")
_OBJS_OR_NULL = "a list of objects (or nulls)"
#: Field path -> expected kind, for every field ``sut/record/test06.py`` and ``sut/submission/`` (``systems/<system>
#: .json`` included) read; None (JSON null) is always allowed.
RECORD_FIELDS = {
    **{(k,): _OBJ for k in ("compliance", "run_settings", "engine_settings", "generation", "model", "dataset",
                            "options", "loadgen", "versions", "test06", "accuracy", "audit_config", "host_info")},
    ("devices",): _OBJS_OR_NULL, ("host_info", "cpu_count"): _INT,
    **{("host_info", k): _STR for k in ("os", "cpu", "gpu_driver")},
    **{(k,): _STR for k in ("status", "sut", "scenario", "mode", "model_key", "validity", "command", "error")},
    ("samples_per_s",): _NUM, ("tokens_per_s",): _NUM, ("engines",): _OBJS,
    ("compliance", "compliant"): _BOOL, ("compliance", "reasons"): _STRS,
    ("run_settings", "compliance_test"): _STR, ("run_settings", "audit_config"): _STR,
    ("run_settings", "user_conf"): _STR,
    ("model", "path"): _STR, ("model", "config_sha256"): _STR, ("model", "vocab_size"): _INT,
    ("model", "eos_token_ids"): _INTS,
    ("engine_settings", "model"): _STR, ("engine_settings", "device"): _STR,
    ("loadgen", "errors"): _INT, ("generation", "max_tokens"): _INT, ("test06", "passed"): _BOOL, ("test06", "eos_token_ids"): _INTS,
    ("accuracy", "passed"): _BOOL, ("accuracy", "skipped"): _STR,
    **{("versions", k): _STR for k in ("vllm", "torch", "mlcommons-loadgen", "python", "cuda")},
}
#: Fields of a device record (``devices[i]``, ``engines[i].device``) that must be strings when given.
DEVICE_STR_FIELDS = ("kind", "slot", "name", "uuid")


#: Largest integer a record field may hold: JSON numbers beyond 2**53 are not exact in most readers (a hand-edited
#: max_tokens or vocab_size of 1e30 passed as a whole number).
MAX_RECORD_INT = 2 ** 53


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_RECORD_INT


def _kind_ok(v: object, kind: str) -> bool:
    return {
        _OBJ: lambda: isinstance(v, dict),
        _STR: lambda: isinstance(v, str),
        _BOOL: lambda: isinstance(v, bool),
        _INT: lambda: _is_int(v),
        _NUM: lambda: (_is_int(v) or (isinstance(v, float) and math.isfinite(v))),
        _STRS: lambda: isinstance(v, list) and all(isinstance(x, str) for x in v),
        _INTS: lambda: isinstance(v, list) and all(_is_int(x) for x in v),
        _OBJS: lambda: isinstance(v, list) and all(isinstance(x, dict) for x in v),
        _OBJS_OR_NULL: lambda: isinstance(v, list) and all(x is None or isinstance(x, dict) for x in v),
    }[kind]()


def read_json(path: str | Path, what: str):
    """Parsed JSON of ``path``, read by ``accuracy.boundedread.read_regular`` (at most ``MAX_LOG_BYTES``, the
    accuracy log's bound; a FIFO or device is refused unopened). Raises ``ComplianceError`` naming ``what`` and the
    path if it is missing, no regular file, too large, unreadable or not valid JSON."""
    path = Path(path)
    try:
        return parse_json(read_regular(path, MAX_LOG_BYTES).decode("utf-8"))
    except BoundedReadError as e:
        if e.problem == MISSING:
            raise ComplianceError(f"{what} {path} not found") from None
        if e.problem in (FOLDER, NOT_REGULAR):
            raise ComplianceError(f"{path} is not a regular file (a folder, FIFO or device)") from None
        raise ComplianceError(f"{what} {path} {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # also JSONTooDeepError
        raise ComplianceError(f"{what} {path} is not valid JSON ({e})") from None


#: What a record or folder of ``python -m sut.locality`` (``"mlperf": false``) is told where an MLPerf run is due.
def check_record(rec: object, path: str | Path) -> dict:
    """``rec`` (a parsed ``run.json``) if every field of :data:`RECORD_FIELDS` has its type.

    Raises ``ComplianceError`` naming the file and the field otherwise (a list instead of an
    object, the string ``"128009"`` where a list of ids is due, a negative error count, an
    unknown scenario, engine records without ``engine_args``, a ``host_info`` or ``devices`` that is a
    string, a device whose ``name`` is no string).
    """
    if not isinstance(rec, dict):
        raise ComplianceError(f"{path}: a run record must be a JSON object, got {type(rec).__name__}")
    if not_mlperf(rec):
        marker = f"\"mlperf\": {json.dumps(rec['mlperf'])}" if "mlperf" in rec else "its \"mlperf\" marker removed"
        raise ComplianceError(f"{path}: a {not_mlperf_kind(rec)} record ({marker}), {NOT_MLPERF}")
    for fields, kind in sorted(RECORD_FIELDS.items(), key=lambda kv: len(kv[0])):
        parent = rec
        for f in fields[:-1]:
            parent = parent.get(f) or {}
        v = parent.get(fields[-1])
        if v is not None and not _kind_ok(v, kind):
            raise ComplianceError(f"{path}: field {'.'.join(fields)!r} must be {kind}, "
                                  f"got {type(v).__name__} {json.dumps(v)[:60]}")
    if rec.get("scenario") is not None and rec["scenario"] not in MLPERF_SCENARIOS:
        raise ComplianceError(f"{path}: unknown scenario {rec['scenario']!r} (known: {', '.join(MLPERF_SCENARIOS)})")
    if (rec.get("loadgen") or {}).get("errors", 0) < 0:
        raise ComplianceError(f"{path}: field 'loadgen.errors' must not be negative")
    if (rec.get("generation") or {}).get("max_tokens", 1) < 1:
        raise ComplianceError(f"{path}: field 'generation.max_tokens' must be at least 1")
    vocab = (rec.get("model") or {}).get("vocab_size")
    if vocab is not None and vocab < 1:
        raise ComplianceError(f"{path}: field 'model.vocab_size' must be positive, got {vocab}")
    for i, e in enumerate(rec.get("engines") or []):
        for k in ("engine_args", "device"):
            if not isinstance(e.get(k), dict):
                raise ComplianceError(f"{path}: field 'engines[{i}].{k}' must be an object")
    _check_devices(rec, path)
    return rec


def _check_devices(rec: dict, path: str | Path) -> None:
    """``ComplianceError`` naming the field for a :data:`DEVICE_STR_FIELDS` field of a device record (``devices[i]``,
    ``engines[i].device``: objects, checked by :func:`check_record`) that is given and no string."""
    found = [(f"devices[{i}]", d) for i, d in enumerate(rec.get("devices") or []) if d is not None]
    found += [(f"engines[{i}].device", e["device"]) for i, e in enumerate(rec.get("engines") or [])]
    for where, d in found:
        for k in DEVICE_STR_FIELDS:
            if d.get(k) is not None and not isinstance(d[k], str):
                raise ComplianceError(f"{path}: field '{where}.{k}' must be {_STR}, got {type(d[k]).__name__} "
                                      f"{json.dumps(d[k])[:60]}")


def vocab_size(rec: dict) -> int:
    """The run's vocabulary size (``model.vocab_size`` of a checked record), else Llama 3's 128,256."""
    return (rec.get("model") or {}).get("vocab_size") or LLAMA3_VOCAB


def eos_ids(value: object, vocab: int, source: str) -> tuple[int, ...]:
    """``value`` as a tuple of EOS ids, each an integer in ``[0, vocab)``.

    Raises ``ComplianceError`` naming ``source`` (e.g. ``"run.json model.eos_token_ids"`` or
    ``"--eos-token-ids"``) for a non-list (a string would be read digit by digit), an empty list,
    a non-integer, or an id outside the vocabulary.
    """
    if not isinstance(value, (list, tuple)):
        raise ComplianceError(f"EOS token ids ({source}) must be a list of integers, got {type(value).__name__} "
                              f"{value!r}")
    if not value:
        raise ComplianceError(f"no EOS token ids ({source}) for the EOS check")
    for x in value:
        if not _is_int(x):
            raise ComplianceError(f"EOS token ids ({source}) must be integers, got {x!r} in {list(value)!r}")
        if not 0 <= x < vocab:
            raise ComplianceError(f"EOS token id {x} ({source}) is outside the vocabulary [0, {vocab})")
    return tuple(int(x) for x in value)


#: Device fields that identify the hardware kind (not the particular GPU, process or Flame shard).
_DEVICE_KEYS = ("kind", "name", "gpu_share")
#: EngineSettings fields that the engines' read-back records describe (as what really ran).
READ_BACK_SETTINGS = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                      "gpu_memory_utilization", "kv_cache_dtype", "quantization", "load_format", "enforce_eager",
                      "seed", "enable_prefix_caching", "device", "engines_per_device")


def engines_used(rec: dict) -> Optional[dict]:
    """What the engines of a checked record really ran, or None if the record has no engine read-back.

    Returns ``{"engines": n, "engine_args": [...], "devices": [...], "prefix_caching": [...]}``: the
    distinct read-back ``engine_args`` (without the model path: models are compared by config hash),
    the device kinds/names/GPU shares with their counts, and the prefix-caching states.
    """
    engines: Sequence[dict] = rec.get("engines") or []
    if not engines:
        return None
    args = sorted({json.dumps({k: v for k, v in e["engine_args"].items() if k != "model"}, sort_keys=True)
                   for e in engines})
    devices = Counter(json.dumps({k: e["device"].get(k) for k in _DEVICE_KEYS}, sort_keys=True) for e in engines)
    return {"engines": len(engines), "engine_args": [json.loads(a) for a in args],
            "devices": [[json.loads(d), n] for d, n in sorted(devices.items())],
            "prefix_caching": sorted({bool(e.get("enable_prefix_caching")) for e in engines})}


def invalid_why(rec: dict) -> str:
    """Which of LoadGen's checks an INVALID run failed, from its record's ``loadgen`` (``mlperf_log_detail.txt``)."""
    lg = rec.get("loadgen") or {}
    failed = [name for key, name in (("result_min_duration_met", "min duration"), ("result_min_queries_met", "min queries"),
                                     ("result_perf_constraints_met", "latency constraints"),
                                     ("early_stopping_met", "early stopping")) if lg.get(key) is False]
    return ", ".join(failed) or "see its mlperf_log_summary.txt"


def early_stopping_shortfall(rec: dict) -> Optional[tuple[int, int]]:
    """``(queries processed, more queries LoadGen's early stopping would need)`` of a Server/Interactive run whose
    early stopping failed (the larger need of its TTFT and TPOT results: "Processed N queries ... Would need to run
    at least M more queries"), or None."""
    lg = rec.get("loadgen") or {}
    found = []
    for key in ("early_stopping_ttft_result", "early_stopping_tpot_result"):
        text = str(lg.get(key) or "")
        done, more = re.search(r"Processed (\d+) queries", text), re.search(r"at least (\d+) more queries", text)
        if done and more:
            found.append((int(done.group(1)), int(more.group(1))))
    return max(found, key=lambda x: x[1]) if found else None
