"""Sentence splitting exactly as the reference's pinned nltk 3.8.1 does it, on any nltk ≥ 3.9.

The reference ``evaluation.py`` runs with nltk 3.8.1, whose ``sent_tokenize`` is a
``PunktSentenceTokenizer`` unpickled from ``punkt/english.pickle``. nltk 3.10.2 changed two
regular expressions of ``PunktLanguageVars`` (the algorithm and the English model are the same):

- ``_re_non_word_chars`` now includes the curly quotes ‘ ’ “ ” and the guillemets « », so a
  period directly followed by one (``said “Go.” Then``) becomes a candidate boundary — 3.8.1 never
  split there;
- ``re_boundary_realignment`` includes them too, so they stay with the sentence before.

nltk 3.10.4 also compiles every pattern with the third-party ``regex`` engine (nltk.redos) instead
of the standard ``re``; the two can differ on Unicode classes such as ``\\W`` and ``\\d``.

:func:`sent_tokenize` therefore builds nltk's own ``PunktSentenceTokenizer`` from the installed
``punkt_tab`` English parameters (no pickle is loaded) with :class:`Nltk381LanguageVars` and
:class:`Nltk381Token`, which hold nltk 3.8.1's regular expressions verbatim, compiled with ``re``
(nltk is Apache-2.0; the patterns are copied from ``nltk/tokenize/punkt.py`` of 3.8.1).
The splitting algorithm itself is nltk's installed code: identical to 3.8.1's in every release
up to 3.10.4 apart from the patterns above (checked by diffing the sources).
"""

from __future__ import annotations

import re
from typing import Sequence

from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer, PunktToken

from accuracy.punkt_data import PUNKT_TAB_RESOURCE

#: nltk 3.8.1 ``_re_non_punct`` (module level in punkt.py).
_RE_NON_PUNCT = re.compile(r"[^\W\d]", re.UNICODE)


class Nltk381LanguageVars(PunktLanguageVars):
    """``PunktLanguageVars`` with nltk 3.8.1's patterns (ASCII quotes only), compiled with ``re``."""

    __slots__ = ()

    sent_end_chars = (".", "?", "!")
    internal_punctuation = ",:;"
    re_boundary_realignment = re.compile(r'["\')\]}]+?(?:\s+|(?=--)|$)', re.MULTILINE)
    _re_word_start = r"[^\(\"\`{\[:;&\#\*@\)}\]\-,]"
    _re_multi_char_punct = r"(?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)"
    _word_tokenize_fmt = r"""(
        %(MultiChar)s
        |
        (?=%(WordStart)s)\S+?  # Accept word characters until end is found
        (?= # Sequences marking a word's end
            \s|                                 # White-space
            $|                                  # End-of-string
            %(NonWord)s|%(MultiChar)s|          # Punctuation
            ,(?=$|\s|%(NonWord)s|%(MultiChar)s) # Comma if at end of word
        )
        |
        \S
    )"""
    _period_context_fmt = r"""
        %(SentEndChars)s             # a potential sentence ending
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            \s+(?P<next_tok>\S+)     # or whitespace and some other token
        ))"""

    @property
    def _re_sent_end_chars(self) -> str:
        return "[%s]" % re.escape("".join(self.sent_end_chars))

    @property
    def _re_non_word_chars(self) -> str:
        return r"(?:[)\";}\]\*:@\'\({\[%s])" % re.escape("".join(sorted(set(self.sent_end_chars) - {"."})))

    def _word_tokenizer_re(self):
        try:
            return self._re_word_tokenizer
        except AttributeError:
            self._re_word_tokenizer = re.compile(
                self._word_tokenize_fmt % {"NonWord": self._re_non_word_chars, "MultiChar": self._re_multi_char_punct,
                                           "WordStart": self._re_word_start},
                re.UNICODE | re.VERBOSE,
            )
            return self._re_word_tokenizer

    def period_context_re(self):
        try:
            return self._re_period_context
        except AttributeError:
            self._re_period_context = re.compile(
                self._period_context_fmt % {"NonWord": self._re_non_word_chars, "SentEndChars": self._re_sent_end_chars},
                re.UNICODE | re.VERBOSE,
            )
            return self._re_period_context


class Nltk381Token(PunktToken):
    """``PunktToken`` with nltk 3.8.1's property patterns, compiled with ``re``."""

    __slots__ = ()

    _RE_ELLIPSIS = re.compile(r"\.\.+$")
    _RE_NUMERIC = re.compile(r"^-?[\.,]?\d[\d,\.-]*\.?$")
    _RE_INITIAL = re.compile(r"[^\W\d]\.$", re.UNICODE)
    _RE_ALPHA = re.compile(r"[^\W\d]+$", re.UNICODE)

    @property
    def is_non_punct(self):
        return _RE_NON_PUNCT.search(self.type)


_SPLITTERS: dict[str, PunktSentenceTokenizer] = {}


def reference_splitter() -> PunktSentenceTokenizer:
    """The English splitter of nltk 3.8.1, with the ``punkt_tab`` parameters nltk finds
    (built once per model location).

    Raises:
        LookupError: no ``punkt_tab`` English model on ``nltk.data.path`` (callers check with
            :func:`accuracy.punkt_data.ensure_punkt` first).
    """
    import nltk
    from nltk.tokenize.punkt import load_punkt_params

    pointer = nltk.data.find(PUNKT_TAB_RESOURCE)
    tok = _SPLITTERS.get(str(pointer))
    if tok is None:
        tok = PunktSentenceTokenizer(load_punkt_params(pointer), lang_vars=Nltk381LanguageVars(), token_cls=Nltk381Token)
        _SPLITTERS[str(pointer)] = tok
    return tok


def sent_tokenize(text: str) -> list[str]:
    """``nltk.sent_tokenize(text)`` as nltk 3.8.1 (the reference's pin) returns it."""
    return reference_splitter().tokenize(text)


def split_all(texts: Sequence[str]) -> list[list[str]]:
    """:func:`sent_tokenize` of each text (the splitter is looked up once)."""
    tok = reference_splitter()
    return [tok.tokenize(t) for t in texts]
