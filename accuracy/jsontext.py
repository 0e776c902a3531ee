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
"""

from __future__ import annotations

import json
import sys


class JSONTooDeepError(json.JSONDecodeError):
    """A JSON text nested deeper than Python's recursion limit. ``str()`` says so, without a position
    (the parser does not report where it gave up)."""

    def __init__(self, doc: str):
        msg = f"nested deeper than Python's recursion limit ({sys.getrecursionlimit()}) allows"
        super().__init__(msg, doc, 0)
        self.args = (msg,)

    def __reduce__(self):
        return self.__class__, (self.doc,)


def parse_json(text: str | bytes | bytearray):
    """``json.loads(text)``; raises ``json.JSONDecodeError`` for malformed JSON and
    :class:`JSONTooDeepError` (a ``json.JSONDecodeError``) for a text nested too deeply."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeepError(text if isinstance(text, str) else "") from None
