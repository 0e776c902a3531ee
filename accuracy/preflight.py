"""Resolve the accuracy gate's tokenizer before a run starts, with a hint that fits the run's data.

The gate runs after the last sample (hours into a full accuracy run); everything it needs that
can be known before the run is checked here instead, so that a missing tokenizer is bad input
(``python -m sut run`` exit 2, no run folder) rather than "accuracy gate could not run" at the end.

The check is cheap: :func:`accuracy.tokenizer.find_tokenizer` looks at file names and a first line
only (loading the synthetic word-level tokenizer alone takes seconds; the gate loads it once, later).

Which tokenizer fits: the one that made the dataset's ``tok_input``. The project's synthetic data
(``python -m sut synthetic``, the demo) is recognisable by every record's ``instruction`` being
:data:`SYNTHETIC_INSTRUCTION` (``sut/data/synthetic.py`` ``make_records``); its word-level tokenizer is
written by ``--tokenizer-out``, by the demo into a folder ``tokenizer`` next to the dataset. Any other
file is taken for CNN/DailyMail tokenized with Llama 3's tokenizer (the MLPerf ``cnn_eval.json``).
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from typing import Sequence

from accuracy.dataset import read_dataset_json
from accuracy.errors import AccuracyInputError, TokenizerNotFoundError
from accuracy.tokenizer import find_tokenizer

#: ``instruction`` of every record ``python -m sut synthetic`` writes (``sut/data/synthetic.py``).
SYNTHETIC_INSTRUCTION = {"llama": "synthetic"}

#: Folder the demo writes the synthetic tokenizer to, next to the dataset (``sut/run/demo.py``).
SYNTHETIC_TOKENIZER_DIR = "tokenizer"

#: Characters of a probe record's ``input`` (whitespace collapsed) that its decoded ``tok_input`` must hold.
PROBE_CHARS = 200

#: A Llama 3 tokenizer in the development set-up (README: paths under ../shared/).
LLAMA3_TOKENIZER_EXAMPLE = "../shared/data/llama3_tokenizer/tokenizer.model"

_NO_GATE = "or pass --no-accuracy-gate to run without the gate (score the run later with python -m accuracy)"


def is_synthetic_dataset(dataset: str | os.PathLike) -> bool:
    """True if ``dataset`` is the project's synthetic data (its first record's ``instruction``);
    False for anything else, unreadable files included (the dataset check reports those)."""
    try:
        records = read_dataset_json(dataset)
    except AccuracyInputError:
        return False
    first = records[0] if records else None
    return isinstance(first, dict) and first.get("instruction") == SYNTHETIC_INSTRUCTION


def tokenizer_hint(dataset: str | os.PathLike, in_a_run: bool = True) -> str:
    """What to pass for ``dataset``: ``--tokenizer`` with the tokenizer that made its ids, or (``in_a_run``: for
    ``python -m sut run``) ``--no-accuracy-gate``."""
    dataset = Path(dataset)
    no_gate = f", {_NO_GATE}" if in_a_run else ""
    if is_synthetic_dataset(dataset):
        folder = dataset.parent / SYNTHETIC_TOKENIZER_DIR
        try:
            find_tokenizer(folder)
            use = f"pass --tokenizer {folder} (the synthetic word-level tokenizer written next to it)"
        except TokenizerNotFoundError:
            use = ("pass --tokenizer PATH with the word-level tokenizer written for it "
                   "(python -m sut synthetic --tokenizer-out PATH)")
        return f"{dataset} is the project's synthetic data: {use}{no_gate}"
    return (f"pass --tokenizer PATH with the tokenizer that made {dataset.name}'s tok_input; for CNN/DailyMail the "
            f"Llama 3 tokenizer (a Llama-3.1-8B-Instruct folder, or a tiktoken tokenizer.model such as "
            f"{LLAMA3_TOKENIZER_EXAMPLE}){no_gate}")


def resolve_gate_tokenizer(tokenizer: str | os.PathLike | None, model: str | os.PathLike,
                           dataset: str | os.PathLike) -> Path:
    """The tokenizer the gate will load: ``tokenizer`` (``--tokenizer``) if given, else the model folder.

    Returns:
        that path, once :func:`accuracy.tokenizer.find_tokenizer` found a tokenizer there.

    Raises:
        TokenizerNotFoundError: none there; the message names ``--tokenizer PATH`` (fitting ``dataset``,
            see :func:`tokenizer_hint`) and ``--no-accuracy-gate``.
    """
    path = tokenizer or model
    try:
        find_tokenizer(path, forms=None)
    except TokenizerNotFoundError as e:
        what = (f"--tokenizer: {e};" if tokenizer
                else f"the accuracy gate needs a tokenizer and the model folder {model} has none:")
        raise TokenizerNotFoundError(f"{what} {tokenizer_hint(dataset)}") from None
    return Path(path)


def _squeeze(text: str) -> str:
    """``text`` NFKC-normalised (a tokenizer may normalise so) with whitespace runs collapsed to one space."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip()


def check_tokenizer_made(det, probes: Sequence[tuple], dataset: str | os.PathLike, in_a_run: bool = False) -> None:
    """Refuse a gate tokenizer that did not make the dataset although every id fits its vocabulary (another
    tokenizer of the same size: the gate would decode the outputs into other words and only FAIL at the end).

    The dataset's ``tok_input`` is its ``input`` inside the prompt template (``download_cnndm.py``; the synthetic
    data: a header then the body), so the tokenizer that made it decodes ``tok_input`` to text holding ``input``:
    the first ``PROBE_CHARS`` characters, both NFKC-normalised and whitespace collapsed, are looked for in it. A
    pass on any probe will do.

    Args:
        det: the loaded tokenizer (``accuracy.tokenizer.Detokenizer``).
        probes: ``GateData.probes``: ``(record index, input, tok_input)``; none: nothing is checked.
        dataset: the dataset path, for the message.
        in_a_run: the check runs before ``python -m sut run`` (the hint also names ``--no-accuracy-gate``).

    Raises:
        AccuracyInputError: no probe's decoded ``tok_input`` holds its ``input``, naming the records and
            what to pass (:func:`tokenizer_hint`).
    """
    checked = []
    for i, text, ids in probes:
        if not all(type(t) is int and 0 <= t < det.vocab_size for t in ids):
            checked.append(i)
            continue
        decoded = _squeeze(det.decode_batch([ids], clean_up_spaces=False)[0])
        if _squeeze(text)[:PROBE_CHARS] in decoded:
            return
        checked.append(i)
    if checked:
        which = ", ".join(map(str, checked))
        raise AccuracyInputError(
            f"the tokenizer {det.description} did not make {dataset}: it decodes the 'tok_input' of record(s) {which} "
            f"to text that does not hold their 'input', so it would score the outputs as other words; "
            f"{tokenizer_hint(dataset, in_a_run)}")
