"""Turning generated token ids into LoadGen responses.

Rules (mlcommons/inference llama3.1-8b README, TEST06, LoadGen logging.cc):
- the response is the generated ids up to and including the first EOS, never padded;
- bytes are little-endian int32; ``size`` is in bytes; ``n_tokens`` is the number of ids;
- the buffer must stay alive until ``QuerySamplesComplete`` returns.
"""

from __future__ import annotations

import array
from typing import Iterable, Sequence

import numpy as np

_LE_INT32 = np.dtype("<i4")


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


def complete_samples(results: Sequence[tuple[int, np.ndarray]]) -> None:
    """Send finished samples to LoadGen in one ``QuerySamplesComplete`` call.

    Args:
        results: ``(loadgen sample id, int32 token ids)`` pairs; ids already cut at EOS.
    """
    import mlperf_loadgen as lg

    buffers = []  # keeps every buffer alive until QuerySamplesComplete returns
    responses = []
    for sample_id, ids in results:
        buf = response_buffer(ids)
        buffers.append(buf)
        addr, nbytes = buf.buffer_info()
        responses.append(lg.QuerySampleResponse(sample_id, addr, nbytes, int(len(ids))))
    lg.QuerySamplesComplete(responses)
    del buffers
