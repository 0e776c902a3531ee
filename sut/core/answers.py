"""The one check of every answer before the ledger (and LoadGen) sees it, whatever the transport.

The dispatcher runs :meth:`AnswerCheck.fault` on each batch of completions a transport delivers
(``sut.core.dispatcher``: in-process engines, ``vllm serve`` over HTTP and Flame alike), after it has
checked that each came from the replica its request was routed to. An answer (``Completion.token_ids``,
the generated ids, 1-D, not yet cut at EOS) is refused when:

1. its length is outside ``GenerationSettings.output_lengths`` (exactly ``max_tokens`` with
   ``ignore_eos``, else ``max(1, min_tokens)`` to ``max_tokens``; a request that asked its own
   ``Request.max_tokens``: ``GenerationSettings.lengths_for`` that many, and rule 3 against it);
2. an id is outside the model's vocabulary ``[0, vocab_size)`` (``config.json`` ``vocab_size``, read by
   ``sut.engine.read_model_info``; 0: unknown, not checked);
3. it is shorter than ``max_tokens`` and its last id is not one of the model's EOS ids
   (``GenerationSettings.eos_token_ids``: ``generation_config.json`` ``eos_token_id``), unless the run
   ignores EOS or knows no EOS id. vLLM ends a sequence early only at an EOS / stop id, which is the
   last id of the output; anything else is an answer cut short (a server or proxy that says
   ``finish_reason: "stop"`` after a few ids);
4. an EOS id comes before its last id, unless the run ignores EOS (then EOS ids are ids like any other and
   every one counts): the engine did not stop at a stop id it was given, so what follows the EOS is not the
   answer the settings ask for.

Cost: the batch becomes one :class:`~sut.ledger.response.Answers` (one concatenation; the ledger cuts the
same arrays at EOS, so it is made once per delivery: :meth:`AnswerCheck.check`); ids are checked by one
numpy reduction over all of them and EOS ids found by one pass (``Answers.cut_lengths``, which the ledger's
cut reuses); Python touches only each answer's length and last id and each EOS position (O(1) per answer),
never a loop over ids. An answer that is not a row of ids at all is refused first.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import numpy as np

from sut.engine import GenerationSettings
from sut.ledger.response import Answers, EosIds, unusable

#: Ids shown in full in a message; longer answers show their first and last ``SHOW_EDGE``.
SHOW_ALL, SHOW_EDGE = 12, 5


def show_ids(ids) -> str:
    """``ids`` for a message: all of them when few, else the first and last ``SHOW_EDGE`` and the count."""
    a = np.asarray(ids).tolist()
    if len(a) <= SHOW_ALL:
        return str(a)
    return f"[{', '.join(map(str, a[:SHOW_EDGE]))}, ... ({len(a) - 2 * SHOW_EDGE} more), {', '.join(map(str, a[-SHOW_EDGE:]))}]"


class AnswerCheck:
    """The rules of the module docstring for one run.

    Args:
        generation: the run's sampling (``max_tokens``, ``min_tokens``, ``ignore_eos``, ``eos_token_ids``).
        vocab_size: the model's vocabulary size (``config.json`` ``vocab_size``); 0: ids are not checked.
    """

    def __init__(self, generation: GenerationSettings, vocab_size: int = 0):
        if vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
        self.generation = generation
        self.lo, self.hi = generation.output_lengths
        self.max_tokens = generation.max_tokens
        self.vocab_size = int(vocab_size)
        #: EOS ids an answer shorter than ``max_tokens`` must end in, and no answer may hold before its end
        #: (empty: not checked).
        self._eos_set = frozenset() if generation.ignore_eos else frozenset(generation.eos_token_ids)
        self._eos = EosIds(self._eos_set)

    def first_fault(self, firsts: Sequence) -> Optional[tuple[int, str]]:
        """The first streamed first token of ``firsts`` (``FirstToken``-likes: ``rid``, ``token_id``) that cannot be
        right (outside the vocabulary) as ``(its rid, why)``, else None; one comparison a token."""
        vocab = self.vocab_size
        if vocab:
            for f in firsts:
                if not 0 <= f.token_id < vocab:
                    return f.rid, f"streamed first token {f.token_id}, outside the model's vocabulary [0, {vocab})"
        return None

    def fault(self, results: Sequence, asked: Optional[Sequence[int]] = None) -> Optional[tuple[int, str]]:
        """The first refused answer of ``results`` (``Completion``-likes with ``token_ids``) as
        ``(its index in results, why)``, else None; ``why`` names what came back. ``asked``: per result, the
        ``max_tokens`` its request asked for itself (0 or None: the run's). An answer that is not ids is named
        first, then a wrong length, then an id outside the vocabulary, then a missing EOS, then an EOS before the
        end."""
        return self.check(results, asked)[0]

    def check(self, results: Sequence, asked: Optional[Sequence[int]] = None
              ) -> tuple[Optional[tuple[int, str]], Optional[Answers]]:
        """``(fault(results, asked), the results' answers)``: the ``Answers`` (one per result, in order) for the
        ledger to cut; None when an answer is not ids (that is the fault)."""
        if not results:
            return None, None
        answers, bad = Answers.of([r.token_ids for r in results])
        if bad:
            why = unusable(results[bad[0]].token_ids)
            return (bad[0], f"answered something that is not a row of token ids: {why!r}"), None
        return self._fault(answers, asked), answers

    def _fault(self, answers: Answers, asked: Optional[Sequence[int]]) -> Optional[tuple[int, str]]:
        """:meth:`fault` over one delivery's ``Answers`` (module docstring): per answer its length and last id,
        one numpy reduction over every id."""
        lengths, starts, flat = answers.lengths, answers.starts, answers.flat
        asked = asked if asked and any(asked) else None
        spans = [self.generation.lengths_for(own) for own in asked] if asked else None
        lo, hi = self.lo, self.hi
        for i, n in enumerate(lengths):
            if spans:
                lo, hi = spans[i]
            if not lo <= n <= hi:
                span = f"exactly {hi}" if lo == hi else f"{lo} to {hi}"
                return i, (f"answered {n} generated ids, the generation settings ask for {span} "
                           f"(not a complete answer): {show_ids(answers.row(i))}")
        if self.vocab_size and flat.size:
            hit = self._out_of_vocab(flat, answers.umax())
            if hit is not None:
                i = bisect.bisect_right(starts, hit) - 1
                return i, (f"answered id {int(flat[hit])} at position {hit - starts[i]} of {lengths[i]}, "
                           f"outside the model's vocabulary [0, {self.vocab_size}): {show_ids(answers.row(i))}")
        eos, most = self._eos_set, self.max_tokens
        if eos:
            for i, n in enumerate(lengths):
                top = (asked[i] or most) if asked else most
                if 0 < n < top and flat[starts[i] + n - 1] not in eos:
                    a = answers.row(i)
                    return i, (f"answered {n} ids, fewer than max_tokens {top}, ending in {int(a[-1])}, not an EOS "
                               f"id {sorted(eos)} (an answer cut short): {show_ids(a)}")
            return self._early_eos(answers)
        return None

    def _early_eos(self, answers: Answers) -> Optional[tuple[int, str]]:
        """Rule 4: the first answer that its first EOS id cuts short (``Answers.cut_lengths``, which the ledger's cut
        then reuses), as ``(index, why)``."""
        cut, lengths = answers.cut_lengths(self._eos), answers.lengths
        if cut is lengths:  # no answer holds an EOS id before its end (or at all)
            return None
        i = next((i for i, (c, n) in enumerate(zip(cut, lengths)) if c != n), None)
        if i is None:
            return None
        a = answers.row(i)
        return i, (f"answered EOS id {int(a[cut[i] - 1])} at position {cut[i] - 1} of {lengths[i]} ids, not at the "
                   f"end (the engine did not stop at an EOS id it was given): {show_ids(a)}")

    def _out_of_vocab(self, flat: np.ndarray, umax: Optional[int]) -> Optional[int]:
        """Position in ``flat`` of the first id outside ``[0, vocab_size)``, else None. ``umax``: the delivery's
        :meth:`Answers.umax` (int32 ids: one reduction, a negative id reads above every vocabulary; None for
        other types)."""
        if umax is not None:
            if umax < self.vocab_size:
                return None
        elif int(flat.min()) >= 0 and int(flat.max()) < self.vocab_size:
            return None
        return int(np.flatnonzero((flat < 0) | (flat >= self.vocab_size))[0])
