"""The Flame task/result format: round trips, budgets, corrupt input."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from sut.flame import payload as pl


def _prompts(n, length=50, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128256, size=length + i, dtype=np.int32) for i in range(n)]


def test_task_round_trip_tokens():
    prompts = _prompts(5)
    enc = pl.encode_task(7, [10, 11, 12, 13, 14], prompts=prompts, meta={"x": 1})
    assert enc.raw_bytes > 0 and enc.wire_bytes < enc.raw_bytes  # zlib level 1 helps on int32 ids
    t = pl.decode_task(enc.data)
    assert t.kind == pl.KIND_GENERATE and t.batch_id == 7 and t.meta == {"x": 1}
    assert list(t.request_ids) == [10, 11, 12, 13, 14]
    for a, b in zip(t.prompts, prompts):
        assert a.dtype == np.int32 and np.array_equal(a, b)
    assert pl.peek(enc.data) == ("generate", 7)


def test_task_round_trip_indices_and_ping():
    enc = pl.encode_task(3, [1, 2, 3], indices=[9, 0, 13367])
    t = pl.decode_task(enc.data)
    assert t.prompts is None and list(t.indices) == [9, 0, 13367]
    p = pl.decode_task(pl.encode_ping(5, meta={"hold_ms": 10}).data)
    assert p.kind == pl.KIND_PING and len(p) == 0 and p.meta["hold_ms"] == 10


def test_result_round_trip_in_order_with_errors():
    samples = [pl.SampleResult(4, True, token_ids=np.array([1, 2, 128009], np.int32)),
               pl.SampleResult(2, False, error="prompt too long ✗"),
               pl.SampleResult(9, True, token_ids=np.array([5, 6], np.int32))]
    r = pl.decode_result(pl.encode_result(1, samples, meta={"executor": {"pid": 1}}).data)
    assert [s.request_id for s in r.samples] == [4, 2, 9]
    assert r.samples[0].ok and list(r.samples[0].token_ids) == [1, 2, 128009]
    assert not r.samples[1].ok and r.samples[1].error == "prompt too long ✗"
    assert list(r.samples[2].token_ids) == [5, 6] and r.meta["executor"]["pid"] == 1


@pytest.mark.parametrize("ids, match", [
    (np.array([2**32 + 1000, 5], np.int64), r"request 7: the engine answered id 4294968296, outside int32"),
    (np.array([5, -(2**31) - 1], np.int64), r"request 7: the engine answered id -2147483649, outside int32"),
    (np.array([2**63 + 1], np.uint64), r"request 7: the engine answered id 9223372036854775809, outside int32"),
    (np.array([1000.7, 1001.7]), r"request 7: the engine answered float64 ids, not integers"),
    ([1000, 1001.5], r"request 7: the engine answered float64 ids, not integers"),
    (np.array([True, False]), r"request 7: the engine answered bool ids, not integers"),
    (np.zeros((2, 2), np.int32), r"request 7: the engine's answer has ids of shape \(2, 2\), not one row"),
])
def test_a_result_refuses_ids_that_int32_would_change(ids, match):
    """The service narrowed an engine's ids to int32 before the harness's answer check: 2**32 + 1000 arrived as 1000
    and float ids truncated, and the run passed. Now the result is refused, naming the request."""
    ok = pl.SampleResult(3, True, token_ids=np.array([1, 2], np.int32))
    with pytest.raises(pl.PayloadError, match=match):
        pl.encode_result(1, [ok, pl.SampleResult(7, True, token_ids=ids)])


def test_a_result_keeps_integer_ids_that_fit_int32_whatever_their_type():
    samples = [pl.SampleResult(1, True, token_ids=np.array([2**31 - 1, -(2**31), 5], np.int64)),
               pl.SampleResult(2, True, token_ids=[128009, 0]), pl.SampleResult(3, True, token_ids=[]),
               pl.SampleResult(4, True, token_ids=np.array([7, 8], ">i4")),
               pl.SampleResult(5, True, token_ids=np.array([9], np.uint16))]
    r = pl.decode_result(pl.encode_result(1, samples).data)
    assert [s.token_ids.tolist() for s in r.samples] == [[2**31 - 1, -(2**31), 5], [128009, 0], [], [7, 8], [9]]


def test_oversize_task_is_refused_with_a_clear_error():
    rng = np.random.default_rng(1)
    big = [rng.integers(0, 2**31 - 1, size=100_000, dtype=np.int32) for _ in range(10)]  # ~4 MB, incompressible
    with pytest.raises(pl.PayloadTooLarge, match="4,194,304"):
        pl.encode_task(0, list(range(10)), prompts=big)
    # a modest input whose worst-case output would not fit either
    with pytest.raises(pl.PayloadTooLarge, match="worst-case result"):
        pl.encode_task(0, list(range(4000)), indices=list(range(4000)), max_tokens=300)


def test_batch_64_of_official_length_fits():
    enc = pl.encode_task(0, list(range(64)), prompts=_prompts(64, length=2540))
    assert enc.wire_bytes + pl.worst_case_result_bytes(64, 128) < pl.TOTAL_BUDGET


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + b"\x09\x00" + b[6:], "version"),
    (lambda b: b[:-3], "length"),
    (lambda b: b[:10], "shorter|too short"),
])
def test_corrupt_payloads_raise_payload_error(mutate, match):
    data = pl.encode_task(0, [1, 2], prompts=_prompts(2)).data
    with pytest.raises(pl.PayloadError, match=match):
        pl.decode_task(mutate(data))


def test_decompression_size_is_checked():
    enc = pl.encode_task(0, [1], prompts=_prompts(1))
    head = bytearray(enc.data[:pl.HEADER_SIZE])
    # declare a smaller raw size than the body inflates to
    import struct
    fields = list(struct.unpack("<4sHBBQIIII", bytes(head)))
    fields[7] -= 4
    bad = struct.pack("<4sHBBQIIII", *fields) + enc.data[pl.HEADER_SIZE:]
    with pytest.raises(pl.PayloadError):
        pl.decode_task(bad)


def test_result_kind_is_not_a_task():
    with pytest.raises(pl.PayloadError, match="kind"):
        pl.decode_task(pl.encode_result(0, []).data)
    assert zlib  # imported for the reader: bodies are plain zlib streams


def test_result_detail_section_round_trip():
    """Each sample carries the engine's cached prompt tokens and its queued/first/done times; unknown ones stay None."""
    samples = [pl.SampleResult(1, True, token_ids=np.array([7, 8], np.int32), cached_tokens=256, t_queued=10.5,
                               t_first=10.75, t_done=11.0),
               pl.SampleResult(2, False, error="too long"),
               pl.SampleResult(3, True, token_ids=np.array([9], np.int32))]
    r = pl.decode_result(pl.encode_result(4, samples).data)
    a, b, c = r.samples
    assert (a.cached_tokens, a.t_queued, a.t_first, a.t_done) == (256, 10.5, 10.75, 11.0)
    assert not b.ok and b.error == "too long" and b.cached_tokens is None
    assert (c.cached_tokens, c.t_queued, c.t_first, c.t_done) == (None, None, None, None) and list(c.token_ids) == [9]


def test_uncompressed_bodies_round_trip():
    prompts = _prompts(3)
    enc = pl.encode_task(1, [1, 2, 3], prompts=prompts, compress=False)
    assert enc.wire_bytes == enc.raw_bytes  # no zlib: the body travels as is
    assert all(np.array_equal(x, y) for x, y in zip(pl.decode_task(enc.data).prompts, prompts))
    res = pl.encode_result(1, [pl.SampleResult(1, True, token_ids=np.array([5], np.int32), cached_tokens=3)], compress=False)
    assert res.wire_bytes == res.raw_bytes and pl.decode_result(res.data).samples[0].cached_tokens == 3


@pytest.mark.parametrize("compress", [True, False])
def test_a_result_altered_on_the_way_is_refused_whatever_its_compression(compress):
    """Every byte of a payload is covered by its checksum. Without zlib (``compress=false``) nothing was: an id
    changed on the way (here 1005 -> 1004, still inside any vocabulary) decoded and was answered; zlib's own check
    covered the body only, not the header (batch id, count) or the meta (replica, shard)."""
    samples = [pl.SampleResult(7, True, token_ids=np.array([1003, 1004, 1005], np.int32))]
    data = pl.encode_result(2, samples, meta={"replica": 0, "shard": "cpu-0"}, compress=compress).data
    assert list(pl.decode_result(data).samples[0].token_ids) == [1003, 1004, 1005]
    spots = [data.index(b'"replica":0') + 10]  # the meta: replica 0 -> 1
    if not compress:
        spots.append(data.index(np.array([1005], np.int32).tobytes()))  # an id
    for at in spots:
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(pl.PayloadError, match="checksum"):
            pl.decode_result(bytes(bad))
    for at in (pl.HEADER_SIZE - 12, 8):  # the header: meta length, batch id
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(pl.PayloadError):
            pl.decode_result(bytes(bad))
    task = pl.encode_task(5, [1], prompts=_prompts(1), compress=compress).data
    bad = bytearray(task)
    bad[-5] ^= 1
    with pytest.raises(pl.PayloadError, match="checksum|inflate"):
        pl.decode_task(bytes(bad))
