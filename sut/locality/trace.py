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

Answer lengths (``answers``): ``fixed`` (every request asks exactly ``max_tokens`` new tokens, the
study's) or ``log_uniform``: request ``i`` asks ``round(exp(U(ln min_answer_tokens, ln max_tokens)))``
tokens, drawn from a generator of its own (``seed``, stream 1), so the prompts are those of the same
trace with fixed answers; ``max_tokens`` stays the bound that sizes the engines' context.

Text (``text``): ``random`` (the above) or ``news``: documents concatenated from CNN/DailyMail
articles of a cnn_eval-format file and question templates, tokenized with the model's tokenizer
(``sut/locality/news.py``); lengths, popularity and order work the same way. ``TRACE_PRESETS`` holds
the study's two traces (``study-no-reuse``, ``study-reuse``).

For the study's protocol, ``warmup_traces`` derives warm-up traces from the measured one (ids
shifted inside the vocabulary: same lengths and prefix relations, none of the measured prefixes),
and ``input_hash`` / ``trace_hash`` identify what was sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from sut.locality import knob

ORDERS = ("shuffled", "by_document", "round_robin")
TEXTS = ("random", "news")
ANSWERS = ("fixed", "log_uniform")
#: The study's traces (``../shared/research/study.md`` §3): ~8K-token news documents, one shuffled burst,
#: 16 new tokens per request (exactly: locality runs always ignore EOS). ``trace``: TraceSettings fields;
#: ``run``: ``sut.locality.pairs.PairSettings`` fields; ``routing``: ``AffinitySettings`` fields (the study's
#: router kept every assignment: release gate ``never``). Explicit flags override any of them.
_STUDY = {"doc_tokens": 8192, "max_tokens": 16, "zipf_s": 0.0, "order": "shuffled", "text": "news"}
TRACE_PRESETS = {
    "study-no-reuse": {"trace": dict(_STUDY, documents=64, questions=1), "run": {"rate": 0.0},
                       "routing": {"release_gate": "never"}},
    "study-reuse": {"trace": dict(_STUDY, documents=64, questions=4), "run": {"rate": 0.0},
                    "routing": {"release_gate": "never"}},
}


#: Largest trace ``make_trace`` builds (requests; distinct prompt tokens, documents and questions, at most): the
#: study's are 256 requests of ~8K tokens; the bound keeps a mistyped size a clear error instead of memory
#: growing until the machine runs out (~4 bytes a token, several copies while the trace is built).
MAX_REQUESTS = 100_000
MAX_TRACE_TOKENS = 50_000_000


#: Largest Zipf exponent: at 16 the hottest document already takes all but a 2**-16 share of the extra questions
#: (larger ones overflowed numpy's power: 1e308 printed a RuntimeWarning).
MAX_ZIPF_S = 16.0

@dataclass(frozen=True)
class TraceSettings:
    """Shape of a synthetic-locality trace (all lengths in tokens).

    Attributes:
        documents: number of documents.
        doc_tokens: mean document length (default 8,192: "documents of ~8K tokens").
        doc_jitter: document lengths are uniform in ``doc_tokens x [1 - j, 1 + j]``.
        questions: questions per document (mean, when ``zipf_s > 0``).
        question_tokens: mean question length; uniform ±50 % (``text='news'``: questions come from
            templates, and ``1.5 x question_tokens`` is only a bound they must fit, else ``ValueError``).
        max_tokens: output tokens per request (generation; fixed with ``ignore_eos``); with variable
            answers the longest a request may ask.
        answers: ``fixed`` or ``log_uniform`` answer lengths (module docstring); ``min_answer_tokens``:
            the shortest of ``log_uniform``.
        zipf_s: document popularity skew (0 = uniform).
        order: arrival order, one of ``ORDERS``.
        seed: RNG seed; the same settings always give the same trace.
        bos: id prepended to every prompt (Llama 3 ``<|begin_of_text|>`` = 128000).
        id_limit: token ids are drawn from ``[0, id_limit)`` (news text: must stay below it).
        text: ``random`` token ids or ``news`` text (see the module docstring).
        dataset: ``text='news'``: the cnn_eval-format JSON file (required then; ``None`` otherwise).
        tokenizer: ``text='news'``: the model's tokenizer (HF folder, ``tokenizer.json`` or Llama 3
            tiktoken ``tokenizer.model``); ``None``: the file's ``tok_input`` ids, template stripped.
    """

    documents: int = knob(32, "number of documents")
    doc_tokens: int = knob(8192, "mean document length, tokens")
    doc_jitter: float = knob(0.10, "document lengths are uniform in doc_tokens x [1 - j, 1 + j]")
    questions: int = knob(4, "questions per document (their mean when --zipf-s > 0)")
    question_tokens: int = knob(48, "mean question length, tokens (uniform +-50%)")
    max_tokens: int = knob(128, "output tokens per request (exactly: EOS is ignored, and validation checks the length)")
    zipf_s: float = knob(0.0, "document popularity: 0 = every document gets --questions questions; s > 0 = weights "
                              "1 / rank^s, a few hot documents draw most questions")
    order: str = knob("shuffled", "arrival order: shuffled (random), by_document (all questions of a document "
                                  "together), round_robin (question 0 of every document, then question 1, ...: "
                                  "the longest reuse distance)", choices=ORDERS)
    seed: int = knob(0, "trace seed: the same settings always give the same trace")
    bos: int = 128000
    id_limit: int = 128000
    text: str = knob("random", "random token ids, or news: documents concatenated from the CNN/DailyMail articles of "
                               "--dataset, each followed by a question from a few templates (sut/locality/news.py)",
                     choices=TEXTS)
    answers: str = knob("fixed", "answer lengths: fixed (exactly --max-tokens each) or log_uniform (each request asks "
                                 "round(exp(U(ln --min-answer-tokens, ln --max-tokens))) tokens)", choices=ANSWERS)
    min_answer_tokens: int = knob(16, "--answers log_uniform: the shortest answer, tokens")
    dataset: Optional[str] = knob(None, "--text news: a cnn_eval-format JSON file (a list of records with input, "
                                        "tok_input)")
    tokenizer: Optional[str] = knob(None, "--text news: the model's tokenizer (HF folder or tokenizer.json, or a "
                                          "Llama 3 tiktoken tokenizer.model or its folder); left out: the file's "
                                          "tok_input ids, with the prompt template common to all records (BOS "
                                          "included) stripped")

    def __post_init__(self):
        if self.documents < 1 or self.questions < 1:
            raise ValueError(f"documents and questions must be >= 1, got {self.documents}, {self.questions}")
        low = [f"{k} must be >= {lo}, got {v}" for k, v, lo in (("doc_tokens", self.doc_tokens, 1), ("question_tokens",
               self.question_tokens, 2), ("max_tokens", self.max_tokens, 1)) if v < lo]
        if low:
            raise ValueError("; ".join(low))
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy's generator takes no negative seed), got {self.seed}")
        requests = self.documents * self.questions
        tokens = self.documents * self.doc_tokens * (1 + self.doc_jitter) + requests * self.question_tokens * 1.5
        if requests > MAX_REQUESTS or tokens > MAX_TRACE_TOKENS:
            raise ValueError(f"a trace of {self.documents:,} documents x {self.questions:,} questions of "
                             f"~{self.doc_tokens:,} tokens is {requests:,} requests and up to {tokens:,.0f} prompt "
                             f"tokens: more than this tool builds ({MAX_REQUESTS:,} requests, {MAX_TRACE_TOKENS:,} "
                             "tokens; the study: 64 x 4 of ~8K)")
        if not 0 <= self.doc_jitter < 1:  # also refuses NaN
            raise ValueError(f"doc_jitter must be in [0, 1), got {self.doc_jitter}")
        if not (math.isfinite(self.zipf_s) and 0 <= self.zipf_s <= MAX_ZIPF_S):
            raise ValueError(f"zipf_s must be a finite number in [0, {MAX_ZIPF_S:g}], got {self.zipf_s}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.text not in TEXTS:
            raise ValueError(f"text must be one of {TEXTS}, got {self.text!r}")
        if self.text == "news" and not self.dataset:
            raise ValueError("text 'news' needs a dataset: pass --dataset FILE (cnn_eval format), or --text random")
        if self.answers not in ANSWERS:
            raise ValueError(f"answers must be one of {ANSWERS}, got {self.answers!r}")
        if self.answers != "fixed" and not 1 <= self.min_answer_tokens <= self.max_tokens:
            raise ValueError(f"min_answer_tokens must be in [1, max_tokens={self.max_tokens}], got "
                             f"{self.min_answer_tokens}")
        if self.text == "random" and (self.dataset or self.tokenizer):
            raise ValueError("--dataset and --tokenizer apply to --text news only")

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt the settings can produce (size ``max_model_len`` ≥ this + ``max_tokens``)."""
        return 1 + int(self.doc_tokens * (1 + self.doc_jitter)) + int(self.question_tokens * 1.5) + 1


@dataclass(frozen=True)
class TraceRequest:
    """One request: ``rid`` (position in arrival order), its ``document`` and ``question`` index,
    the int32 ``prompt`` (shape ``(n,)``), ``prefix_tokens`` (BOS + document: the part shared with
    the document's other questions) and ``max_tokens`` (its own answer length; 0 = the trace's fixed
    ``max_tokens``)."""

    rid: int
    document: int
    question: int
    prompt: np.ndarray
    prefix_tokens: int
    max_tokens: int = 0


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


def _random_parts(ts: TraceSettings, rng: np.random.Generator, counts: list[int]) -> tuple[list, list]:
    """Random-token documents and questions (``questions[d][q]``), int32 arrays without BOS."""
    lo, hi = int(ts.doc_tokens * (1 - ts.doc_jitter)), int(ts.doc_tokens * (1 + ts.doc_jitter))
    docs = [rng.integers(0, ts.id_limit, size=int(rng.integers(max(lo, 1), hi + 1)), dtype=np.int32)
            for _ in range(ts.documents)]
    qlo, qhi = max(1, ts.question_tokens // 2), int(ts.question_tokens * 1.5)
    questions = [[rng.integers(0, ts.id_limit, size=int(rng.integers(qlo, qhi + 1)), dtype=np.int32) for _ in range(n)]
                 for n in counts]
    return docs, questions


def make_trace(ts: TraceSettings, corpus=None) -> list[TraceRequest]:
    """Build the trace; deterministic in ``ts`` (and, for news text, the file and tokenizer).

    Args:
        corpus: news text only: a ``news.NewsCorpus`` already loaded (e.g. with other question
            templates); default ``news.load_corpus(ts.dataset, ts.tokenizer, ts.id_limit)``.

    Raises:
        ValueError: news text that cannot make the trace (a bad file or record, too few articles,
            a question longer than the bound; the message names the file, record or template).
    """
    rng = np.random.default_rng(ts.seed)
    counts = questions_per_document(ts)
    if ts.text == "news":
        from sut.locality.news import load_corpus, news_parts

        corpus = corpus or load_corpus(ts.dataset, ts.tokenizer, ts.id_limit)
        docs, questions = news_parts(corpus, ts, rng, counts)
    else:
        docs, questions = _random_parts(ts, rng, counts)
    bos = np.array([ts.bos], dtype=np.int32)
    pairs = [(d, q, np.concatenate([bos, docs[d], question]), 1 + len(docs[d]))
             for d in range(ts.documents) for q, question in enumerate(questions[d])]
    if ts.order == "shuffled":
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    elif ts.order == "round_robin":
        pairs.sort(key=lambda x: (x[1], x[0]))
    asked = answer_lengths(ts, len(pairs))
    return [TraceRequest(rid=i, document=d, question=q, prompt=p, prefix_tokens=n, max_tokens=asked[i])
            for i, (d, q, p, n) in enumerate(pairs)]


def answer_lengths(ts: TraceSettings, n: int) -> list[int]:
    """Each request's own answer length in arrival order (``answers="log_uniform"``: module docstring), or
    zeros (``fixed``: every request asks ``max_tokens``). Drawn from ``default_rng([seed, 1])``, apart from the
    prompts' generator."""
    if ts.answers == "fixed":
        return [0] * n
    lo, hi = math.log(ts.min_answer_tokens), math.log(ts.max_tokens)
    draws = np.exp(np.random.default_rng([ts.seed, 1]).uniform(lo, hi, size=n))
    return [int(min(ts.max_tokens, max(ts.min_answer_tokens, round(x)))) for x in draws]


def describe(trace: list[TraceRequest]) -> dict:
    """Summary: requests, documents, prompt-length stats (``prompt_max``: the longest prompt of this
    trace), ``document_tokens`` (BOS + document tokens of the distinct documents: what the replicas'
    prefix caches must hold together to serve every repeat from cache), the hottest document's share
    of requests, and the shared-prefix share (tokens a perfect cache could skip / all prompt tokens)."""
    lens = np.array([len(r.prompt) for r in trace])
    count: dict[int, int] = {}
    prefix: dict[int, int] = {}
    for r in trace:
        count[r.document] = count.get(r.document, 0) + 1
        prefix[r.document] = r.prefix_tokens
    reusable = sum((n - 1) * prefix[d] for d, n in count.items())
    qlens = np.array([len(r.prompt) - r.prefix_tokens for r in trace])
    answers = {}
    if any(r.max_tokens for r in trace):
        a = np.array([r.max_tokens for r in trace])
        answers = {"answer_tokens": {"total": int(a.sum()), "mean": round(float(a.mean()), 1), "min": int(a.min()),
                                     "p50": int(np.percentile(a, 50)), "p99": int(np.percentile(a, 99)),
                                     "max": int(a.max())}}
    return {**answers,"requests": len(trace), "documents": len(count), "prompt_tokens": int(lens.sum()),
            "prompt_mean": round(float(lens.mean()), 1), "prompt_max": int(lens.max()),
            "question_mean": round(float(qlens.mean()), 1), "question_max": int(qlens.max()),
            "document_tokens": int(sum(prefix.values())),
            "hot_document_share": round(max(count.values()) / len(trace), 4),
            "reusable_share_upper_bound": round(reusable / float(lens.sum()), 4)}


# ------------------------------------------------------------------------- warm-ups and hashes
def _content_start(trace: Sequence[TraceRequest], id_limit: int) -> int:
    """1 if every prompt starts with a special id (BOS, ``>= id_limit``) that the warm-ups keep, else 0.

    Raises:
        ValueError: an id outside ``[0, id_limit)`` after that position (it could not be shifted).
    """
    start = int(all(len(r.prompt) > 1 and r.prompt[0] >= id_limit for r in trace))
    for r in trace:
        body = r.prompt[start:]
        if body.size == 0 or int(body.min()) < 0 or int(body.max()) >= id_limit:
            raise ValueError(f"request {r.rid}: ids after position {start} must lie in [0, {id_limit}) to be shifted")
    return start


def _first_free(forbidden: np.ndarray, first: int) -> Optional[int]:
    """The first index ``>= first`` (wrapping) that is not forbidden, or None."""
    order = np.roll(np.arange(forbidden.size), -first)
    free = order[~forbidden[order]]
    return int(free[0]) if free.size else None


def _shifts_first_id(firsts: np.ndarray, count: int, id_limit: int) -> list[int]:
    """Shifts that move every first id off the measured first ids and off the other warm-ups' (k = 1)."""
    firsts = np.unique(firsts)
    forbidden = np.zeros(id_limit, dtype=bool)
    forbidden[0] = True
    new, shifts = firsts, []
    for j in range(count):
        for t in new:  # shift s collides iff (a + s) % V == t for a measured first id a and a taken id t
            forbidden[(int(t) - firsts) % id_limit] = True
        s = _first_free(forbidden, (j + 1) * id_limit // (count + 1))
        if s is None:
            break
        shifts.append(s)
        new = (firsts + s) % id_limit
    return shifts


def _shifts_by_keys(keys: np.ndarray, count: int, id_limit: int) -> list[int]:
    """Shifts whose shifted ``k``-id keys meet no measured key and no other warm-up's (a scan)."""
    def shifted(s: int) -> set:
        return {row.tobytes() for row in (keys + s) % id_limit}

    taken, shifts = shifted(0), []
    for j in range(count):
        first = (j + 1) * id_limit // (count + 1)
        for i in range(id_limit - 1):
            s = 1 + (first - 1 + i) % (id_limit - 1)
            cand = shifted(s)
            if s not in shifts and cand.isdisjoint(taken):
                shifts.append(s)
                taken |= cand
                break
        else:
            break
    return shifts


def warmup_shifts(trace: Sequence[TraceRequest], count: int = 2, id_limit: int = 128000) -> list[int]:
    """``count`` shifts in ``[1, id_limit)`` for :func:`shift_trace`, chosen so that no shifted prompt
    begins like a measured prompt or like a prompt of another warm-up.

    The key of a prompt is its first ``k`` ids after BOS; a shift is taken when the shifted keys meet
    neither the measured keys nor those of the shifts already taken. ``k = 1`` (a warm-up prompt then
    shares nothing beyond BOS with any measured prompt) unless no shift qualifies (several hundred
    distinct first ids), then 2, 3, 4: at most BOS + 3 ids in common, far below one 16-token vLLM
    cache block or one 256-token router block. Deterministic: shift ``j`` is the first that qualifies
    from ``(j + 1) x id_limit / (count + 1)`` on.

    Raises:
        ValueError: ``count < 1``, ids that cannot be shifted, or no shift found.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    start = _content_start(trace, id_limit)
    shortest = min(len(r.prompt) - start for r in trace)
    shifts = _shifts_first_id(np.array([r.prompt[start] for r in trace], dtype=np.int64), count, id_limit)
    for k in range(2, min(4, shortest) + 1):
        if len(shifts) == count:
            break
        keys = np.array([r.prompt[start:start + k] for r in trace], dtype=np.int64)
        shifts = _shifts_by_keys(keys, count, id_limit)
    if len(shifts) < count:
        raise ValueError(f"no {count} id shifts keep the warm-ups' prompt openings apart from the "
                         f"{len(trace)} measured ones")
    return shifts


def shift_trace(trace: Sequence[TraceRequest], shift: int, id_limit: int = 128000) -> list[TraceRequest]:
    """The trace with every id after BOS mapped to ``(id + shift) % id_limit``; BOS kept.

    The map is a bijection on ``[0, id_limit)``, so every prompt keeps its length and any two prompts
    share exactly as long a prefix as before (``prefix_tokens`` stays true); ids stay below ``id_limit``
    (clear of the Llama 3 special tokens, ``>= 128000``). Same ``rid``, document, question and order.

    Raises:
        ValueError: ``shift % id_limit == 0`` or ids that cannot be shifted (see ``_content_start``).
    """
    if shift % id_limit == 0:
        raise ValueError(f"shift {shift} is a multiple of id_limit {id_limit}: the warm-up would be the trace itself")
    start = _content_start(trace, id_limit)
    out = []
    for r in trace:
        p = r.prompt.copy()
        p[start:] = (p[start:].astype(np.int64) + shift) % id_limit
        out.append(dataclasses.replace(r, prompt=p))
    return out


def warmup_traces(trace: Sequence[TraceRequest], count: int = 2, id_limit: int = 128000) -> list[list[TraceRequest]]:
    """The study's warm-ups: ``count`` shifted copies of ``trace`` (:func:`warmup_shifts`), each with the
    measured trace's lengths and prefix relations and none of its prefixes, nor each other's."""
    return [shift_trace(trace, s, id_limit) for s in warmup_shifts(trace, count, id_limit)]


def input_hash(prompt: np.ndarray) -> str:
    """Hex sha256 of the prompt's ids as little-endian int32 (what the validation compares)."""
    return hashlib.sha256(np.ascontiguousarray(prompt, dtype="<i4").tobytes()).hexdigest()


def trace_hash(trace: Sequence[TraceRequest]) -> str:
    """Hex sha256 over the requests in arrival order: ``rid, document, question, prefix_tokens`` (int64
    little-endian) and the 32-byte :func:`input_hash` of each, then a request's own ``max_tokens`` (int64) where
    it asks one; the trace's fixed ``max_tokens`` is recorded separately."""
    h = hashlib.sha256()
    for r in trace:
        h.update(struct.pack("<4q", r.rid, r.document, r.question, r.prefix_tokens))
        h.update(bytes.fromhex(input_hash(r.prompt)))
        if r.max_tokens:  # a request's own answer length (fixed-length traces hash as before)
            h.update(struct.pack("<q", r.max_tokens))
    return h.hexdigest()
