"""Reference scores the accuracy gate compares a run with, and the comparison itself.

:func:`resolve_reference` picks the reference (the MLPerf submission checker's datacenter or edge
numbers, :data:`accuracy.constants.REFERENCES`, or a JSON file :func:`write_reference_file`
wrote); :func:`judge` compares scores with it: each ROUGE score must be >= 99 % of the
reference, ``gen_len`` within 90-110 %, per sample when the reference was measured on a
different number of samples (``reference gen_len / reference gen_num x gen_num``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from accuracy.boundedread import FOLDER, GREW, MISSING, NOT_REGULAR, TOO_LARGE, BoundedReadError, read_regular
from accuracy.constants import (
    EDGE_SAMPLES,
    GEN_LEN_MAX_FRACTION,
    GEN_LEN_MIN_FRACTION,
    REFERENCES,
    ROUGE_KEYS,
    ROUGE_MIN_FRACTION,
)
from accuracy.errors import AccuracyInputError
from accuracy.jsontext import parse_json


@dataclass(frozen=True)
class Reference:
    """Reference scores to compare with.

    Attributes:
        name: "datacenter", "edge" or "file".
        source: where the numbers come from.
        values: rouge1/rouge2/rougeL/rougeLsum (×100) and gen_len (characters).
        gen_num: samples the reference was measured on, or None if unknown.
    """

    name: str
    source: str
    values: Mapping[str, float]
    gen_num: int | None


def _number(value: object, key: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AccuracyInputError(f"reference file {path}: '{key}' must be a finite number, got {value!r}")
    return float(value)


#: Largest reference file read: a few numbers; a FIFO, device or anything larger is refused before it is opened.
MAX_REFERENCE_BYTES = 1 << 20


def _read_reference_text(path: Path) -> str:
    """The text of the reference file ``path``: a regular file of at most :data:`MAX_REFERENCE_BYTES`, checked
    before it is opened (a FIFO would block, ``/dev/zero`` fill memory). Raises ``AccuracyInputError``."""
    try:
        return read_regular(path, MAX_REFERENCE_BYTES).decode("utf-8")
    except BoundedReadError as e:
        if e.problem == MISSING:
            raise AccuracyInputError(
                f"reference {path} not found: pass --reference datacenter|edge|auto or an existing JSON file"
            ) from None
        if e.problem in (FOLDER, NOT_REGULAR, TOO_LARGE, GREW):
            kind = "a folder" if e.problem == FOLDER else "not a regular file of at most 1 MiB"
            raise AccuracyInputError(f"reference file {path} is {kind}: pass --reference datacenter|edge|auto or "
                                     "a JSON file that --write-reference wrote") from None
        raise AccuracyInputError(f"reference file {path} is not readable JSON: {e}") from None
    except UnicodeDecodeError as exc:
        raise AccuracyInputError(f"reference file {path} is not readable JSON: {exc}") from None


def load_reference_file(path: str | os.PathLike) -> Reference:
    """Read a reference JSON: ``{"rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len"[, "gen_num"]}``.

    ROUGE values are ×100 (numbers or numeric strings as evaluation.py prints them),
    ``gen_len`` in characters. Other keys are ignored.

    Raises:
        AccuracyInputError: missing, a folder, FIFO or device, over 1 MiB, unreadable, or a key missing / not a
            number.
    """
    path = Path(path)
    try:
        raw = parse_json(_read_reference_text(path))  # too deep: a JSONDecodeError
    except json.JSONDecodeError as exc:
        raise AccuracyInputError(f"reference file {path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AccuracyInputError(f"reference file {path}: expected a JSON object")
    values = {}
    for key in (*ROUGE_KEYS, "gen_len"):
        if key not in raw:
            raise AccuracyInputError(f"reference file {path}: missing '{key}' (needs {', '.join(ROUGE_KEYS)}, gen_len)")
        v = raw[key]
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        values[key] = _number(v, key, path)
    gen_num = raw.get("gen_num")
    if gen_num is not None:
        gen_num = int(_number(gen_num, "gen_num", path))
        if gen_num < 1:
            raise AccuracyInputError(f"reference file {path}: gen_num must be >= 1")
    return Reference("file", str(path), values, gen_num)


def resolve_reference(spec: str, n_samples: int) -> Reference:
    """Pick the reference for ``spec`` ("auto", "datacenter", "edge" or a file path).

    "auto": datacenter for 13,368 samples, edge for 5,000, otherwise datacenter (a subset run;
    ``gen_len`` then compared per sample).
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        spec = "edge" if n_samples == EDGE_SAMPLES else "datacenter"
    if spec in REFERENCES:
        ref = dict(REFERENCES[spec])
        gen_num = int(ref.pop("gen_num"))
        return Reference(spec, f"MLPerf submission checker constants.py llama3.1-8b{'-edge' if spec == 'edge' else ''}", ref, gen_num)
    return load_reference_file(spec)


def judge(scores: Mapping, ref: Reference) -> dict:
    """Compare scores with the reference; returns ``{metric: {value, reference, min[, max], ok}}``.

    ``gen_len``'s entry also has ``basis``: "total", or "per-sample" when ``ref.gen_num``
    differs from ``scores["gen_num"]`` (then ``reference`` is the scaled value).
    """
    verdict: dict = {}
    for k in ROUGE_KEYS:
        target = float(ref.values[k])
        lo = ROUGE_MIN_FRACTION * target
        verdict[k] = {"value": float(scores[k]), "reference": target, "min": round(lo, 6), "ok": bool(scores[k] >= lo)}
    gen_len, gen_num = int(scores["gen_len"]), int(scores["gen_num"])
    target = float(ref.values["gen_len"])
    basis = "total"
    if ref.gen_num is not None and ref.gen_num != gen_num:
        target = target / ref.gen_num * gen_num
        basis = "per-sample"
    lo, hi = GEN_LEN_MIN_FRACTION * target, GEN_LEN_MAX_FRACTION * target
    verdict["gen_len"] = {
        "value": gen_len,
        "reference": round(target, 3),
        "min": round(lo, 3),
        "max": round(hi, 3),
        "ok": bool(lo <= gen_len <= hi),
        "basis": basis,
    }
    return verdict


def gen_len_basis(g: Mapping) -> str:
    """What a ``gen_len`` verdict entry (:func:`judge`) measures, for the gate's summary, its reasons and
    ``python -m sut package``: ``characters over all samples; reference R`` (``reference scaled to this sample
    count R`` when ``basis`` is "per-sample": the value is still the total over all samples, not one sample's)."""
    ref = "reference scaled to this sample count" if g.get("basis") == "per-sample" else "reference"
    return f"characters over all samples; {ref} {g.get('reference')}"


def gen_len_reason(g: Mapping) -> str:
    """Why a ``gen_len`` verdict entry failed: ``gen_len V outside [lo, hi] (characters over all samples; ...)``."""
    return f"gen_len {g.get('value')} outside [{g.get('min')}, {g.get('max')}] ({gen_len_basis(g)})"


def write_reference_file(scores: Mapping, path: str | os.PathLike, note: Mapping | None = None) -> Path:
    """Write ``scores`` as a reference JSON that ``--reference FILE`` accepts.

    Keys: rouge1, rouge2, rougeL, rougeLsum, gen_len, gen_num, plus ``created`` (UTC ISO time)
    and the optional ``note`` mapping under ``source``.
    """
    path = Path(path)
    doc = {k: float(scores[k]) for k in ROUGE_KEYS}
    doc["gen_len"] = int(scores["gen_len"])
    doc["gen_num"] = int(scores["gen_num"])
    doc["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if note:
        doc["source"] = dict(note)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path
