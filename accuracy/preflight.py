"""Resolve the accuracy gate's tokenizer before a run starts, with a hint that fits the run's data.

The gate runs after the last sample (hours into a full accuracy run); everything it needs that
can be known before the run is checked here instead, so that a missing tokenizer is bad input
(``python -m sut run`` exit 2, no run folder) rather than "accuracy gate could not run" at the end.

The check is cheap: :func:`accuracy.tokenizer.find_tokenizer` looks at file names and a first line
only (loading the synthetic word-level tokenizer alone takes seconds; the gate loads it once, later).

Which tokenizer fits: the one that made the dataset's ``tok_input``. The project's synthetic data
(``python -m sut synthetic``, the demo) is recognisable by every record's ``instruction`` being
:data:`SYNTHETIC_INSTRUCTION` (``sut/synthetic.py`` ``make_records``); its word-level tokenizer is
written by ``--tokenizer-out``, by the demo into a folder ``tokenizer`` next to the dataset. Any other
file is taken for CNN/DailyMail tokenized with Llama 3's tokenizer (the MLPerf ``cnn_eval.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

from accuracy.dataset import read_dataset_json
from accuracy.errors import AccuracyInputError, TokenizerNotFoundError
from accuracy.tokenizer import find_tokenizer

#: ``instruction`` of every record ``python -m sut synthetic`` writes (``sut/synthetic.py``).
SYNTHETIC_INSTRUCTION = {"llama": "synthetic"}

#: Folder the demo writes the synthetic tokenizer to, next to the dataset (``sut/demo.py``).
SYNTHETIC_TOKENIZER_DIR = "tokenizer"

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


def tokenizer_hint(dataset: str | os.PathLike) -> str:
    """What to pass for ``dataset``: ``--tokenizer`` with the tokenizer that made its ids, or ``--no-accuracy-gate``."""
    dataset = Path(dataset)
    if is_synthetic_dataset(dataset):
        folder = dataset.parent / SYNTHETIC_TOKENIZER_DIR
        try:
            find_tokenizer(folder)
            use = f"pass --tokenizer {folder} (the synthetic word-level tokenizer written next to it)"
        except TokenizerNotFoundError:
            use = ("pass --tokenizer PATH with the word-level tokenizer written for it "
                   "(python -m sut synthetic --tokenizer-out PATH)")
        return f"{dataset} is the project's synthetic data: {use}, {_NO_GATE}"
    return (f"pass --tokenizer PATH with the tokenizer that made {dataset.name}'s tok_input; for CNN/DailyMail the "
            f"Llama 3 tokenizer (a Llama-3.1-8B-Instruct folder, or a tiktoken tokenizer.model such as "
            f"{LLAMA3_TOKENIZER_EXAMPLE}), {_NO_GATE}")


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
