"""Reading LoadGen's ``mlperf_log_accuracy.json`` and checking it before scoring.

Format (LoadGen ``logging.cc``; research notes §3.4): a JSON list with one object per logged
response::

    {"seq_id": int, "qsl_idx": int, "data": "<upper-case hex of the response bytes>",
     "token_count": int}        # token_count present when use_token_latencies is on

For this benchmark the response bytes are the generated token ids as little-endian int32
(reference SUT ``numpy.int32`` arrays; TEST06 and evaluation.py ``--dtype int32``).

Checks (each failure lists the offending ``qsl_idx`` values):

- every dataset sample logged exactly once (``missing``, ``duplicated``, ``unknown_qsl_idx``);
- ``token_count`` equals the number of int32 ids in ``data`` (TEST06 length check);
- at most :data:`accuracy.constants.MAX_NEW_TOKENS` ids and at least one (``too_long``,
  ``empty``);
- at most one EOS at the end (TEST06 EOS check: a trailing run of EOS ids of length ≥ 2
  fails; any of the EOS ids counts);
- the bytes really are int32 token ids: a length that is not a multiple of 4, an
  int64-encoded log (every other int32 word zero, whatever ``token_count`` says: half the word
  count or bytes / 4), a big-endian log, or ids outside ``[0, vocab_size)`` fail with a message
  saying so.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from accuracy.boundedread import GREW, MISSING, NOT_REGULAR, TOO_LARGE, BoundedReadError, read_regular
from accuracy.constants import MAX_NEW_TOKENS
from accuracy.errors import AccuracyInputError
from accuracy.jsontext import parse_json

NOT_MLPERF = "NOT an MLPerf run: only `python -m sut run` folders can be packaged or scored as one"


#: Top-level fields that only ``python -m sut.locality`` writes (``locality.json``, ``run_header.json``, a merged
#: report): a record with one of them is a locality record whatever its ``"mlperf"`` and ``"kind"`` say (a hand-edited
#: marker). An MLPerf ``run.json`` (``sut.record.write.initial_record``) has none of them.
LOCALITY_FIELDS = ("trace_hash", "input_hashes", "trace_settings", "pair_settings", "router_settings")
#: Fields that together make a ``cases.jsonl`` line (one case of a locality run).
LOCALITY_CASE_FIELDS = ("pair", "policy", "timed", "validation")


def not_mlperf(rec: object) -> bool:
    """``rec`` (parsed JSON) is a record that is no MLPerf run: it says so (``"mlperf"`` anything but true, a
    ``kind`` other than ``mlperf-loadgen``) or has the shape of a ``python -m sut.locality`` record or case
    (:data:`LOCALITY_FIELDS`, :data:`LOCALITY_CASE_FIELDS`), with its markers removed or changed."""
    if not isinstance(rec, dict):
        return False
    if ("mlperf" in rec and rec["mlperf"] is not True) or rec.get("kind") not in (None, "mlperf-loadgen"):
        return True
    return any(f in rec for f in LOCALITY_FIELDS) or all(f in rec for f in LOCALITY_CASE_FIELDS)


def not_mlperf_kind(rec: dict) -> str:
    """What :func:`not_mlperf` found ``rec`` to be, for messages: its own ``kind``, else ``synthetic-locality``."""
    kind = rec.get("kind")
    return kind if isinstance(kind, str) and kind not in ("", "mlperf-loadgen") else "synthetic-locality"


#: What marks a ``python -m sut.locality`` run folder (``sut.locality``: its ``RUN_SUFFIX``, the record, the header
#: written before the first case and the cases appended after each; a run cut off early has only the last two).
LOCALITY_SUFFIX = "-SYNTHETIC-LOCALITY-NOT-MLPERF"
LOCALITY_FILES = ("locality.json", "run_header.json", "cases.jsonl")


def _is_locality_folder(d: Path, by_files: bool) -> bool:
    """``d``'s name, or (``by_files``) one of :data:`LOCALITY_FILES` in it, says it is a locality run folder (an
    unreadable entry counts as absent)."""
    if d.name.endswith(LOCALITY_SUFFIX):
        return True
    for f in LOCALITY_FILES if by_files else ():
        try:
            if (d / f).is_file():
                return True
        except OSError:  # a folder that cannot be searched (permission denied)
            continue
    return False


def locality_folder_why(folder: Path) -> Optional[str]:
    """Why ``folder`` is, or lies inside, a ``python -m sut.locality`` run folder, else None: its name or one of
    :data:`LOCALITY_FILES` in it says so (a run cut off before its ``locality.json`` included, also beside a
    ``run.json`` put there by hand), or in its parent (a case folder of such a run), or the name of a folder further
    up does (files further up are not looked at: an MLPerf run under a folder that happens to hold a report is
    still one)."""
    folder = Path(folder)
    here = Path(os.path.abspath(folder))
    for depth, d in enumerate((here, *here.parents)):
        if _is_locality_folder(d, by_files=depth <= 1):
            where = "is" if d == here else f"lies inside {d}, which is"
            return f"{where} a synthetic-locality run folder (python -m sut.locality): {NOT_MLPERF}"
    return None


log = logging.getLogger(__name__)

#: Largest accuracy log read: a full accuracy run (13,368 answers of at most 128 ids, 8 hex digits an id) is about
#: 16 MB; 1 GiB leaves room for any query size and refuses ``/dev/zero``-like inputs before they fill memory.
MAX_LOG_BYTES = 1 << 30

_LE_INT32 = np.dtype("<i4")


@dataclass(frozen=True)
class LogEntry:
    """One logged response.

    Attributes:
        position: index in the log list.
        qsl_idx: dataset index of the sample.
        token_count: the ``n_tokens`` the SUT reported, or None if absent.
        raw: the response bytes.
    """

    position: int
    qsl_idx: int
    token_count: int | None
    raw: bytes

    def ids(self) -> np.ndarray:
        """The bytes as little-endian int32 ids, shape ``(len(raw) // 4,)``; raw must be a multiple of 4."""
        return np.frombuffer(self.raw, dtype=_LE_INT32)


def encode_ids(ids: Iterable[int], dtype: str = "<i4") -> str:
    """Hex string of ``ids`` in LoadGen's accuracy-log form (upper case), for tests and tools."""
    return np.asarray(list(ids), dtype=np.dtype(dtype)).tobytes().hex().upper()


def make_log_entry(qsl_idx: int, ids: Sequence[int], token_count: int | None = -1, seq_id: int | None = None) -> dict:
    """A log object as LoadGen writes it; ``token_count=-1`` means ``len(ids)``, None omits it."""
    entry = {"seq_id": qsl_idx if seq_id is None else seq_id, "qsl_idx": int(qsl_idx), "data": encode_ids(ids)}
    if token_count is not None:
        entry["token_count"] = len(ids) if token_count == -1 else int(token_count)
    return entry


def hex_bytes(value: object, where: str, error: type[Exception] = AccuracyInputError) -> bytes:
    """The bytes of a hex field of a LoadGen accuracy-log entry (``data``, ``token_data``), e.g.
    ``"0A000000"`` -> ``b"\\n\\x00\\x00\\x00"``. Raises ``error("<where>: expected a hex string, got
    <type>")`` or ``error("<where>: not a hex string")``; used by the gate and by ``sut.record.test06``."""
    if not isinstance(value, str):
        raise error(f"{where}: expected a hex string, got {type(value).__name__}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise error(f"{where}: not a hex string") from None


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def read_accuracy_log(path: str | os.PathLike) -> list[LogEntry]:
    """Parse ``mlperf_log_accuracy.json``.

    Raises:
        AccuracyInputError: file missing/unreadable, not a JSON list, an entry without an
            integer ``qsl_idx`` or a hex ``data`` string, a ``token_count`` that is not an integer, or an empty
            list (a performance-mode log; run LoadGen in AccuracyOnly mode).
    """
    path = Path(path)
    if path.is_dir():
        why = locality_folder_why(path)
        if why:
            raise AccuracyInputError(f"accuracy log {path} {why}")
        raise AccuracyInputError(f"accuracy log {path} is a folder: pass --accuracy-log "
                                 f"{path / 'mlperf_log_accuracy.json'}")
    why = locality_folder_why(path.parent)
    if why:  # a log planted in a locality run folder (or one of its case folders) scores no MLPerf run
        raise AccuracyInputError(f"accuracy log {path}: its folder {why}")
    try:
        records = parse_json(read_regular(path, MAX_LOG_BYTES).decode("utf-8"))  # too deep: a JSONDecodeError
    except BoundedReadError as e:
        if e.problem == MISSING:
            raise AccuracyInputError(f"accuracy log {path} not found: pass --accuracy-log "
                                     "RUN_DIR/mlperf_log_accuracy.json") from None
        if e.problem in (NOT_REGULAR, TOO_LARGE, GREW):
            raise AccuracyInputError(f"accuracy log {path} is not a regular file of at most {MAX_LOG_BYTES:,} bytes "
                                     "(a FIFO, device or larger file is never read): pass LoadGen's "
                                     "mlperf_log_accuracy.json") from None
        raise AccuracyInputError(f"accuracy log {path} is not readable JSON: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AccuracyInputError(f"accuracy log {path} is not readable JSON: {exc}") from None
    if not_mlperf(records):
        raise AccuracyInputError(f"accuracy log {path} is a {not_mlperf_kind(records)} record "
                                 f"(python -m sut.locality): {NOT_MLPERF}")
    if not isinstance(records, list):
        raise AccuracyInputError(f"accuracy log {path}: expected a JSON list of LoadGen records, got {type(records).__name__}")
    if not records:
        raise AccuracyInputError(
            f"accuracy log {path} is empty: LoadGen logs responses only in AccuracyOnly mode (was this a performance run?)"
        )
    entries = []
    for pos, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise AccuracyInputError(f"accuracy log {path}: entry {pos} is not an object")
        qsl_idx = _as_int(rec.get("qsl_idx"))
        if qsl_idx is None:
            raise AccuracyInputError(f"accuracy log {path}: entry {pos} has no integer 'qsl_idx'")
        raw = hex_bytes(rec.get("data"), f"accuracy log {path}: entry {pos} (qsl_idx {qsl_idx}) 'data'")
        where = f"accuracy log {path}: entry {pos} (qsl_idx {qsl_idx})"
        entries.append(LogEntry(pos, qsl_idx, _token_count(rec, where), raw))
    return entries


def _token_count(rec: dict, where: str) -> int | None:
    """``rec``'s ``token_count``: None when absent (the coverage check reports it), else a whole number; anything
    else (a string, null, NaN, Infinity, a fraction) is ``AccuracyInputError`` naming ``where``, as
    ``python -m sut test06-verify`` refuses it."""
    if "token_count" not in rec:
        return None
    count = _as_int(rec["token_count"])
    if count is None:
        raise AccuracyInputError(f"{where} 'token_count' must be an integer, got {rec['token_count']!r}")
    return count


@dataclass
class LogCheck:
    """Outcome of :func:`check_log`. All lists hold ``qsl_idx`` values, sorted.

    Attributes:
        expected_samples: dataset size N (qsl_idx must cover 0..N-1 once each).
        log_entries: number of logged responses.
        dtype_error: None, or why the bytes are not little-endian int32 token ids.
        missing, duplicated, unknown_qsl_idx, too_long, empty, multiple_trailing_eos,
        out_of_vocab: offending samples.
        token_count_mismatch: ``{"qsl_idx", "token_count", "decoded_tokens"}`` per bad entry.
        eos_not_last: samples with an EOS before the last position (a warning only).
        unique: first logged entry per qsl_idx in [0, N), in qsl_idx order (evaluation.py
            de-duplicates keeping the first occurrence).
    """

    expected_samples: int
    log_entries: int
    dtype_error: str | None
    missing: list[int]
    duplicated: list[int]
    unknown_qsl_idx: list[int]
    token_count_mismatch: list[dict]
    too_long: list[int]
    empty: list[int]
    multiple_trailing_eos: list[int]
    out_of_vocab: list[int]
    eos_not_last: list[int]
    unique: list[LogEntry]

    @property
    def passed(self) -> bool:
        """True when nothing above fails (``eos_not_last`` is only a warning)."""
        return not self.failures()

    @property
    def decodable(self) -> bool:
        """True when the ids can be detokenized (no dtype problem, all ids in the vocabulary)."""
        return self.dtype_error is None and not self.out_of_vocab

    def failures(self) -> list[str]:
        """One readable sentence per failed check, naming up to 10 samples each."""
        out = []
        if self.dtype_error:
            out.append(self.dtype_error)

        def add(ids: Sequence, what: str) -> None:
            if ids:
                out.append(f"{len(ids)} sample(s) {what}: qsl_idx {_preview(ids)}")

        add(self.missing, "missing from the log")
        add(self.duplicated, "logged more than once")
        add(self.unknown_qsl_idx, f"with qsl_idx outside the dataset [0, {self.expected_samples})")
        add([m["qsl_idx"] for m in self.token_count_mismatch], "with token_count != number of int32 ids in data")
        add(self.too_long, f"longer than {MAX_NEW_TOKENS} new tokens")
        add(self.empty, "with no token at all")
        add(self.multiple_trailing_eos, "ending in more than one EOS token")
        if not self.dtype_error:
            add(self.out_of_vocab, "with ids outside the tokenizer vocabulary")
        return out

    def to_dict(self) -> dict:
        """JSON-ready summary (plain ints and strings only)."""
        return {
            "passed": self.passed,
            "expected_samples": int(self.expected_samples),
            "log_entries": int(self.log_entries),
            "unique_samples": len(self.unique),
            "dtype": "int32" if self.dtype_error is None else "wrong",
            "dtype_error": self.dtype_error,
            "missing": list(self.missing),
            "duplicated": list(self.duplicated),
            "unknown_qsl_idx": list(self.unknown_qsl_idx),
            "token_count_mismatch": list(self.token_count_mismatch),
            "too_long": list(self.too_long),
            "empty": list(self.empty),
            "multiple_trailing_eos": list(self.multiple_trailing_eos),
            "out_of_vocab": list(self.out_of_vocab),
            "warnings": {"eos_not_last": list(self.eos_not_last)},
            "failures": self.failures(),
        }


def _preview(ids: Sequence, limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in list(ids)[:limit])
    return shown + (f", ... (+{len(ids) - limit} more)" if len(ids) > limit else "")


#: An int32 log whose every second id is 0 (``!`` in Llama 3) over at least this many ids is taken for int64.
INT64_MIN_HIGH_WORDS = 8


def _int64_error(nonempty: Sequence[LogEntry], eos: np.ndarray) -> str | None:
    """Why the log looks int64-encoded (each id followed by a zero high word), whatever ``token_count`` says.

    The layout: every response a whole number of 8-byte ids, every odd int32 word zero and some
    even word not. ``token_count`` may be the id count (half the words) or bytes / 4 (the words).
    A real int32 log with ``0`` at every odd position is all but impossible for text, but a tiny
    log could show it by chance, so the layout also needs evidence: ``token_count`` at half the
    words, at least :data:`INT64_MIN_HIGH_WORDS` zero odd words, or an EOS followed only by one
    zero word (an int32 SUT stops at the first EOS; an int64 one writes EOS's zero high half).
    """
    if not all(len(e.raw) % 8 == 0 for e in nonempty):
        return None
    words = [e.ids() for e in nonempty]
    if any(w[1::2].any() for w in words) or not any(w[0::2].any() for w in words):
        return None
    counts_half = all(e.token_count is not None and e.token_count * 2 == len(w) for e, w in zip(nonempty, words))
    counts_words = all(e.token_count is not None and e.token_count == len(w) for e, w in zip(nonempty, words))
    high_words = sum(len(w) // 2 for w in words)
    eos_then_zero = bool(eos.size) and any(len(w) >= 2 and bool(np.isin(w[-2], eos)) for w in words)
    if not (counts_half or high_words >= INT64_MIN_HIGH_WORDS or eos_then_zero):
        log.warning("every second int32 word of the log is 0 (an int64 layout?) over only %d id(s); "
                    "checking it as int32", high_words)
        return None
    why = ("token_count is half the int32 length" if counts_half else
           "token_count counts 4-byte words, so it matches the int32 length but not the ids" if counts_words else
           f"{high_words} zero high words")
    return ("the ids look int64-encoded (8 bytes per id: every other int32 word is zero; " + why + "); the SUT must "
            "send little-endian int32 ids (numpy int32 .tobytes()), as evaluation.py --dtype int32 reads them")


def _detect_dtype_error(entries: Sequence[LogEntry], vocab_size: int, eos: np.ndarray | None = None) -> str | None:
    """Why the log is not little-endian int32 token ids, or None if it looks right."""
    odd = [e.qsl_idx for e in entries if len(e.raw) % 4]
    if odd:
        return (
            f"response data of {len(odd)} sample(s) is not a multiple of 4 bytes (qsl_idx {_preview(sorted(odd))}): "
            "not int32 token ids; the SUT must send little-endian int32 ids (numpy int32 .tobytes())"
        )
    nonempty = [e for e in entries if e.raw]
    if not nonempty:
        return None
    int64 = _int64_error(nonempty, np.asarray([] if eos is None else eos, dtype=np.int64))
    if int64:
        return int64

    def in_vocab(ids: np.ndarray) -> bool:
        return bool(((ids >= 0) & (ids < vocab_size)).all())

    if not any(in_vocab(e.ids()) for e in nonempty):
        if all(in_vocab(e.ids().byteswap()) for e in nonempty):
            return "the ids look big-endian; the SUT must send little-endian int32 ids (numpy '<i4')"
        return (
            f"no sample decodes to ids within the vocabulary [0, {vocab_size}): the data is not int32 token ids "
            "of this tokenizer (wrong dtype, wrong tokenizer, or corrupted buffers)"
        )
    return None


def _token_count_mismatch(entries: Sequence[LogEntry]) -> list[dict]:
    """``{"qsl_idx", "token_count", "decoded_tokens"}`` per entry whose ``token_count`` is absent or differs
    from its int32 id count (``decoded_tokens`` None: not a whole number of ids), sorted by qsl_idx."""
    mismatch = []
    for e in entries:
        n_words = len(e.raw) // 4 if len(e.raw) % 4 == 0 else None
        if e.token_count is None or n_words is None or e.token_count != n_words:
            mismatch.append({"qsl_idx": e.qsl_idx, "token_count": e.token_count, "decoded_tokens": n_words})
    mismatch.sort(key=lambda m: (m["qsl_idx"], str(m["token_count"])))
    return mismatch


def _id_findings(entries: Sequence[LogEntry], vocab_size: int, eos: np.ndarray, max_new_tokens: int) -> dict[str, list[int]]:
    """The checks on the ids of int32 entries: sorted qsl_idx lists under ``too_long``, ``empty``,
    ``multiple_trailing_eos``, ``out_of_vocab`` and ``eos_not_last``."""
    found: dict[str, set[int]] = {k: set() for k in ("too_long", "empty", "multiple_trailing_eos", "out_of_vocab",
                                                      "eos_not_last")}
    for e in entries:
        ids = e.ids()
        if len(ids) > max_new_tokens:
            found["too_long"].add(e.qsl_idx)
        if len(ids) == 0:
            found["empty"].add(e.qsl_idx)
            continue
        if ((ids < 0) | (ids >= vocab_size)).any():
            found["out_of_vocab"].add(e.qsl_idx)
        is_eos = np.isin(ids, eos)
        if len(ids) >= 2 and is_eos[-1] and is_eos[-2]:
            found["multiple_trailing_eos"].add(e.qsl_idx)
        if is_eos[:-1].any() and e.qsl_idx not in found["multiple_trailing_eos"]:
            found["eos_not_last"].add(e.qsl_idx)
    return {k: sorted(v) for k, v in found.items()}


def check_log(
    entries: Sequence[LogEntry],
    expected_samples: int,
    vocab_size: int,
    eos_ids: Iterable[int],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> LogCheck:
    """Run every check of the module docstring.

    Args:
        entries: from :func:`read_accuracy_log`.
        expected_samples: dataset size N; qsl_idx 0..N-1 must each appear exactly once.
        vocab_size: valid ids are ``0 <= id < vocab_size``.
        eos_ids: the model's EOS ids.
        max_new_tokens: the output cap (128).
    """
    eos = np.asarray(sorted({int(e) for e in eos_ids}), dtype=np.int64)
    counts = Counter(e.qsl_idx for e in entries)
    dtype_error = _detect_dtype_error(entries, vocab_size, eos)
    first: dict[int, LogEntry] = {}
    for e in entries:
        if 0 <= e.qsl_idx < expected_samples and e.qsl_idx not in first:
            first[e.qsl_idx] = e
    findings = _id_findings(entries if dtype_error is None else (), vocab_size, eos, max_new_tokens)
    return LogCheck(
        expected_samples=expected_samples,
        log_entries=len(entries),
        dtype_error=dtype_error,
        missing=[i for i in range(expected_samples) if i not in counts],
        duplicated=sorted(i for i, c in counts.items() if c > 1),
        unknown_qsl_idx=sorted(i for i in counts if not 0 <= i < expected_samples),
        token_count_mismatch=_token_count_mismatch(entries),
        unique=[first[i] for i in sorted(first)],
        **findings,
    )
