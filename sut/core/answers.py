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
   ``finish_reason: "stop"`` after a few ids).

Cost: the ids are checked by numpy on the whole batch (one concatenation, one reduction); Python touches
only each answer's length and last id (O(1) per answer), never a loop over ids.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from sut.engine import GenerationSettings

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
        #: EOS ids an answer shorter than ``max_tokens`` must end in (empty: not checked).
        self._eos_set = frozenset() if generation.ignore_eos else frozenset(generation.eos_token_ids)

    def first_fault(self, token_id: int) -> Optional[str]:
        """Why a streamed first token cannot be right (outside the vocabulary), else None."""
        if self.vocab_size and not 0 <= token_id < self.vocab_size:
            return f"streamed first token {token_id}, outside the model's vocabulary [0, {self.vocab_size})"
        return None

    def fault(self, results: Sequence, asked: Optional[Sequence[int]] = None) -> Optional[tuple[int, str]]:
        """The first refused answer of ``results`` (``Completion``-likes with ``token_ids``) as
        ``(its index in results, why)``, else None; ``why`` names what came back. ``asked``: per result, the
        ``max_tokens`` its request asked for itself (0 or None: the run's). A wrong length is named first, then
        an id outside the vocabulary, then a missing EOS."""
        if not results:
            return None
        arrays = [r.token_ids for r in results]
        bad_len = no_eos = None
        for i, a in enumerate(arrays):  # per answer, O(1) each: its length and last id
            n, own = len(a), asked[i] if asked else 0
            lo, hi = self.generation.lengths_for(own) if own else (self.lo, self.hi)
            if not lo <= n <= hi:
                bad_len = i
                break
            if no_eos is None and self._eos_set and n < (own or self.max_tokens) and a[-1] not in self._eos_set:
                no_eos = i
        if bad_len is not None:
            own = asked[bad_len] if asked else 0
            lo, hi = self.generation.lengths_for(own) if own else (self.lo, self.hi)
            span = f"exactly {hi}" if lo == hi else f"{lo} to {hi}"
            return bad_len, (f"answered {len(arrays[bad_len])} generated ids, the generation settings ask for {span} "
                             f"(not a complete answer): {show_ids(arrays[bad_len])}")
        if self.vocab_size:
            flat = np.asarray(arrays[0]) if len(arrays) == 1 else np.concatenate(arrays)
            hit = self._out_of_vocab(flat)
            if hit is not None:
                ends = np.cumsum([len(a) for a in arrays])
                i = int(np.searchsorted(ends, hit, side="right"))
                pos = hit - (int(ends[i - 1]) if i else 0)
                return i, (f"answered id {int(flat[hit])} at position {pos} of {len(arrays[i])}, outside the model's "
                           f"vocabulary [0, {self.vocab_size}): {show_ids(arrays[i])}")
        if no_eos is not None:
            a, eos = arrays[no_eos], self._eos_set
            most = (asked[no_eos] if asked else 0) or self.max_tokens
            return no_eos, (f"answered {len(a)} ids, fewer than max_tokens {most}, ending in {int(a[-1])}, not an EOS "
                            f"id {sorted(eos)} (an answer cut short): {show_ids(a)}")
        return None

    def _out_of_vocab(self, flat: np.ndarray) -> Optional[int]:
        """Position in ``flat`` of the first id outside ``[0, vocab_size)``, else None (one reduction
        for int32 ids: as unsigned, a negative id is above every vocabulary)."""
        if flat.dtype == np.int32:
            if int(flat.view(np.uint32).max()) < self.vocab_size:
                return None
        elif int(flat.min()) >= 0 and int(flat.max()) < self.vocab_size:
            return None
        return int(np.flatnonzero((flat < 0) | (flat >= self.vocab_size))[0])
