"""Typed messages on the pipe between an engine worker and its parent (``EngineHandle``).

Each kind is a ``NamedTuple``: it pickles as its class reference plus a tuple, so a batch costs what
a plain tuple of a list cost before; the receiver dispatches on ``type(msg)``.

Parent -> worker:

* ``Generate(requests)``: ``sut.messages.Request``s (or ``(request id, int32 prompt)`` pairs) to
  add to the running engine at once.
* ``RawGenerate(requests)``: one plain ``LLM.generate`` over the batch on an idle engine (the
  baseline of the overhead benchmark); answered with ``RawDone``.
* ``StatsQuery()``: answered with ``Stats`` (the worker's GC statistics).
* ``ResetCache()``: empty vLLM's prefix cache on an idle engine; answered with
  ``Stats({"reset_prefix_cache": ok})``.
* ``Stop()``: leave the serve loop (the worker then exits).

Worker -> parent:

* ``Ready(info)``: the engine is built; ``info`` is its read-back record (``sut.engine.readback``).
* ``Failed(message)``: start-up or the serve loop raised; ``message`` names the engine and carries
  the traceback. The worker ends after it.
* ``Firsts(firsts)``: ``sut.messages.FirstToken``s of the requests whose first token the last
  step produced (streaming workers only), always sent before the ``Done`` of the same step.
* ``Done(completions)``: ``sut.messages.Completion``s of the requests the last step finished.
* ``Stats(stats)``: a dict, in answer to ``StatsQuery`` or ``ResetCache``.
* ``RawDone(seconds, results)``: the ``LLM.generate`` call's wall time and its ``Completion``s.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from sut.messages import Completion, FirstToken


class Generate(NamedTuple):
    requests: Sequence


class RawGenerate(NamedTuple):
    requests: Sequence


class StatsQuery(NamedTuple):
    pass


class ResetCache(NamedTuple):
    pass


class Stop(NamedTuple):
    pass


class Ready(NamedTuple):
    info: dict


class Failed(NamedTuple):
    message: str


class Firsts(NamedTuple):
    firsts: list[FirstToken]


class Done(NamedTuple):
    completions: list[Completion]


class Stats(NamedTuple):
    stats: dict


class RawDone(NamedTuple):
    seconds: float
    results: list[Completion]


__all__ = ["Done", "Failed", "Firsts", "Generate", "RawDone", "RawGenerate", "Ready", "ResetCache", "Stats",
           "StatsQuery", "Stop"]
