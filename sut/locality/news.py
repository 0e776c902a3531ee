"""News-text documents and questions for synthetic-locality traces (``--text news``).

Source: a cnn_eval-format JSON file (``sut/data/dataset.py``: a list of records with ``input``, the
article text, and ``tok_input``, the Llama 3 ids of the filled prompt template). Two ways to get ids:

* **tokenizer** (``--tokenizer PATH``: an HF tokenizer folder or ``tokenizer.json``, loaded with
  ``transformers.AutoTokenizer``, or a Llama 3 tiktoken ``tokenizer.model``; see
  ``accuracy/tokenizer.py``): each record's ``input`` is tokenized without BOS or any special
  token; articles inside a document are joined by the ids of ``"\\n\\n"``; questions are
  :data:`QUESTION_TEMPLATES` tokenized the same way.
* **the file's ids** (no tokenizer): each record's ``tok_input`` minus the longest prefix and the
  longest suffix common to *all* records (BOS + the instruction up to ``"Article:\\n"``, and
  ``"Summary:"``: 26 and 2 ids in the public file), i.e. the article's own ids (the last one may carry
  the template's ``"\\n\\n"``, merged by BPE with the article's final punctuation). Without a
  tokenizer no text can be tokenized, so articles are joined with no separator, and question ``q``
  of a document is the opening ids of another article (length drawn like a random question) followed
  by the stripped template suffix (``"Summary:"``): real text, distinct within the document.

Documents: the target length of each document is drawn as for random text (``doc_tokens`` ±
``doc_jitter``); a document is the articles of a seeded permutation joined and cut to exactly that
length. Every document starts with its own article, and articles whose first 256 ids repeat an earlier
article's are dropped, so two documents never share their first 256-token block (the router's block).
Every id must be below ``id_limit`` (Llama 3: 128,000, where the special tokens start): an article
or template that tokenizes to a special or unknown-word id is refused, naming the record or template.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from accuracy.dataset import DatasetFileError, read_dataset_json
from sut.errors import DatasetError

log = logging.getLogger(__name__)

#: Question ``q`` of a document (``n = q + 1``) uses template ``(offset + q) % len``, the offset drawn
#: per document; the number keeps the questions of one document distinct.
QUESTION_TEMPLATES = (
    "\n\nQuestion {n}: What is the main news in the text above?\nAnswer:",
    "\n\nQuestion {n}: Who are the people named in the articles above?\nAnswer:",
    "\n\nQuestion {n}: Summarize the text above in one sentence.\nAnswer:",
    "\n\nQuestion {n}: Where and when did the events described above take place?\nAnswer:",
    "\n\nQuestion {n}: Which organizations are mentioned in the text above?\nAnswer:",
    "\n\nQuestion {n}: What happened last, according to the text above?\nAnswer:",
    "\n\nQuestion {n}: List three facts from the text above.\nAnswer:",
    "\n\nQuestion {n}: What is the tone of the articles above?\nAnswer:",
)
SEPARATOR = "\n\n"
FIRST_BLOCK = 256  # documents never share their first block of this many ids (the study's router block)


@dataclass(frozen=True)
class NewsCorpus:
    """Tokenized articles of one file.

    Attributes:
        source: what the ids came from (file, tokenizer or stripped template), for logs and records.
        articles: int32 id arrays (shape ``(n_i,)``, no BOS), first 256 ids distinct between articles.
        separator: ids placed between two articles of a document (may be empty).
        encode: text -> ids (tokenizer mode), else None.
        tail: ids ending every question in file-ids mode (the template's stripped suffix).
        templates: the question templates (tokenizer mode).
    """

    source: str
    articles: tuple
    separator: np.ndarray = field(repr=False)
    encode: Optional[Callable[[str], list]] = field(default=None, repr=False, compare=False)
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)
    templates: tuple = QUESTION_TEMPLATES


def _records(path: str) -> list:
    try:
        records = read_dataset_json(Path(path))
    except DatasetFileError as e:
        raise DatasetError(path, e.reason) from None
    if not isinstance(records, list) or not records:
        raise DatasetError(path, "must be a non-empty JSON list of records")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DatasetError(path, f"record must be a JSON object, got {type(rec).__name__}", i)
    return records


def _ids(arr, id_limit: int, what: str) -> np.ndarray:
    a = np.asarray(arr, dtype=np.int64)
    bad = np.flatnonzero((a < 0) | (a >= id_limit))
    if bad.size:
        raise ValueError(f"{what}: id {int(a[bad[0]])} at position {int(bad[0])} is outside [0, {id_limit}) "
                         "(a special token or an unknown word of this tokenizer)")
    return a.astype(np.int32)


@functools.lru_cache(maxsize=2)
def _load_tokenizer(tokenizer: str):
    from accuracy.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer)


def _tokenized(path: str, records: list, tokenizer: str, id_limit: int, templates: tuple) -> NewsCorpus:
    tok = _load_tokenizer(tokenizer)
    if tok.vocab_size <= id_limit:
        raise ValueError(f"news: the tokenizer {tokenizer} has {tok.vocab_size:,} ids, not more than id_limit {id_limit:,}: "
                         "news traces need a Llama 3-vocabulary tokenizer (text ids below 128,000, BOS 128,000)")
    arts = []
    for i, rec in enumerate(records):
        text = rec.get("input")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(path, "must be a non-empty string (the article text)", i, "input")
        arts.append(_ids(tok.encode(text), id_limit, f"{path}: record {i}, field 'input'"))
    for t in templates:
        try:
            _ids(tok.encode(t.format(n=1)), id_limit, f"question template {t!r}")
        except ValueError as e:
            raise ValueError(f"{e}: the tokenizer {tokenizer} cannot encode the question templates as plain text ids "
                             "(it adds special tokens of its own, as the demo's synthetic tokenizer does); omit "
                             "--tokenizer to use the dataset's own tok_input ids, or pass a Llama 3 tokenizer") from None
    sep = _ids(tok.encode(SEPARATOR), id_limit, "article separator")
    return NewsCorpus(f"{path} tokenized with {tok.description}", tuple(arts), sep, tok.encode, templates=templates)


def _common_prefix(rows: list, reverse: bool = False) -> int:
    first = rows[0][::-1] if reverse else rows[0]
    n = len(first)
    for r in rows[1:]:
        r = r[::-1] if reverse else r
        m = min(n, len(r))
        diff = np.flatnonzero(first[:m] != r[:m])
        n = int(diff[0]) if diff.size else m
    return n


def _file_ids(path: str, records: list, id_limit: int) -> NewsCorpus:
    rows = []
    for i, rec in enumerate(records):
        tok = rec.get("tok_input")
        if not isinstance(tok, list) or not tok or any(type(t) is not int for t in tok):
            raise DatasetError(path, "must be a non-empty list of integer token ids", i, "tok_input")
        huge = next((j for j, t in enumerate(tok) if not -2 ** 31 <= t < 2 ** 31), None)
        if huge is not None:  # before numpy, which cannot hold an id beyond int64; the vocabulary check comes below
            raise DatasetError(path, f"id {tok[huge]} at position {huge} is no token id (beyond 32 bits)", i,
                               "tok_input")
        rows.append(np.asarray(tok, dtype=np.int64))
    if len(rows) < 2:
        raise DatasetError(path, "needs at least 2 records to find the prompt template common to all (or pass --tokenizer)")
    head, tail = _common_prefix(rows), _common_prefix(rows, reverse=True)
    arts = []
    for i, r in enumerate(rows):
        body = r[head:len(r) - min(tail, max(0, len(r) - head - 1))]
        if body.size == 0:
            raise DatasetError(path, f"nothing left after stripping the {head}-id template head", i, "tok_input")
        arts.append(_ids(body, id_limit, f"{path}: record {i}, field 'tok_input' (template stripped)"))
    tail_ids = rows[0][len(rows[0]) - tail:] if tail else np.zeros(0, dtype=np.int64)
    return NewsCorpus(f"{path} tok_input ids (template head of {head} ids, BOS included, and tail of {tail} ids "
                      "common to all records stripped)", tuple(arts), np.zeros(0, dtype=np.int32),
                      tail=_ids(tail_ids, id_limit, f"{path}: template tail"))


def _distinct_openings(corpus: NewsCorpus) -> NewsCorpus:
    seen, kept = set(), []
    for a in corpus.articles:
        key = a[:FIRST_BLOCK].tobytes()
        if key not in seen:
            seen.add(key)
            kept.append(a)
    if len(kept) < len(corpus.articles):
        log.info("news: %d of %d articles dropped (their first %d ids repeat an earlier article's)",
                 len(corpus.articles) - len(kept), len(corpus.articles), FIRST_BLOCK)
    return NewsCorpus(corpus.source, tuple(kept), corpus.separator, corpus.encode, corpus.tail, corpus.templates)


@functools.lru_cache(maxsize=4)
def _load(path: str, stamp: tuple, tokenizer: Optional[str], id_limit: int, templates: tuple) -> NewsCorpus:
    records = _records(path)
    corpus = (_tokenized(path, records, tokenizer, id_limit, templates) if tokenizer
              else _file_ids(path, records, id_limit))
    corpus = _distinct_openings(corpus)
    log.info("news: %d articles, %d ids, from %s", len(corpus.articles), sum(len(a) for a in corpus.articles),
             corpus.source)
    return corpus


def load_corpus(dataset: str, tokenizer: Optional[str] = None, id_limit: int = 128000,
                templates: Sequence[str] = QUESTION_TEMPLATES) -> NewsCorpus:
    """Read and tokenize the articles of a cnn_eval-format file (cached per file version and tokenizer).

    Raises:
        DatasetError (a ``ValueError``): unreadable file, a bad record (names record and field).
        ValueError: an id outside ``[0, id_limit)`` (names record or template); a tokenizer that cannot
            be loaded (``accuracy.errors.TokenizerNotFoundError``).
    """
    try:
        st = os.stat(dataset)
    except OSError as e:
        raise DatasetError(dataset, f"cannot read: {e.strerror}") from None
    return _load(str(dataset), (st.st_mtime_ns, st.st_size), str(tokenizer) if tokenizer else None, id_limit,
                 tuple(templates))


def make_documents(corpus: NewsCorpus, rng: np.random.Generator, lengths: Sequence[int]) -> list[np.ndarray]:
    """One int32 document per target length (exactly that long), each starting with its own article.

    Raises:
        ValueError: fewer articles than documents.
    """
    n, docs = len(corpus.articles), []
    if n < len(lengths):
        raise ValueError(f"news: {corpus.source} has {n} usable articles, fewer than the {len(lengths)} documents "
                         "(every document starts with its own article)")
    order = rng.permutation(n)
    fill = itertools.cycle(order[len(lengths):] if n > len(lengths) else order)
    for d, length in enumerate(lengths):
        parts, total = [corpus.articles[order[d]]], len(corpus.articles[order[d]])
        while total < length:
            a = corpus.articles[next(fill)]
            parts += [corpus.separator, a]
            total += len(corpus.separator) + len(a)
        docs.append(np.concatenate(parts)[:length].astype(np.int32))
    return docs


def make_questions(corpus: NewsCorpus, rng: np.random.Generator, counts: Sequence[int], lo: int,
                   hi: int) -> list[list[np.ndarray]]:
    """``questions[d][q]``: int32 ids of question ``q`` of document ``d`` (see the module docstring).

    Args:
        counts: questions per document. lo, hi: question length range in ids (file-ids mode draws
            from it; every question must fit ``hi``).

    Raises:
        ValueError: a question longer than ``hi`` ids (raise ``--question-tokens``).
    """
    out = []
    if corpus.encode is not None:
        cache: dict = {}
        for n in counts:
            k0 = int(rng.integers(len(corpus.templates)))
            qs = []
            for q in range(n):
                text = corpus.templates[(k0 + q) % len(corpus.templates)].format(n=q + 1)
                if text not in cache:
                    cache[text] = np.asarray(corpus.encode(text), dtype=np.int32)
                qs.append(cache[text])
            out.append(qs)
    else:
        arts = corpus.articles
        for n in counts:
            picks = rng.choice(len(arts), size=n, replace=n > len(arts))
            out.append([np.concatenate([arts[a][:max(1, int(rng.integers(lo, hi + 1)) - len(corpus.tail))],
                                        corpus.tail]).astype(np.int32) for a in picks])
    longest = max(len(q) for qs in out for q in qs)
    if longest > hi:
        raise ValueError(f"news: a question has {longest} tokens, more than 1.5 x --question-tokens = {hi}; "
                         f"raise --question-tokens to at least {-(-longest * 2 // 3)}")
    return out


def news_parts(corpus: NewsCorpus, ts, rng: np.random.Generator, counts: Sequence[int]) -> tuple[list, list]:
    """Documents and questions of a news trace with settings ``ts`` (``trace.TraceSettings``), drawn
    from ``rng`` in a fixed order (document lengths, documents, questions): deterministic in the seed."""
    lo, hi = int(ts.doc_tokens * (1 - ts.doc_jitter)), int(ts.doc_tokens * (1 + ts.doc_jitter))
    lengths = [int(rng.integers(max(lo, 1), hi + 1)) for _ in range(ts.documents)]
    docs = make_documents(corpus, rng, lengths)
    qlo, qhi = max(1, ts.question_tokens // 2), int(ts.question_tokens * 1.5)
    keys = {d[:FIRST_BLOCK].tobytes() for d in docs}
    if len(keys) < len(docs):
        raise ValueError(f"news: two documents share their first {FIRST_BLOCK} tokens ({corpus.source})")
    return docs, make_questions(corpus, rng, counts, qlo, qhi)
