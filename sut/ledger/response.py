"""Turning generated token ids into LoadGen responses.

Rules (mlcommons/inference llama3.1-8b README, TEST06, LoadGen logging.cc):
- the response is the generated ids up to and including the first EOS, never padded (a run that ignores EOS
  gives its ledger no EOS ids: every generated id counts, as in the reference's benchmark runs);
- bytes are little-endian int32; ``size`` is in bytes; ``n_tokens`` is the number of ids;
- the buffer must stay alive until ``QuerySamplesComplete`` returns.

Per engine step, not per sample: :class:`Answers` holds one delivery's answers back to back in one
array (``flat``, with each answer's ``starts`` and ``lengths``), and :meth:`Answers.cut_lengths` finds
every answer's first EOS with one numpy pass over that array (:class:`EosIds`, made once per ledger), so
the cost of a sample is a few list operations, not numpy calls. Checks of a whole delivery (ids inside the
vocabulary, where an answer ends: ``sut.core.answers``) read the same arrays, and the answers of one
``QuerySamplesComplete`` call travel in one buffer (:class:`ResponseBatch`); so do a call's first tokens.
``cut_at_first_eos`` is the one-answer form.
"""

from __future__ import annotations

import array
import bisect
import itertools
import sys
from typing import Iterable, Optional, Sequence

import numpy as np

_LE_INT32 = np.dtype("<i4")
#: ``array.array("i")`` is little-endian int32 here (every host LoadGen runs on).
_ARRAY_IS_LE_INT32 = array.array("i").itemsize == 4 and sys.byteorder == "little"


class EosIds:
    """A model's EOS ids, prepared once for :meth:`Answers.cut_lengths`.

    ``ids``: the sorted distinct ids; ``hits(flat)`` gives the positions of ``flat`` (1-D int array) that hold one
    of them, ascending, as a list: one range test over ``[min, max]`` of the ids (Llama 3.1's 128001..128009: ids
    up there are special tokens, rare in an answer but for its final EOS) finds the few candidates, which Python
    then tests exactly.
    """

    __slots__ = ("ids", "_set", "_low", "_span", "_low32", "_span32", "_whole")

    def __init__(self, eos_ids: Iterable[int]):
        self.ids = tuple(sorted({int(i) for i in eos_ids}))
        self._set = frozenset(self.ids)
        self._low, self._span = (self.ids[0], self.ids[-1] - self.ids[0]) if self.ids else (0, -1)
        self._whole = len(self.ids) == self._span + 1  # every id of the range is an EOS id
        fits = self.ids and 0 <= self._low and self.ids[-1] < 2 ** 32
        self._low32, self._span32 = (np.uint32(self._low), np.uint32(self._span)) if fits else (None, None)

    def hits(self, flat: np.ndarray, top: Optional[int] = None) -> list[int]:
        """``top``: ``flat``'s largest id read as unsigned 32-bit, when known (:meth:`Answers.umax`): below every EOS
        id, there is no hit and no pass over ``flat``."""
        if not self.ids or not flat.size or (top is not None and top < self._low):
            return []
        if flat.dtype == np.int32 and self._low32 is not None:  # one unsigned compare: below low wraps above span
            cand = (flat.view(np.uint32) - self._low32 <= self._span32).nonzero()[0]
        else:
            cand = ((flat >= self._low) & (flat <= self._low + self._span)).nonzero()[0]
        if not cand.size:
            return []
        cand = cand.tolist()
        if self._whole:
            return cand
        eos = self._set
        return [p for p, v in zip(cand, flat[cand].tolist()) if v in eos]


class Answers:
    """One delivery's answers back to back (module docstring): ``flat`` (every answer's ids in order, the arrays'
    integer type: int32 from every transport), and per answer its ``starts`` and ``lengths`` (lists of ints).

    Build with :meth:`of`. Answer ``i`` cut at its first EOS is ``flat[starts[i]:starts[i] + cut_lengths(eos)[i]]``;
    ``le_int32()`` is the response buffer of every answer. Per answer, Python touches only its length and the ids it
    is asked for (O(1)); whole-delivery passes over ids are numpy's.
    """

    __slots__ = ("flat", "starts", "lengths", "_umax", "_cut")

    def __init__(self, flat: np.ndarray, starts: list, lengths: list):
        self.flat, self.starts, self.lengths = flat, starts, lengths
        self._umax: Optional[int] = None
        self._cut: Optional[tuple] = None  # (EOS ids, cut_lengths for them): made once for check and cut

    def umax(self) -> Optional[int]:
        """The largest id of an int32 ``flat`` read as unsigned (a negative id reads above every vocabulary and EOS
        id; 0 when empty), one reduction per delivery shared by the vocabulary check and the EOS cut; None for
        other integer types."""
        if self._umax is None and self.flat.dtype == np.int32:
            self._umax = int(self.flat.view(np.uint32).max()) if self.flat.size else 0
        return self._umax

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def of(cls, arrays: Sequence) -> tuple["Answers", list[int]]:
        """``(answers, unusable)``: the usable ones of ``arrays`` (1-D integer arrays, or sequences of ints)
        back to back, and the positions in ``arrays`` of those that are not ids (left out of ``answers``). A wider
        integer type than int32 is not narrowed here, so an id too large for int32 stays itself for the
        vocabulary check (``le_int32`` gives LoadGen's type)."""
        if len(arrays) == 1:  # a Server query's delivery: one answer
            a = arrays[0]
            if type(a) is np.ndarray and a.ndim == 1 and a.dtype.kind in "iu":
                return cls(a, [0], [len(a)]), []
        good, bad = [], []
        for i, a in enumerate(arrays):
            if type(a) is not np.ndarray or a.ndim != 1 or a.dtype.kind not in "iu":
                try:
                    a = np.asarray(a)
                except Exception:  # noqa: BLE001 - whatever it is, it is not ids
                    a = None
                if a is None or a.ndim != 1 or (a.dtype.kind not in "iu" and a.size):
                    bad.append(i)
                    continue
                a = a if a.size else a.astype(_LE_INT32)
            good.append(a)
        lengths = list(map(len, good))
        starts = [0, *itertools.accumulate(lengths)][:-1]
        if len(good) == 1:
            flat = good[0]
        else:
            flat = np.concatenate(good) if good else np.zeros(0, _LE_INT32)
        return cls(flat, starts, lengths), bad

    def le_int32(self) -> np.ndarray:
        """``flat`` as contiguous little-endian int32 (LoadGen's response bytes; no copy when it is that already)."""
        return np.ascontiguousarray(self.flat, dtype=_LE_INT32)

    def row(self, i: int) -> np.ndarray:
        """Answer ``i``'s ids (a view of ``flat``)."""
        a = self.starts[i]
        return self.flat[a:a + self.lengths[i]]

    def cut_lengths(self, eos: EosIds) -> list[int]:
        """Each answer's length once cut right after its first EOS id (the EOS kept; no EOS: its whole length; no
        answer cut: ``lengths`` itself): one numpy pass for the delivery, then a step per answer that holds an EOS
        id. Made once per delivery and EOS ids, for the answer check (``sut.core.answers``) and the ledger's cut."""
        if self._cut is None or self._cut[0] != eos.ids:
            self._cut = (eos.ids, self._cut_lengths(eos))
        return self._cut[1]

    def _cut_lengths(self, eos: EosIds) -> list[int]:
        hits = eos.hits(self.flat, self.umax())
        if not hits:
            return self.lengths
        starts, cut = self.starts, list(self.lengths)
        j, n_hits = 0, len(hits)
        while j < n_hits:
            h = hits[j]
            i = bisect.bisect_right(starts, h) - 1  # the answer that holds position h (empty ones hold none)
            cut[i] = h - starts[i] + 1
            j = bisect.bisect_left(hits, starts[i] + self.lengths[i], j + 1)  # its later hits do not count
        return cut


def unusable(ids) -> BaseException:
    """Why ``ids`` cannot be read as one answer's ids (the error converting it, or its shape)."""
    try:
        arr = np.asarray(ids, dtype=np.int32)
    except Exception as e:  # noqa: BLE001
        return e
    return ValueError(f"ids of shape {arr.shape}, not one row of ids")


def cut_at_first_eos(ids: Sequence[int] | np.ndarray, eos_ids: Iterable[int]) -> np.ndarray:
    """Return ``ids`` cut right after the first EOS id, as a little-endian int32 array.

    Args:
        ids: generated token ids (prompt excluded), shape ``(n,)``.
        eos_ids: the model's EOS ids (``generation_config.json`` ``eos_token_id``).
    """
    arr = np.asarray(ids, dtype=_LE_INT32)
    eos = np.fromiter(eos_ids, dtype=np.int64)
    if eos.size and arr.size:
        hits = np.flatnonzero(np.isin(arr, eos))
        if hits.size:
            arr = arr[: int(hits[0]) + 1]
    return arr


def response_buffer(ids: np.ndarray) -> array.array:
    """Bytes of ``ids`` as a ``array.array('B')`` whose ``buffer_info()`` gives (address, nbytes).

    The caller keeps the returned object alive until ``QuerySamplesComplete`` returns.
    """
    return array.array("B", np.ascontiguousarray(ids, dtype=_LE_INT32).tobytes())


class ResponseBatch:
    """The answers of one ``QuerySamplesComplete`` call in one buffer: ``sample_ids`` (LoadGen's), ``buf`` (contiguous
    little-endian int32, every answer's ids), per answer ``starts`` and ``lengths`` (ids, already cut at EOS).

    Iterates as ``(sample id, ids)`` pairs (views of ``buf``), as a list of pairs would, for recorders that stand in
    for LoadGen; :func:`complete_samples` sends it without a copy per answer. Holding the batch keeps ``buf`` alive.
    """

    __slots__ = ("sample_ids", "buf", "starts", "lengths")

    def __init__(self, sample_ids: list, buf: np.ndarray, starts: list, lengths: list):
        if buf.dtype != _LE_INT32 or not buf.flags.c_contiguous:
            raise ValueError("ResponseBatch needs a contiguous little-endian int32 buffer")
        self.sample_ids, self.buf, self.starts, self.lengths = sample_ids, buf, starts, lengths

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __iter__(self):
        buf = self.buf
        return ((sid, buf[a:a + n]) for sid, a, n in zip(self.sample_ids, self.starts, self.lengths))


class ResponseBatches:
    """Several :class:`ResponseBatch` es (deliveries queued while the completer was busy) sent in one
    ``QuerySamplesComplete`` call: iterates as ``(sample id, ids)`` pairs over all of them, in order; ``len``: samples."""

    __slots__ = ("batches",)

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return sum(map(len, self.batches))

    def __iter__(self):
        return itertools.chain.from_iterable(self.batches)


def _address(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


def complete_samples(results) -> None:
    """Send finished samples to LoadGen in one ``QuerySamplesComplete`` call.

    Args:
        results: a :class:`ResponseBatch` (every response points into its one buffer), :class:`ResponseBatches`, or
            ``(loadgen sample id, int32 token ids)`` pairs (ids already cut at EOS; each copied into a buffer of its own).
    """
    import mlperf_loadgen as lg

    qsr = lg.QuerySampleResponse
    if isinstance(results, (ResponseBatch, ResponseBatches)):
        responses = []
        for batch in (results,) if isinstance(results, ResponseBatch) else results.batches:
            base = _address(batch.buf)
            responses += [qsr(sid, base + 4 * a, 4 * n, n)
                          for sid, a, n in zip(batch.sample_ids, batch.starts, batch.lengths)]
        lg.QuerySamplesComplete(responses)
        return
    buffers = []  # keeps every buffer alive until QuerySamplesComplete returns
    responses = []
    for sample_id, ids in results:
        buf = response_buffer(ids)
        buffers.append(buf)
        addr, nbytes = buf.buffer_info()
        responses.append(qsr(sample_id, addr, nbytes, int(len(ids))))
    lg.QuerySamplesComplete(responses)
    del buffers


def first_token_complete(results: Sequence[tuple[int, Optional[int]]]) -> None:
    """Send first tokens to LoadGen in one ``FirstTokenComplete`` call, every response pointing into one buffer.

    Args:
        results: ``(loadgen sample id, first generated id)`` pairs; ``None``: an empty first token
            (0 bytes, ``n_tokens`` 0) for a sample answered empty after a failure.
    """
    import mlperf_loadgen as lg

    qsr = lg.QuerySampleResponse
    firsts = [0 if f is None else f for _, f in results]
    if _ARRAY_IS_LE_INT32:  # a buffer and its address without numpy's per-call cost (a Server query: one token)
        buf = array.array("i", firsts)
        base = buf.buffer_info()[0]
    else:
        buf = np.array(firsts, dtype=_LE_INT32)
        base = _address(buf)
    lg.FirstTokenComplete([qsr(sid, base + 4 * i, 0, 0) if f is None else qsr(sid, base + 4 * i, 4, 1)
                           for i, (sid, f) in enumerate(results)])
    del buf  # alive until FirstTokenComplete returned
