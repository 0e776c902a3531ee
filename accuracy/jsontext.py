"""JSON parsing for the readers of input files (datasets, accuracy logs, reference scores, run records).

``json.loads`` raises ``RecursionError`` (not ``json.JSONDecodeError``) for a text nested deeper
than Python's recursion limit (``[`` x 100,000 is valid JSON); :func:`parse_json` raises
:class:`JSONTooDeepError`, a ``json.JSONDecodeError``, instead, so that every reader's
``except json.JSONDecodeError`` (or ``ValueError``) turns it into its own bad-input error (exit 2).

Usage::

    from accuracy.jsontext import parse_json

    try:
        records = parse_json(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:   # also a too deeply nested text
        raise MyInputError(f"{path}: malformed JSON: {e}") from None

:func:`read_jsonl` reads a JSON Lines file that a run appends to as it goes (``find_qps.py``'s tries,
``sut.locality``'s ``cases.jsonl``): a last line without its newline that is not JSON was cut off by a
killed run and is skipped (reported back), any other line that is not JSON is a :class:`JSONLinesError`
naming file and line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


class JSONTooDeepError(json.JSONDecodeError):
    """A JSON text nested deeper than Python's recursion limit. ``str()`` says so, without a position
    (the parser does not report where it gave up)."""

    def __init__(self, doc: str):
        msg = f"nested deeper than Python's recursion limit ({sys.getrecursionlimit()}) allows"
        super().__init__(msg, doc, 0)
        self.args = (msg,)

    def __reduce__(self):
        return self.__class__, (self.doc,)


class JSONNumberTooLongError(json.JSONDecodeError):
    """A JSON integer longer than Python converts (``sys.get_int_max_str_digits``, 4,300 digits by default)."""

    def __init__(self, reason: str):
        msg = f"a number too long to read ({reason})"
        super().__init__(msg, "", 0)
        self.args = (msg,)

    def __reduce__(self):
        return self.__class__, (self.args[0],)


def parse_json(text: str | bytes | bytearray):
    """``json.loads(text)``; raises ``json.JSONDecodeError`` for malformed JSON, :class:`JSONTooDeepError` for a
    text nested too deeply and :class:`JSONNumberTooLongError` for an integer of more digits than Python converts
    (both ``json.JSONDecodeError`` subclasses, so every caller's bad-input path takes them)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeepError(text if isinstance(text, str) else "") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # int('1' * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise JSONNumberTooLongError(str(e)) from None


class JSONLinesError(ValueError):
    """A line of a JSON Lines file that is not JSON; ``str()`` is ``"<path> line <n>: not JSON (<why>)"``.
    ``path``, ``line`` (1-based) and ``reason`` (the parser's message) are kept for callers' own messages."""

    def __init__(self, path: Path, line: int, reason: str):
        super().__init__(f"{path} line {line}: not JSON ({reason})")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True)
class JSONLines:
    """What :func:`read_jsonl` read: ``records`` (line number, 1-based, and parsed value of every line that
    is not blank, in file order) and ``cut_line`` (the number of the cut-off last line skipped, else None)."""

    records: list[tuple[int, Any]]
    cut_line: Optional[int] = None


def read_jsonl(path: str | Path, allow_cut_last: bool = True, max_bytes: Optional[int] = None) -> JSONLines:
    """Parse the JSON Lines file ``path`` (lines end with ``\\n``; blank lines are skipped), each line with
    :func:`parse_json`.

    With ``allow_cut_last``, a last line that has no newline after it and is not JSON is taken as a write
    cut off by a killed process: skipped, its number in ``cut_line``. Raises :class:`JSONLinesError` naming
    the file and line for any other line that is not JSON or not UTF-8, and ``OSError`` when the file cannot
    be read. With ``max_bytes``, the file is read by ``accuracy.boundedread.read_regular``: a FIFO, device or
    folder, or a file over ``max_bytes``, raises its ``BoundedReadError`` before a byte is read."""
    path = Path(path)
    if max_bytes is None:
        raw = path.read_bytes()
    else:
        from accuracy.boundedread import read_regular

        raw = read_regular(path, max_bytes)
    lines = raw.split(b"\n")  # ends with b"" when the last line has its newline
    records: list[tuple[int, Any]] = []
    for n, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            records.append((n, parse_json(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if allow_cut_last and n == len(lines):
                return JSONLines(records, n)
            reason = f"not UTF-8 ({e.reason} at byte {e.start})" if isinstance(e, UnicodeDecodeError) else str(e)
            raise JSONLinesError(path, n, reason) from None
    return JSONLines(records)
