"""Exceptions of the accuracy gate.

An :class:`AccuracyInputError` means the gate could not judge the run at all (a file is
missing or unreadable, the tokenizer or the NLTK data is absent, the log is not LoadGen's
format): ``python -m accuracy`` exits 2. A log that is readable but wrong (missing samples,
wrong ``token_count``, ...) is not an exception: the gate fails with exit code 1 and lists the
offending samples in ``accuracy.json``.
"""

from __future__ import annotations


class AccuracyInputError(ValueError):
    """An input of the gate is missing or malformed. ``str()`` says what and what to pass. Exit code 2 (the
    ``exit_code`` attribute is what ``sut.exits`` reads when the harness calls the gate)."""

    exit_code = 2


class TokenizerNotFoundError(AccuracyInputError, FileNotFoundError):
    """No usable tokenizer at the given path. ``str()`` names the accepted forms."""


class PunktDataMissingError(AccuracyInputError, LookupError):
    """NLTK's ``punkt_tab`` English model is not installed where nltk looks."""


class UsageError(AccuracyInputError):
    """Bad command-line input of ``python -m accuracy``: printed to stderr as one "error: ..." line; exit code 2."""
