"""Reading an MLPerf ``cnn_eval.json``-format dataset: the one reader of the run and the gate.

File format (mlcommons/inference ``language/llama3.1-8b/download_cnndm.py``): a JSON list of
records ``{"instruction", "input", "tok_input", "output"}``; ``output`` is the reference
summary (CNN/DailyMail ``highlights``), the only field the gate reads. Record ``i`` is LoadGen's
``qsl_idx`` ``i``.

:func:`read_dataset_json` is how both ``python -m sut run`` (``sut/data/dataset.py``, before any engine
starts) and the gate read the file, so a file the run accepts is a file the gate can score.
Accepted encoding: UTF-8, with or without a byte-order mark (what ``download_cnndm.py`` and
``json.dump`` write). UTF-16 and UTF-32 (with or without a BOM), other encodings and pickles are
refused with a message naming the file; nothing is unpickled. The gate stays usable on its own:
this module needs only the standard library and ``accuracy.errors``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from accuracy.boundedread import (
    FOLDER,
    GREW,
    MISSING,
    NOT_REGULAR,
    NUL_IN_PATH,
    PERMISSION,
    TOO_LARGE,
    BoundedReadError,
    read_regular,
)
from accuracy.errors import AccuracyInputError
from accuracy.jsontext import parse_json

#: What :func:`read_dataset_json` accepts, for messages and docs.
ACCEPTED_ENCODING = "UTF-8 (with or without a byte-order mark)"
#: Largest dataset file read, in bytes (1 GiB). The official 13,368-sample ``cnn_eval.json`` as
#: ``download_cnndm.py`` writes it (``json.dump(..., indent=4)``) is about 266 MB: the 1,020 public rows
#: of ``cnn_eval_public.json`` re-written with ``indent=4`` take 19.6 MB (19.2 KB a row), scaled to 13,368
#: rows and the full set's ~4% longer prompts. The limit leaves about 4x room and bounds the memory a
#: read can take (the bytes, their text and the parsed lists: a few GB at the limit).
MAX_DATASET_BYTES = 1 << 30
_WIDE_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"),
              (b"\xff\xfe", "UTF-16"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class DatasetFileError(AccuracyInputError):
    """A dataset file cannot be read as cnn_eval JSON.

    Attributes:
        path: the file.
        reason: what is wrong, without the path (``str()`` is ``"dataset <path>: <reason>"``).
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        where = f" ({WHERE_DATA})" if reason == NOT_FOUND else ""
        super().__init__(f"dataset {path}: {reason}{where}")


#: ``DatasetFileError.reason`` of a path that does not exist; its message then says where data comes from.
NOT_FOUND = "file not found"
#: Where datasets come from (docs/inputs.md): the official file and the demo's synthetic one.
WHERE_DATA = ("the official one is MLCommons' cnn_eval.json, 13,368 samples (docs/inputs.md says how to download "
              "it); a synthetic file for a try-out: python -m sut synthetic --out data.json")


def wide_encoding(head: bytes) -> str | None:
    """``"UTF-16"`` or ``"UTF-32"`` when ``head`` (the first 4 bytes of a file, or fewer when it is shorter) says the
    text is in that encoding: its byte-order mark, or the NUL bytes RFC 4627 detects a JSON text's encoding by (a
    UTF-16 or UTF-32 file without a BOM); None otherwise (UTF-8, with or without its BOM, or undecidable)."""
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            return name
    if len(head) >= 4 and head[:4].count(0) == 3:
        return "UTF-32"
    if len(head) >= 2 and 0 in head[:2]:
        return "UTF-16"
    return None


def _dataset_reason(e: BoundedReadError, limit: int) -> str:
    """``DatasetFileError.reason`` of a dataset file that ``read_regular`` refused."""
    return {
        NUL_IN_PATH: "the path holds a NUL byte; no file has such a name",
        FOLDER: "is a directory, not a cnn_eval JSON file",
        NOT_REGULAR: "is not a regular file (a device, FIFO or socket); only a cnn_eval JSON file is read",
        TOO_LARGE: f"is {e.detail} bytes, more than the {limit:,}-byte limit of a dataset file (the official "
                   "cnn_eval.json is about 266 MB)",
        GREW: f"grew past the {limit:,}-byte limit of a dataset file while it was read",
        MISSING: NOT_FOUND, PERMISSION: "permission denied",
    }.get(e.problem, str(e))


def read_dataset_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the dataset-like file ``path`` (the run's and the gate's dataset, a retokenizer's source), a
    regular file of at most ``limit`` bytes (:data:`MAX_DATASET_BYTES` for a dataset), checked before anything is
    read (``accuracy.boundedread.read_regular``: a FIFO or device is refused from its ``stat``, never opened).
    Nothing is decoded (:func:`wide_encoding` tells UTF-16 and UTF-32 apart).

    Raises:
        DatasetFileError: missing (its message says where datasets come from), not a regular file, larger than
            ``limit``, unreadable, or a path holding a NUL; ``reason`` says which, without the path.
    """
    try:
        return read_regular(path, limit)
    except BoundedReadError as e:
        raise DatasetFileError(path, _dataset_reason(e, limit)) from None


def read_dataset_json(path: str | os.PathLike) -> list:
    """The records of a cnn_eval-format file: a non-empty JSON list, ``ACCEPTED_ENCODING`` only.

    Raises:
        DatasetFileError: missing, a directory or other non-regular file, larger than
            ``MAX_DATASET_BYTES`` (checked before reading), unreadable, a pickle, UTF-16/UTF-32 or
            otherwise not UTF-8 (naming the byte offset), malformed JSON, or not a non-empty JSON list.
    """
    path = Path(path)
    raw = read_dataset_bytes(path, MAX_DATASET_BYTES)
    if raw[:1] == b"\x80":
        raise DatasetFileError(path, "looks like a pickle; only the JSON cnn_eval format is read (never unpickled)")
    wide = wide_encoding(raw[:4])
    if wide:
        raise DatasetFileError(path, f"is {wide}-encoded; only {ACCEPTED_ENCODING} is read. Convert it first, e.g. "
                                     f"iconv -f {wide} -t UTF-8 {path.name} > {path.stem}.utf8.json")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetFileError(path, f"is not {ACCEPTED_ENCODING}: byte {e.start} (0x{raw[e.start]:02x}) "
                                     "is not valid UTF-8") from None
    try:
        records = parse_json(text)
    except json.JSONDecodeError as e:  # also JSONTooDeepError
        raise DatasetFileError(path, f"malformed JSON: {e}") from None
    if not isinstance(records, list):
        raise DatasetFileError(path, f"top level must be a JSON list of records, got {type(records).__name__}")
    if not records:
        raise DatasetFileError(path, "the file holds no records")
    return records


#: Records whose ``tok_input`` the gate decodes to check its tokenizer (``accuracy.preflight.check_tokenizer_made``).
PROBE_RECORDS = 3


@dataclass(frozen=True)
class GateData:
    """What the gate reads from the dataset.

    Attributes:
        references: one ``output`` string per kept record, in file order.
        probes: ``(record index, input text, tok_input ids)`` of the first ``PROBE_RECORDS`` kept records that have
            a non-empty string ``input`` and a list ``tok_input`` (fewer, or none, in files without them).
    """

    references: list
    probes: list = field(default_factory=list)


def load_gate_data(path: str | os.PathLike, max_samples: int | None = None) -> GateData:
    """The references and tokenizer probes of the dataset (one read of the file).

    Args:
        path: the dataset JSON.
        max_samples: keep only the first N records (a run that used only the first N).

    Raises:
        AccuracyInputError: missing/unreadable file or encoding (:func:`read_dataset_json`), a
            record without a string ``output``, or ``max_samples`` < 1 or larger than the file.
    """
    path = Path(path)
    try:
        records = read_dataset_json(path)
    except DatasetFileError as e:
        hint = ": pass --dataset PATH/cnn_eval.json" if e.reason == NOT_FOUND else ""
        raise AccuracyInputError(f"{e}{hint}") from None
    if max_samples is not None:
        if max_samples < 1 or max_samples > len(records):
            raise AccuracyInputError(f"max_samples={max_samples} but dataset {path} has {len(records)} records")
        records = records[:max_samples]
    refs, probes = [], []
    for i, rec in enumerate(records):
        out = rec.get("output") if isinstance(rec, dict) else None
        if not isinstance(out, str):
            raise AccuracyInputError(f"dataset {path}: record {i} has no string field 'output' (the reference summary)")
        refs.append(out)
        text, ids = rec.get("input"), rec.get("tok_input")
        if len(probes) < PROBE_RECORDS and isinstance(text, str) and text.strip() and isinstance(ids, list):
            probes.append((i, text, ids))
    return GateData(refs, probes)


def load_references(path: str | os.PathLike, max_samples: int | None = None) -> list[str]:
    """The ``output`` strings of the dataset, in file order (:func:`load_gate_data`, same arguments and errors)."""
    return load_gate_data(path, max_samples).references
