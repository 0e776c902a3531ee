"""Binary task and result format of the Flame-batched SUT (versioned; no pickle anywhere).

Layout (all integers little-endian)::

    header  = magic "SUTF" | version u16 | kind u8 | flags u8 | batch_id u64 | count u32
              | meta_len u32 | body_raw_len u32 | body_len u32                       (32 bytes)
    meta    = JSON object, UTF-8, uncompressed (a few hundred bytes at most)
    body    = zlib level 1 of the raw body when flags has COMPRESSED, else the raw body
    crc     = CRC-32 (zlib.crc32) of header + meta + body, u32                                (4 bytes)

    task body, tokens  = request ids u64[n] | prompt lengths u32[n] | prompt ids int32[sum]
    task body, indices = request ids u64[n] | dataset (QSL) indices u32[n]
    result body        = request ids u64[n] | status u8[n] | lengths u32[n]
                         | [DETAIL: cached prompt tokens i32[n] (-1: unknown)
                            | t_queued f64[n] | t_first f64[n] | t_done f64[n] (NaN: unknown)]
                         | generated ids int32[sum of lengths where status == OK]
                         | error texts UTF-8 [sum of lengths where status != OK]

The DETAIL section (flag ``DETAIL``, set on every result with samples) carries what the engine
reported per sample (``sut.messages.Completion``): prompt tokens served from its prefix cache
and its ``time.monotonic()`` seconds when it took, first-answered and finished the request.

The checksum covers every byte before it: a payload altered on the way (a flipped bit in an id of an uncompressed
body, in the batch id, in the meta's replica) is refused (``PayloadError``) instead of decoded into other ids that
may still pass every answer check; zlib's own check covers a compressed body only.

Kinds: ``GENERATE`` (a batch of samples), ``PING`` (warm-up: no samples, answers the
executor's identity), ``RESULT`` (the answer to either). A result holds one entry per input
sample, in input order. Per-sample errors (a prompt the engine cannot take) travel inside the
result with their text; anything that breaks the batch as a whole raises and fails the task.

Size budget: Flame 0.6 decodes every gRPC message with a 4 MiB limit, CreateTask echoes the
input, and the client receives the task's input and output together in one watch message
(../shared/research/flame.md §2.5-2.6). The encoder therefore refuses (``PayloadTooLarge``) a
task whose encoded input exceeds ``INPUT_BUDGET`` (3 MiB) or whose input plus worst-case output
exceeds ``TOTAL_BUDGET`` (3.5 MiB); the result encoder refuses an output over ``OUTPUT_BUDGET``.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

MAGIC = b"SUTF"
VERSION = 2  # 2: the CRC-32 trailer

KIND_GENERATE = 1
KIND_PING = 2
KIND_RESULT = 3
_KINDS = {KIND_GENERATE: "generate", KIND_PING: "ping", KIND_RESULT: "result"}

FLAG_COMPRESSED = 0x01
FLAG_INDICES = 0x02
FLAG_DETAIL = 0x04

STATUS_OK = 0
STATUS_ERROR = 1

MIB = 1 << 20
GRPC_LIMIT = 4 * MIB
INPUT_BUDGET = 3 * MIB
TOTAL_BUDGET = 3 * MIB + MIB // 2
OUTPUT_BUDGET = TOTAL_BUDGET
#: Largest raw body the decoder inflates (guards against a corrupt or hostile length field).
MAX_RAW_BODY = 256 * MIB
ZLIB_LEVEL = 1

_HEADER = struct.Struct("<4sHBBQIIII")
HEADER_SIZE = _HEADER.size  # 32
_CRC = struct.Struct("<I")
CRC_SIZE = _CRC.size  # 4

_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
_I32 = np.dtype("<i4")
_U8 = np.dtype("u1")
_F64 = np.dtype("<f8")
_I32_UNKNOWN = -1


class PayloadError(ValueError):
    """Bytes that are not a valid task or result of this format/version."""


class PayloadTooLarge(PayloadError):
    """A task or result that would not fit under Flame's 4 MiB gRPC message limit."""


@dataclass
class TaskInput:
    """A decoded task. ``prompts`` (tokens mode) or ``indices`` (indices mode) is set for GENERATE."""

    kind: int
    batch_id: int
    request_ids: np.ndarray  # uint64 (n,)
    prompts: Optional[list[np.ndarray]] = None  # int32 arrays
    indices: Optional[np.ndarray] = None  # uint32 (n,)
    meta: dict = field(default_factory=dict)
    raw_bytes: int = 0
    wire_bytes: int = 0

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class SampleResult:
    """One sample of a result: generated ids (status OK) or an error text."""

    request_id: int
    ok: bool
    token_ids: Optional[np.ndarray] = None  # int32
    error: Optional[str] = None
    cached_tokens: Optional[int] = None  # prompt tokens from the engine's prefix cache (None: unknown)
    t_queued: Optional[float] = None  # engine host's time.monotonic() seconds (None: unknown)
    t_first: Optional[float] = None
    t_done: Optional[float] = None


@dataclass
class TaskResult:
    batch_id: int
    samples: list[SampleResult]
    meta: dict = field(default_factory=dict)
    raw_bytes: int = 0
    wire_bytes: int = 0


@dataclass(frozen=True)
class Encoded:
    """Encoded bytes plus their size before compression (for the run record)."""

    data: bytes
    raw_bytes: int

    @property
    def wire_bytes(self) -> int:
        return len(self.data)


def worst_case_result_bytes(n: int, max_tokens: int, meta_bytes: int = 4096) -> int:
    """Upper bound of an encoded result for ``n`` samples of at most ``max_tokens`` ids each."""
    return HEADER_SIZE + meta_bytes + n * (8 + 1 + 4 + 4 + 24 + 4 * max_tokens) + 64  # zlib can add a few bytes


def _meta_bytes(meta: Optional[dict]) -> bytes:
    return json.dumps(meta or {}, separators=(",", ":"), sort_keys=True).encode()


def _pack(kind: int, flags: int, batch_id: int, count: int, meta: Optional[dict], raw: bytes, compress: bool) -> Encoded:
    mb = _meta_bytes(meta)
    body = zlib.compress(raw, ZLIB_LEVEL) if compress else raw
    if compress:
        flags |= FLAG_COMPRESSED
    data = _HEADER.pack(MAGIC, VERSION, kind, flags, batch_id, count, len(mb), len(raw), len(body)) + mb + body
    return Encoded(data + _CRC.pack(zlib.crc32(data)), HEADER_SIZE + len(mb) + len(raw) + CRC_SIZE)


def encode_task(batch_id: int, request_ids: Sequence[int], prompts: Optional[Sequence[np.ndarray]] = None,
                indices: Optional[Sequence[int]] = None, meta: Optional[dict] = None, max_tokens: int = 128,
                input_budget: int = INPUT_BUDGET, total_budget: int = TOTAL_BUDGET, compress: bool = True) -> Encoded:
    """Encode a GENERATE task: either token ``prompts`` (int32 arrays) or QSL ``indices``; the body is
    zlib level 1 unless ``compress`` is False.

    Raises:
        PayloadTooLarge: the encoded input exceeds ``input_budget``, or input plus the
            worst-case result (``max_tokens`` ids per sample) exceeds ``total_budget``.
        PayloadError: neither or both of prompts/indices, or lengths that disagree.
    """
    n = len(request_ids)
    if n == 0:
        raise PayloadError("a GENERATE task needs at least one sample")
    if (prompts is None) == (indices is None):
        raise PayloadError("give exactly one of prompts (tokens mode) or indices (indices mode)")
    rids = np.asarray(request_ids, dtype=_U64)
    if prompts is not None:
        if len(prompts) != n:
            raise PayloadError(f"{n} request ids but {len(prompts)} prompts")
        lens = np.fromiter((len(p) for p in prompts), dtype=_U32, count=n)
        toks = np.concatenate([np.asarray(p, dtype=_I32) for p in prompts]) if n else np.zeros(0, _I32)
        raw = rids.tobytes() + lens.tobytes() + toks.astype(_I32, copy=False).tobytes()
        flags = 0
    else:
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) != n:
            raise PayloadError(f"{n} request ids but {len(idx)} indices")
        if idx.size and (idx.min() < 0 or idx.max() > 0xFFFFFFFF):
            raise PayloadError("dataset indices must fit in uint32")
        raw = rids.tobytes() + idx.astype(_U32).tobytes()
        flags = FLAG_INDICES
    enc = _pack(KIND_GENERATE, flags, batch_id, n, meta, raw, compress=compress)
    if enc.wire_bytes > input_budget:
        raise PayloadTooLarge(
            f"task {batch_id}: {n} samples encode to {enc.wire_bytes:,} bytes after zlib ({enc.raw_bytes:,} before), over the "
            f"{input_budget:,}-byte input budget (Flame 0.6 rejects gRPC messages over {GRPC_LIMIT:,} bytes and echoes the "
            "input in every task message); lower batch_size or use payload=indices")
    worst = enc.wire_bytes + worst_case_result_bytes(n, max_tokens)
    if worst > total_budget:
        raise PayloadTooLarge(
            f"task {batch_id}: input {enc.wire_bytes:,} bytes plus a worst-case result of {n} x {max_tokens} ids "
            f"({worst - enc.wire_bytes:,} bytes) is {worst:,} bytes, over the {total_budget:,}-byte budget for one Flame "
            f"task message (limit {GRPC_LIMIT:,}); lower batch_size")
    return enc


#: A ping whose meta has ``{LEAVE: True}`` asks the service that takes it to end its process after answering.
LEAVE = "leave"


def encode_ping(batch_id: int = 0, meta: Optional[dict] = None) -> Encoded:
    """Encode a PING (warm-up) task."""
    return _pack(KIND_PING, 0, batch_id, 0, meta, b"", compress=False)


def _detail_bytes(samples: Sequence[SampleResult]) -> bytes:
    n = len(samples)
    cached = np.fromiter((_I32_UNKNOWN if s.cached_tokens is None else s.cached_tokens for s in samples), _I32, n)
    times = [np.fromiter((np.nan if getattr(s, k) is None else getattr(s, k) for s in samples), _F64, n)
             for k in ("t_queued", "t_first", "t_done")]
    return cached.tobytes() + b"".join(t.tobytes() for t in times)


_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def _int32_ids(token_ids, request_id: int) -> np.ndarray:
    """``token_ids`` (one answer) as int32 without changing an id; ``PayloadError`` naming ``request_id`` when they
    are not one row of integers or an id is outside int32 (narrowing would wrap it, and truncate a float, into an id
    that passes the harness's answer check: the check must see what the engine answered)."""
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as e:  # ragged or otherwise not an array
        raise PayloadError(f"request {request_id}: the engine's answer is not a row of token ids: {e}") from None
    if arr.ndim != 1:
        raise PayloadError(f"request {request_id}: the engine's answer has ids of shape {arr.shape}, not one row")
    if arr.dtype == _I32 or arr.size == 0:
        return arr.astype(_I32, copy=False)
    if arr.dtype.kind not in "iu":
        raise PayloadError(f"request {request_id}: the engine answered {arr.dtype} ids, not integers "
                           f"(first ids {arr[:5].tolist()}): refused, not narrowed to int32")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < _INT32_MIN or hi > _INT32_MAX:
        raise PayloadError(f"request {request_id}: the engine answered id {hi if hi > _INT32_MAX else lo}, outside "
                           "int32: refused, not narrowed to int32")
    return arr.astype(_I32)


def encode_result(batch_id: int, samples: Sequence[SampleResult], meta: Optional[dict] = None,
                  output_budget: int = OUTPUT_BUDGET, compress: bool = True) -> Encoded:
    """Encode a RESULT, one entry per input sample, in input order (with the DETAIL section when
    there are samples; the body is zlib level 1 unless ``compress`` is False).

    Raises:
        PayloadError: a sample's ids are not one row of integers that fit int32 (``_int32_ids``; never narrowed).
        PayloadTooLarge: the encoded result exceeds ``output_budget``.
    """
    n = len(samples)
    rids = np.fromiter((s.request_id for s in samples), dtype=_U64, count=n)
    status = np.fromiter((STATUS_OK if s.ok else STATUS_ERROR for s in samples), dtype=_U8, count=n)
    toks, errs, lens = [], [], np.zeros(n, dtype=_U32)
    for i, s in enumerate(samples):
        if s.ok:
            ids = _int32_ids(s.token_ids, s.request_id)
            toks.append(ids)
            lens[i] = len(ids)
        else:
            eb = (s.error or "error").encode("utf-8", "replace")
            errs.append(eb)
            lens[i] = len(eb)
    tok_bytes = np.concatenate(toks).astype(_I32, copy=False).tobytes() if toks else b""
    detail = _detail_bytes(samples) if n else b""
    raw = rids.tobytes() + status.tobytes() + lens.tobytes() + detail + tok_bytes + b"".join(errs)
    enc = _pack(KIND_RESULT, FLAG_DETAIL if n else 0, batch_id, n, meta, raw, compress=compress)
    if enc.wire_bytes > output_budget:
        raise PayloadTooLarge(f"result of task {batch_id} ({n} samples) is {enc.wire_bytes:,} bytes, over the "
                              f"{output_budget:,}-byte output budget")
    return enc


def _unpack(data: bytes, want_kinds: tuple[int, ...]) -> tuple[int, int, int, int, dict, bytes, int]:
    if data is None:
        raise PayloadError("no payload (None)")
    if len(data) < HEADER_SIZE:
        raise PayloadError(f"payload of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, kind, flags, batch_id, count, meta_len, raw_len, body_len = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r} (expected {MAGIC!r}): not a payload of this SUT")
    if version != VERSION:
        raise PayloadError(f"payload version {version} is not supported (this side speaks version {VERSION}); "
                           "client and service must run the same code")
    if kind not in want_kinds:
        raise PayloadError(f"payload kind {_KINDS.get(kind, kind)} where {[_KINDS[k] for k in want_kinds]} was expected")
    end = HEADER_SIZE + meta_len + body_len
    if end + CRC_SIZE != len(data):
        raise PayloadError(f"payload length {len(data)} does not match its header "
                           f"({HEADER_SIZE}+{meta_len}+{body_len}+{CRC_SIZE})")
    if zlib.crc32(memoryview(data)[:end]) != _CRC.unpack_from(data, end)[0]:
        raise PayloadError(f"payload checksum mismatch ({len(data):,} bytes of a {_KINDS[kind]} payload): it was "
                           "altered or corrupted on the way")
    if raw_len > MAX_RAW_BODY:
        raise PayloadError(f"declared body size {raw_len:,} is over the {MAX_RAW_BODY:,}-byte limit")
    try:
        meta = json.loads(data[HEADER_SIZE:HEADER_SIZE + meta_len] or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PayloadError(f"payload meta is not JSON: {e}") from None
    body = data[HEADER_SIZE + meta_len:end]
    if flags & FLAG_COMPRESSED:
        d = zlib.decompressobj()
        try:
            raw = d.decompress(body, raw_len + 1)
        except zlib.error as e:
            raise PayloadError(f"payload body does not inflate: {e}") from None
        if not d.eof or d.unconsumed_tail:
            raise PayloadError("payload body inflates to more than its declared size, or is truncated")
    else:
        raw = body
    if len(raw) != raw_len:
        raise PayloadError(f"payload body is {len(raw)} bytes, header says {raw_len}")
    return kind, flags, batch_id, count, meta, raw, HEADER_SIZE + meta_len + raw_len + CRC_SIZE


def _take(raw: bytes, off: int, dtype: np.dtype, n: int, what: str) -> tuple[np.ndarray, int]:
    end = off + dtype.itemsize * n
    if end > len(raw):
        raise PayloadError(f"payload body too short for {what}")
    return np.frombuffer(raw, dtype=dtype, count=n, offset=off), end


def decode_task(data: bytes) -> TaskInput:
    """Decode a GENERATE or PING task. Raises ``PayloadError``."""
    kind, flags, batch_id, n, meta, raw, raw_total = _unpack(data, (KIND_GENERATE, KIND_PING))
    if kind == KIND_PING:
        return TaskInput(KIND_PING, batch_id, np.zeros(0, _U64), meta=meta, raw_bytes=raw_total, wire_bytes=len(data))
    rids, off = _take(raw, 0, _U64, n, "request ids")
    if flags & FLAG_INDICES:
        idx, off = _take(raw, off, _U32, n, "indices")
        if off != len(raw):
            raise PayloadError("trailing bytes after the indices")
        return TaskInput(KIND_GENERATE, batch_id, rids, indices=idx, meta=meta, raw_bytes=raw_total, wire_bytes=len(data))
    lens, off = _take(raw, off, _U32, n, "prompt lengths")
    total = int(lens.sum(dtype=np.int64))
    toks, off = _take(raw, off, _I32, total, "prompt ids")
    if off != len(raw):
        raise PayloadError("trailing bytes after the prompt ids")
    bounds = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    prompts = [toks[bounds[i]:bounds[i + 1]] for i in range(n)]
    return TaskInput(KIND_GENERATE, batch_id, rids, prompts=prompts, meta=meta, raw_bytes=raw_total, wire_bytes=len(data))


def decode_result(data: bytes) -> TaskResult:
    """Decode a RESULT. Raises ``PayloadError``."""
    _, flags, batch_id, n, meta, raw, raw_total = _unpack(data, (KIND_RESULT,))
    rids, off = _take(raw, 0, _U64, n, "request ids")
    status, off = _take(raw, off, _U8, n, "status")
    lens, off = _take(raw, off, _U32, n, "lengths")
    detail = None
    if flags & FLAG_DETAIL:
        cached, off = _take(raw, off, _I32, n, "cached token counts")
        times, off = _take(raw, off, _F64, 3 * n, "engine times")
        detail = (cached, times.reshape(3, n))
    ok = status == STATUS_OK
    n_tok = int(lens[ok].sum(dtype=np.int64))
    toks, off = _take(raw, off, _I32, n_tok, "generated ids")
    err_blob = raw[off:]
    if len(err_blob) != int(lens[~ok].sum(dtype=np.int64)):
        raise PayloadError("error-text section does not match its lengths")
    samples, t_off, e_off = [], 0, 0
    for i in range(n):
        ln = int(lens[i])
        if ok[i]:
            samples.append(SampleResult(int(rids[i]), True, token_ids=toks[t_off:t_off + ln], **_detail_of(detail, i)))
            t_off += ln
        else:
            samples.append(SampleResult(int(rids[i]), False, error=err_blob[e_off:e_off + ln].decode("utf-8", "replace")))
            e_off += ln
    return TaskResult(batch_id, samples, meta=meta, raw_bytes=raw_total, wire_bytes=len(data))


def _detail_of(detail, i: int) -> dict:
    if detail is None:
        return {}
    cached, times = detail
    c = int(cached[i])
    out = {"cached_tokens": None if c == _I32_UNKNOWN else c}
    for k, row in zip(("t_queued", "t_first", "t_done"), times):
        t = float(row[i])
        out[k] = None if np.isnan(t) else t
    return out


def peek(data: bytes) -> tuple[str, int]:
    """``(kind name, batch id)`` from a payload's header, or raise ``PayloadError``."""
    if data is None or len(data) < HEADER_SIZE:
        raise PayloadError("payload too short")
    magic, _version, kind, _flags, batch_id = _HEADER.unpack_from(data, 0)[:5]
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}")
    return _KINDS.get(kind, str(kind)), batch_id
