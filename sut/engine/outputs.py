"""One engine step's vLLM ``RequestOutput``s -> typed records (``sut.messages``).

Two collectors, chosen by the worker's mode; both give ``step(outs) -> (firsts, done)``:

* ``FinalCollector`` (Offline): vLLM's ``FinalOnly`` outputs, one per finished request. Each becomes a
  ``Completion`` with ``cached_tokens`` (vLLM's ``num_cached_tokens``: prompt tokens served from the
  prefix cache), ``t_queued`` (when the worker received the request: added it, or began holding it under
  ``admit_every_steps``) and ``t_done`` (when the step that
  finished it returned); no ``t_first`` (the first token is not seen); ``firsts`` is always empty.
* ``DeltaCollector`` (Server / Interactive, and the locality runner's ``detail``): vLLM's ``DELTA``
  outputs, so every step's new ids are seen. ``t_first`` is when the step that produced a request's
  first token returned; ``firsts`` lists those requests as ``FirstToken`` when ``report_firsts``;
  the ``Completion`` holds the whole generated sequence (so it starts with the reported first id).

Times are ``time.monotonic()`` seconds (system-wide on Linux, so the parent can compare them with its
own). ``t_queued <= t_first <= t_done`` for every request.

Both check every finished request's answer against the prompt it was added with: ``sent`` holds each
running request's prompt ids (filled by the worker with ``t_add``), and a finished ``RequestOutput`` whose
``prompt_token_ids`` differ from them (vLLM sets them on every output) is another prompt's answer delivered
under this request id: ``EngineError``, which fails the run, instead of a wrong answer reaching LoadGen.
``unanswered(held)`` lists the requests added to the engine and never finished (for the worker's idle check).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from sut.errors import EngineError
from sut.messages import Completion, FirstToken


def _cached(o) -> Optional[int]:
    n = getattr(o, "num_cached_tokens", None)
    return None if n is None else int(n)


class _Collector:
    """What both collectors keep per running request: when it was added and the prompt it was added with."""

    def __init__(self):
        self.t_add: dict[str, float] = {}  # vLLM request id -> when it was added
        self.sent: dict[str, list] = {}  # vLLM request id -> its prompt ids, as added

    def _check_prompt(self, o) -> None:
        """Raise ``EngineError`` when finished output ``o`` carries another prompt than its request was added
        with (no check for an id never recorded here, or an output without ``prompt_token_ids``)."""
        sent = self.sent.pop(o.request_id, None)
        got = getattr(o, "prompt_token_ids", None)
        if sent is None or got is None:
            return
        if len(got) == len(sent) and (got if type(got) is list else list(got)) == sent:
            return
        raise EngineError(f"vLLM finished request {o.request_id} with another prompt's answer: its output's "
                          f"prompt_token_ids ({len(got)} ids, starting {list(got[:6])}) are not the {len(sent)} "
                          f"ids it was added with (starting {sent[:6]})")

    def unanswered(self, held=()) -> list[str]:
        """Request ids added (``t_add``) and not finished, less those still ``held`` by the worker."""
        waiting = {h[0] for h in held}
        return [rid for rid in self.t_add if rid not in waiting]


class FinalCollector(_Collector):
    """Finished requests of ``FinalOnly`` outputs (see the module docstring)."""

    def step(self, outs) -> tuple[list, list]:
        now = time.monotonic()
        t_add, check = self.t_add, self._check_prompt
        done = []
        for o in outs:
            if o.finished:
                check(o)
                done.append(Completion(int(o.request_id), np.asarray(o.outputs[0].token_ids, dtype=np.int32),
                                       _cached(o), t_add.pop(o.request_id, None), None, now))
        return [], done


class DeltaCollector(_Collector):
    """Delta outputs: first tokens as they come, the whole sequence at the end (module docstring)."""

    def __init__(self, report_firsts: bool):
        super().__init__()
        self.report_firsts = report_firsts
        self._acc: dict[str, tuple[list, float]] = {}  # running request -> (ids so far, t_first)

    def step(self, outs) -> tuple[list, list]:
        now = time.monotonic()
        firsts, done = [], []
        for o in outs:
            rid = o.request_id
            ids = o.outputs[0].token_ids if o.outputs else ()
            got = self._acc.get(rid)
            if got is None:
                if not len(ids) and not o.finished:
                    continue  # a prefill chunk: no token yet
                got = self._acc[rid] = ([], now)
                if len(ids) and self.report_firsts:
                    firsts.append(FirstToken(int(rid), int(ids[0])))
            got[0].extend(ids)
            if o.finished:
                del self._acc[rid]
                self._check_prompt(o)
                done.append(Completion(int(rid), np.asarray(got[0], dtype=np.int32), _cached(o),
                                       self.t_add.pop(rid, None), got[1], now))
        return firsts, done
