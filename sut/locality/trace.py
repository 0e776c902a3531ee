"""Deterministic synthetic-locality traces.

A trace is ``documents`` documents of about ``doc_tokens`` tokens (uniform ±``doc_jitter``), each
asked several questions of about ``question_tokens`` tokens; one request's prompt is
``BOS + document + question``, so all questions of a document share the document as a prefix
(what prefix caching and prefix-affinity routing exploit). Token ids are uniform random in
``[0, id_limit)`` (below the Llama 3 special tokens): the trace has real prompt lengths and real
sharing, not real text.

Popularity: with ``zipf_s = 0`` every document gets ``questions`` questions; with ``zipf_s > 0``
the ``documents x questions`` questions are spread over documents with weights ``1 / rank^zipf_s``
(at least one each), so a few hot documents draw most traffic — the case that makes
cache-affinity routers pile work onto one replica.

Arrival order (``order``): ``shuffled`` (random permutation of all requests), ``by_document``
(all questions of document 0, then document 1, ...), ``round_robin`` (question 0 of every
document, then question 1, ...: the longest reuse distance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ORDERS = ("shuffled", "by_document", "round_robin")


@dataclass(frozen=True)
class TraceSettings:
    """Shape of a synthetic-locality trace (all lengths in tokens).

    Attributes:
        documents: number of documents.
        doc_tokens: mean document length (default 8,192: "documents of ~8K tokens").
        doc_jitter: document lengths are uniform in ``doc_tokens x [1 - j, 1 + j]``.
        questions: questions per document (mean, when ``zipf_s > 0``).
        question_tokens: mean question length; uniform ±50 %.
        max_tokens: output tokens per request (generation; fixed with ``ignore_eos``).
        zipf_s: document popularity skew (0 = uniform).
        order: arrival order, one of ``ORDERS``.
        seed: RNG seed; the same settings always give the same trace.
        bos: id prepended to every prompt (Llama 3 ``<|begin_of_text|>`` = 128000).
        id_limit: token ids are drawn from ``[0, id_limit)``.
    """

    documents: int = 32
    doc_tokens: int = 8192
    doc_jitter: float = 0.10
    questions: int = 4
    question_tokens: int = 48
    max_tokens: int = 128
    zipf_s: float = 0.0
    order: str = "shuffled"
    seed: int = 0
    bos: int = 128000
    id_limit: int = 128000

    def __post_init__(self):
        if self.documents < 1 or self.questions < 1:
            raise ValueError(f"documents and questions must be >= 1, got {self.documents}, {self.questions}")
        if self.doc_tokens < 1 or self.question_tokens < 2 or self.max_tokens < 1:
            raise ValueError("doc_tokens >= 1, question_tokens >= 2 and max_tokens >= 1 are required")
        if not 0 <= self.doc_jitter < 1:  # also refuses NaN
            raise ValueError(f"doc_jitter must be in [0, 1), got {self.doc_jitter}")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise ValueError(f"zipf_s must be a finite number >= 0, got {self.zipf_s}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt the settings can produce (size ``max_model_len`` ≥ this + ``max_tokens``)."""
        return 1 + int(self.doc_tokens * (1 + self.doc_jitter)) + int(self.question_tokens * 1.5) + 1


@dataclass(frozen=True)
class TraceRequest:
    """One request: ``rid`` (position in arrival order), its ``document`` and ``question`` index,
    the int32 ``prompt`` (shape ``(n,)``) and ``prefix_tokens`` (BOS + document: the part shared with
    the document's other questions)."""

    rid: int
    document: int
    question: int
    prompt: np.ndarray
    prefix_tokens: int


def questions_per_document(ts: TraceSettings) -> list[int]:
    """How many questions each document gets (sums to ``documents x questions``)."""
    total = ts.documents * ts.questions
    if ts.zipf_s == 0:
        return [ts.questions] * ts.documents
    w = 1.0 / np.arange(1, ts.documents + 1) ** ts.zipf_s
    extra = total - ts.documents  # one each, the rest by weight
    counts = 1 + np.floor(extra * w / w.sum()).astype(int)
    for i in np.argsort(-w)[: total - int(counts.sum())]:  # hand out the rounding remainder to the hottest
        counts[i] += 1
    return [int(c) for c in counts]


def make_trace(ts: TraceSettings) -> list[TraceRequest]:
    """Build the trace; deterministic in ``ts``."""
    rng = np.random.default_rng(ts.seed)
    lo, hi = int(ts.doc_tokens * (1 - ts.doc_jitter)), int(ts.doc_tokens * (1 + ts.doc_jitter))
    docs = [rng.integers(0, ts.id_limit, size=int(rng.integers(max(lo, 1), hi + 1)), dtype=np.int32)
            for _ in range(ts.documents)]
    qlo, qhi = max(1, ts.question_tokens // 2), int(ts.question_tokens * 1.5)
    pairs = []
    for d, n in enumerate(questions_per_document(ts)):
        for q in range(n):
            question = rng.integers(0, ts.id_limit, size=int(rng.integers(qlo, qhi + 1)), dtype=np.int32)
            pairs.append((d, q, np.concatenate([np.array([ts.bos], dtype=np.int32), docs[d], question]), 1 + len(docs[d])))
    if ts.order == "shuffled":
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    elif ts.order == "round_robin":
        pairs.sort(key=lambda x: (x[1], x[0]))
    return [TraceRequest(rid=i, document=d, question=q, prompt=p, prefix_tokens=n) for i, (d, q, p, n) in enumerate(pairs)]


def describe(trace: list[TraceRequest]) -> dict:
    """Summary: requests, documents, prompt-length stats, the hottest document's share of requests,
    and the shared-prefix share (tokens a perfect cache could skip / all prompt tokens)."""
    lens = np.array([len(r.prompt) for r in trace])
    count: dict[int, int] = {}
    prefix: dict[int, int] = {}
    for r in trace:
        count[r.document] = count.get(r.document, 0) + 1
        prefix[r.document] = r.prefix_tokens
    reusable = sum((n - 1) * prefix[d] for d, n in count.items())
    return {"requests": len(trace), "documents": len(count), "prompt_tokens": int(lens.sum()),
            "prompt_mean": round(float(lens.mean()), 1), "prompt_max": int(lens.max()),
            "hot_document_share": round(max(count.values()) / len(trace), 4),
            "reusable_share_upper_bound": round(reusable / float(lens.sum()), 4)}
