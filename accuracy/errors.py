"""Exceptions of the accuracy gate.

An :class:`AccuracyInputError` means the gate could not judge the run at all (a file is
missing or unreadable, the tokenizer or the NLTK data is absent, the log is not LoadGen's
format): ``python -m accuracy`` exits 2. A log that is readable but wrong (missing samples,
wrong ``token_count``, ...) is not an exception: the gate fails with exit code 1 and lists the
offending samples in ``accuracy.json``.
"""

from __future__ import annotations


class AccuracyInputError(ValueError):
    """An input of the gate is missing or malformed. ``str()`` says what and what to pass."""


class TokenizerNotFoundError(AccuracyInputError, FileNotFoundError):
    """No usable tokenizer at the given path. ``str()`` names the accepted forms."""


class PunktDataMissingError(AccuracyInputError, LookupError):
    """NLTK's ``punkt_tab`` English model is not installed where nltk looks."""
