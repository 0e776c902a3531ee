"""Typed records that cross the layers of the dispatch core (and process boundaries).

Shapes and units:

* ``Request(rid, prompt, index, max_tokens)``: ``rid`` a request id unique within a run (int); ``prompt``
  the prompt token ids, a 1-D ``np.int32`` array; ``index`` the QSL index where there is one (-1: none;
  a transport whose remote side loads prompts by index uses it); ``max_tokens`` this request's own
  output length (0: the generation settings'; only transports with ``per_request_max_tokens`` honour
  it, and it must not exceed the generation settings' ``max_tokens``).
* ``Completion(rid, token_ids, cached_tokens, t_queued, t_first, t_done)``: ``token_ids`` the
  generated ids (1-D ``np.int32``, not yet cut at EOS: the ledger does that); ``cached_tokens``
  prompt tokens the engine served from its prefix cache (None: the transport cannot tell);
  ``t_queued`` / ``t_first`` / ``t_done``: ``time.monotonic()`` seconds on the host that ran the
  engine, when the engine took the request, produced its first token and finished it (None where
  the transport does not measure it). ``time.monotonic`` is system-wide on Linux, so times from
  worker processes of the same host compare with the harness's own.
* ``FirstToken(rid, token_id)``: a streamed request's first generated id (Server/Interactive).
* ``FatalEvent(replica, message, rid=None)``: the transport cannot go on; ``replica`` names the replica
  (None: the whole transport, e.g. a lost Flame session), ``rid`` the request whose failure it is, where
  there is one (the dispatcher adds its QSL index and LoadGen sample). The dispatcher fails the run with it.
* ``ReplicaRecord(index, info)``: what ``Transport.start`` returns per replica. ``info`` is the
  engine's own read-back record (``engine_args``, ``enable_prefix_caching``, ``device`` with
  ``kind``, ``name``, ``uuid``, ...; the same dict ``run.json`` lists under ``engines``).

``Request``, ``Completion`` and ``FirstToken`` are ``NamedTuple``s: they pickle as tuples (cheap on the
engine pipes) and index like ``(rid, ids)`` pairs where older code expects that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np


class Request(NamedTuple):
    rid: int
    prompt: np.ndarray
    index: int = -1
    max_tokens: int = 0


class Completion(NamedTuple):
    rid: int
    token_ids: np.ndarray
    cached_tokens: Optional[int] = None
    t_queued: Optional[float] = None
    t_first: Optional[float] = None
    t_done: Optional[float] = None


class FirstToken(NamedTuple):
    rid: int
    token_id: int


@dataclass(frozen=True)
class FatalEvent:
    replica: Optional[int]
    message: str
    rid: Optional[int] = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ReplicaRecord:
    index: int
    info: dict = field(default_factory=dict)

    @property
    def enable_prefix_caching(self) -> Optional[bool]:
        """What the engine reported (None: it could not be read back)."""
        v = self.info.get("enable_prefix_caching")
        return None if v is None else bool(v)

    @property
    def gpu_uuid(self) -> Optional[str]:
        return (self.info.get("device") or {}).get("uuid")

    @property
    def device_name(self) -> Optional[str]:
        return (self.info.get("device") or {}).get("name")
