"""Offline tokenizer loading for the accuracy gate: detokenize generated ids to text.

Accepted forms of ``path`` (nothing is ever fetched from the network):

1. A Hugging Face tokenizer or model folder holding ``tokenizer.json`` (with or without
   ``tokenizer_config.json``), loaded with ``transformers.AutoTokenizer`` and
   ``local_files_only=True``; if that fails, with ``PreTrainedTokenizerFast`` directly.
   A folder with only ``tokenizer.json`` (the ``tokenizers`` library's format) is supported.
2. A ``tokenizer.json`` file itself (``PreTrainedTokenizerFast(tokenizer_file=...)``).
3. A Llama 3 tiktoken-format ``tokenizer.model`` (lines ``<base64 token> <rank>``), or a
   folder holding one (also under ``original/``), loaded with ``tiktoken`` using the Llama 3
   split regex and the 256 special tokens at ids 128000..128255
   (:data:`accuracy.constants.LLAMA3_PATTERN`).

Decoding follows mlcommons/inference ``language/llama3.1-8b/evaluation.py``:
``batch_decode(ids, skip_special_tokens=True)`` with transformers 4.46.2 (its pinned version).
That version applies ``clean_up_tokenization_spaces`` when the tokenizer config asks for it,
and Llama-3.1-8B-Instruct's ``tokenizer_config.json`` sets it to true (public reports:
huggingface/transformers issues #35175 and #40088). transformers ≥ 5 skips that clean-up for
BPE tokenizers, so this module applies the 4.46-style clean-up itself
(:func:`clean_up_tokenization`) whenever the tokenizer's config enables it; the tiktoken
loader enables it by default, as the Llama 3.1 Instruct HF config does.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from accuracy.constants import (
    LLAMA3_NAMED_SPECIALS,
    LLAMA3_NUM_BASE_TOKENS,
    LLAMA3_NUM_SPECIAL_TOKENS,
    LLAMA3_PATTERN,
)
from accuracy.errors import AccuracyInputError, TokenizerNotFoundError
from accuracy.jsontext import parse_json

log = logging.getLogger(__name__)

#: What ``--tokenizer`` accepts, used in error messages.
ACCEPTED_FORMS = (
    "pass --tokenizer PATH pointing at a Hugging Face tokenizer/model folder "
    "with tokenizer.json, a tokenizer.json file, or a Llama 3 tiktoken-format tokenizer.model "
    "(for CNN/DailyMail: the Llama-3.1-8B-Instruct model folder; for the harness's synthetic data: the tokenizer "
    "folder written next to it)"
)

# transformers 4.46 ``PreTrainedTokenizerBase.clean_up_tokenization``: these replacements, in
# this order, applied to the decoded string (public behaviour of the library).
_CLEANUP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """Apply transformers' (≤ 4.x) ``clean_up_tokenization`` string replacements to ``text``."""
    for old, new in _CLEANUP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


@dataclass
class Detokenizer:
    """A loaded tokenizer reduced to what the gate needs.

    Attributes:
        description: human-readable kind and path, for logs and ``accuracy.json``.
        vocab_size: number of valid ids; an id ``i`` is valid iff ``0 <= i < vocab_size``.
        eos_ids: the tokenizer's own EOS id(s), possibly empty (model folders usually state
            the generation EOS list in ``generation_config.json``; see :func:`resolve_eos_ids`).
        clean_up_spaces: whether decoding applies :func:`clean_up_tokenization`.
        folder: folder the tokenizer came from (where ``generation_config.json`` is looked for).
    """

    description: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    clean_up_spaces: bool
    folder: Path
    _hf: Any = field(default=None, repr=False)
    _tiktoken: Any = field(default=None, repr=False)
    _special_start: int = field(default=0, repr=False)

    def decode_batch(self, sequences: Sequence[Sequence[int]], clean_up_spaces: bool | None = None) -> list[str]:
        """Decode each id sequence to text, skipping special tokens.

        Args:
            sequences: ``n`` sequences of token ids (lists or 1-D integer arrays), all valid
                ids (``0 <= id < vocab_size``; the caller checks).
            clean_up_spaces: override :attr:`clean_up_spaces` for this call.

        Returns:
            ``n`` strings (not stripped; undecodable UTF-8 bytes become U+FFFD).
        """
        cleanup = self.clean_up_spaces if clean_up_spaces is None else clean_up_spaces
        seqs = [[int(i) for i in s] for s in sequences]
        if self._hf is not None:
            texts = self._hf.batch_decode(seqs, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        else:
            start = self._special_start
            texts = [self._tiktoken.decode([i for i in s if i < start], errors="replace") for s in seqs]
        if cleanup:
            texts = [clean_up_tokenization(t) for t in texts]
        return list(texts)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS or any other special token (for tests and tools)."""
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tiktoken.encode(text, disallowed_special=()))


def _is_tiktoken_file(path: Path) -> bool:
    """True if the first line of ``path`` looks like ``<base64> <int rank>``."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).strip()
    except OSError:
        return False
    parts = first.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken BPE rank file (``<base64 token> <rank>`` per line).

    Raises:
        AccuracyInputError: a line is malformed or ranks repeat.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (binascii.Error, ValueError, IndexError):
                raise AccuracyInputError(f"{path}: line {lineno} is not '<base64 token> <rank>'") from None
            ranks[token] = rank
    if len(set(ranks.values())) != len(ranks):
        raise AccuracyInputError(f"{path}: repeated ranks; not a tiktoken BPE file")
    return ranks


def _llama3_special_tokens(start: int) -> dict[str, int]:
    specials: dict[str, int] = {}
    reserved = 0
    for offset in range(LLAMA3_NUM_SPECIAL_TOKENS):
        tid = start + offset
        name = LLAMA3_NAMED_SPECIALS.get(tid) if start == LLAMA3_NUM_BASE_TOKENS else None
        if name is None:
            name = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
        specials[name] = tid
    return specials


def load_tiktoken_llama3(path: str | os.PathLike, clean_up_spaces: bool = True) -> Detokenizer:
    """Load a Llama 3 tiktoken-format ``tokenizer.model``.

    Args:
        path: the rank file (128,000 lines for Llama 3/3.1).
        clean_up_spaces: apply :func:`clean_up_tokenization` when decoding (default True, as
            the Llama-3.1-8B-Instruct HF ``tokenizer_config.json`` with transformers 4.46.2).

    Returns:
        a :class:`Detokenizer` with vocabulary ``len(ranks) + 256`` and ``eos_ids`` = ()
        (the EOS list comes from ``generation_config.json`` or the Llama 3.1 default).
    """
    import tiktoken

    path = Path(path)
    ranks = read_tiktoken_ranks(path)
    n_base = len(ranks)
    if n_base != LLAMA3_NUM_BASE_TOKENS:
        log.warning("%s has %d ranks, not Llama 3's %d; special ids placed at %d..", path, n_base, LLAMA3_NUM_BASE_TOKENS, n_base)
    enc = tiktoken.Encoding(
        name=f"llama3:{path}",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=_llama3_special_tokens(n_base),
    )
    return Detokenizer(
        description=f"tiktoken Llama 3 ({path})",
        vocab_size=n_base + LLAMA3_NUM_SPECIAL_TOKENS,
        eos_ids=(),
        clean_up_spaces=clean_up_spaces,
        folder=path.parent,
        _tiktoken=enc,
        _special_start=n_base,
    )


def _wrap_hf(tok: Any, description: str, folder: Path) -> Detokenizer:
    eos = getattr(tok, "eos_token_id", None)
    eos_ids: tuple[int, ...] = ()
    if isinstance(eos, int):
        eos_ids = (eos,)
    elif isinstance(eos, (list, tuple)):
        eos_ids = tuple(int(e) for e in eos)
    return Detokenizer(
        description=description,
        vocab_size=int(len(tok)),
        eos_ids=eos_ids,
        clean_up_spaces=bool(getattr(tok, "clean_up_tokenization_spaces", False)),
        folder=folder,
        _hf=tok,
    )


def load_hf_folder(folder: str | os.PathLike) -> Detokenizer:
    """Load a Hugging Face tokenizer from a local folder, never touching the network.

    Tries ``AutoTokenizer.from_pretrained(folder, local_files_only=True)``; if that raises and
    the folder has ``tokenizer.json``, falls back to ``PreTrainedTokenizerFast`` on that file.

    Raises:
        TokenizerNotFoundError: neither way works.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(folder)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return _wrap_hf(tok, f"HF {type(tok).__name__} ({folder})", folder)
    except Exception as exc:  # transformers raises many kinds here (OSError, ValueError, KeyError...)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerNotFoundError(f"{folder}: AutoTokenizer failed ({exc}); {ACCEPTED_FORMS}") from exc
        log.warning("AutoTokenizer could not load %s (%s); using PreTrainedTokenizerFast on tokenizer.json", folder, exc)
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tj))
    except Exception as exc:
        raise TokenizerNotFoundError(f"{tj}: not a loadable tokenizers file ({exc}); {ACCEPTED_FORMS}") from exc
    return _wrap_hf(tok, f"HF PreTrainedTokenizerFast ({tj})", folder)


def find_tokenizer(path: str | os.PathLike | None, forms: str | None = ACCEPTED_FORMS) -> tuple[str, Path]:
    """Locate the tokenizer at ``path`` without loading it (cheap: only file names and a first line are read).

    Args:
        path: folder or file (see the module docstring for accepted forms).
        forms: what to pass instead, appended to every error message (default :data:`ACCEPTED_FORMS`;
            None: nothing, the caller adds its own).

    Returns:
        ``(form, file or folder)``: ``("hf-file", tokenizer.json)``, ``("tiktoken", tokenizer.model)`` or
        ``("hf-folder", folder)``.

    Raises:
        TokenizerNotFoundError: missing path or no recognised tokenizer there; the message ends with ``forms``.
    """
    tail = f"; {forms}" if forms else ""
    if path is None or str(path) == "":
        raise TokenizerNotFoundError(f"no tokenizer given{tail}")
    p = Path(path)
    if not p.exists():
        raise TokenizerNotFoundError(f"tokenizer path {p} does not exist{tail}")
    if p.is_file():
        if p.suffix == ".json":
            return "hf-file", p
        if _is_tiktoken_file(p):
            return "tiktoken", p
        raise TokenizerNotFoundError(
            f"{p}: not a tiktoken rank file or tokenizer.json (a sentencepiece .model is not supported){tail}")
    if not p.is_dir():  # a FIFO, device or socket: neither a file to read nor a folder to look in
        raise TokenizerNotFoundError(f"{p}: not a regular file or folder (a device, FIFO or socket){tail}")
    if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
        return "hf-folder", p
    for cand in (p / "tokenizer.model", p / "original" / "tokenizer.model"):
        if cand.is_file() and _is_tiktoken_file(cand):
            return "tiktoken", cand
    found = sorted(x.name for x in p.iterdir())[:20]
    raise TokenizerNotFoundError(f"no tokenizer in folder {p} (it holds {found}){tail}")


def load_tokenizer(path: str | os.PathLike | None, clean_up_spaces: bool | None = None) -> Detokenizer:
    """Load the model's tokenizer from ``path`` (see the module docstring for accepted forms).

    Args:
        path: folder or file; None or '' is an error naming what to pass.
        clean_up_spaces: force the decode clean-up on/off; None follows the tokenizer's
            config (HF) or True (Llama 3 tiktoken file).

    Raises:
        TokenizerNotFoundError: missing path or no recognised tokenizer there (:func:`find_tokenizer`), or
            it does not load; the message names the accepted forms.
    """
    form, found = find_tokenizer(path)
    det: Detokenizer
    if form == "hf-file":
        from transformers import PreTrainedTokenizerFast

        try:
            det = _wrap_hf(PreTrainedTokenizerFast(tokenizer_file=str(found)), f"HF PreTrainedTokenizerFast ({found})",
                           found.parent)
        except Exception as exc:
            raise TokenizerNotFoundError(f"{found}: not a loadable tokenizers file ({exc}); {ACCEPTED_FORMS}") from exc
    elif form == "tiktoken":
        det = load_tiktoken_llama3(found)
        if Path(path).is_dir():
            det.folder = Path(path)
    else:
        det = load_hf_folder(found)
    if clean_up_spaces is not None:
        det.clean_up_spaces = clean_up_spaces
    log.info("tokenizer: %s, vocab %d, clean-up spaces %s", det.description, det.vocab_size, det.clean_up_spaces)
    return det


def _eos_from_json(path: Path) -> tuple[int, ...] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = parse_json(f.read()).get("eos_token_id")  # too deep: a ValueError
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


#: Token ids are little-endian int32 in the accuracy log: an EOS id is one of ``[0, INT32_END)``.
INT32_END = 1 << 31


def _int32_ids(ids: tuple[int, ...], source: str) -> tuple[int, ...]:
    """``ids`` when each is in ``[0, INT32_END)``; else ``AccuracyInputError`` naming ``source`` and the id."""
    bad = [e for e in ids if not 0 <= e < INT32_END]
    if bad:
        raise AccuracyInputError(f"EOS id {bad[0]} ({source}) is not an int32 token id (0 to {INT32_END - 1}): "
                                 "pass the model's EOS ids, e.g. --eos-ids 128001,128008,128009")
    return ids


def resolve_eos_ids(
    explicit: Sequence[int] | None, det: Detokenizer, llama3_default: Sequence[int] | None = None,
    explicit_source: str = "--eos-ids",
) -> tuple[tuple[int, ...], str]:
    """Choose the EOS ids used by the trailing-EOS check and the EOS share.

    Order: ``explicit`` (given by the caller; ``explicit_source`` names where from: ``--eos-ids``, a
    ``run.json``, the harness's model folder); ``eos_token_id`` of ``generation_config.json`` then
    ``config.json`` in the tokenizer's folder; the tokenizer's own EOS; ``llama3_default``
    (Llama-3.1-8B-Instruct's 128001, 128008, 128009) for a tiktoken Llama 3 tokenizer.

    Returns:
        ``(ids, source)`` where ``source`` says where they came from.

    Raises:
        AccuracyInputError: none found (pass ``--eos-ids``), or an id outside int32's ``[0, 2**31)`` (naming where
            it came from).
    """
    if explicit:
        return _int32_ids(tuple(int(e) for e in explicit), explicit_source), explicit_source
    for name in ("generation_config.json", "config.json"):
        cand = det.folder / name
        ids = _eos_from_json(cand) if cand.is_file() else None
        if ids:
            return _int32_ids(ids, f"{cand} eos_token_id"), str(cand)
    if det.eos_ids:
        return det.eos_ids, "tokenizer eos_token"
    if det._tiktoken is not None and llama3_default:
        return tuple(llama3_default), "Llama-3.1-8B-Instruct generation_config default"
    raise AccuracyInputError(
        f"no EOS ids known for {det.description}: pass --eos-ids 128001,128008,128009 (run_gate(eos_ids=...)) "
        "or put generation_config.json next to the tokenizer"
    )
