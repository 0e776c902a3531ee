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

Both keep ``t_add`` for the running requests only (an entry is popped when its request finishes), so the
worker can tell a request id given twice while it runs, and, from ``unanswered(held)``, the requests an idle
engine was given and never finished.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from sut.messages import Completion, FirstToken


def _cached(o) -> Optional[int]:
    n = getattr(o, "num_cached_tokens", None)
    return None if n is None else int(n)


class _Collector:
    """What both collectors keep per running request: when it was added."""

    def __init__(self):
        self.t_add: dict[str, float] = {}  # vLLM request id -> when it was added (running or held requests only)

    def unanswered(self, held=()) -> list[str]:
        """Request ids added (``t_add``) and not finished, less those still ``held`` by the worker."""
        waiting = {h[0] for h in held}
        return [rid for rid in self.t_add if rid not in waiting]


class FinalCollector(_Collector):
    """Finished requests of ``FinalOnly`` outputs (see the module docstring)."""

    def step(self, outs) -> tuple[list, list]:
        now = time.monotonic()
        t_add = self.t_add
        done = [Completion(int(o.request_id), np.asarray(o.outputs[0].token_ids, dtype=np.int32), _cached(o),
                           t_add.pop(o.request_id, None), None, now) for o in outs if o.finished]
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
                done.append(Completion(int(rid), np.asarray(got[0], dtype=np.int32), _cached(o),
                                       self.t_add.pop(rid, None), got[1], now))
        return firsts, done
