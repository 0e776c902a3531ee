"""What the workloads need before the pairs start (``runner.run_study`` calls ``prepare_workload``).

* ``eviction`` (``working_set`` > 0): one replica's KV-cache tokens (``--kv-tokens``, else the probe of
  ``eviction.probe``), the documents count sized from them and the trace rebuilt with it;
* ``arrivals`` (``load_levels``): the burst capacity (``--capacity``, else the calibration case of
  ``arrivals.calibrate``) and the levels (rate, trace copy, request ids).

Both start engines only when their value is not given; the record of what was done (``workload`` in the run's
header and ``locality.json``) says where each value came from.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from sut.locality.workloads import WorkloadSettings, arrivals, eviction

log = logging.getLogger("sut.locality")


def workload_record(ws: WorkloadSettings) -> dict:
    """The header's ``workload`` before preparation: the knobs and the workloads they switch on."""
    return {"settings": ws, "active": ws.active}


def size_eviction(prepared, ws: WorkloadSettings, ctx, systems: Sequence, record: dict, kv_sizing: str):
    """Eviction's steps 1-2 (``eviction`` module): ``(prepared, ctx)`` with the sized trace (and, with
    ``kv_sizing`` first-case, the probe's KV cache for every case). ``RunFailed`` from the probe;
    ``ValueError`` for a sized trace larger than ``make_trace`` builds."""
    from sut.locality.runner import prepare_trace

    kv, source, probe = ws.kv_tokens, "--kv-tokens", None
    if not kv:
        kv, probe = eviction.probe(systems[0], ctx, kv_sizing)
        source = f"the smallest KV cache system {systems[0].name}'s replicas reported at start"
    ts = eviction.size_documents(prepared.settings, ws.working_set, kv)
    if ts != prepared.settings:
        prepared = prepare_trace(ts, len(prepared.warmups), extra=len(prepared.extra))
    record["working_set"] = eviction.sizing_record(ws.working_set, kv, source, prepared.shape, probe)
    sh = prepared.shape
    log.info("eviction: one replica's KV cache %s tokens (%s) -> %d documents x %d questions = %d requests, "
             "%s distinct document tokens (%sx); the trace now: %s", f"{kv:,}", source, sh["documents"],
             prepared.settings.questions, sh["requests"], f"{sh['document_tokens']:,}",
             record["working_set"]["ratio"], sh)
    ctx = dataclasses.replace(ctx, trace=prepared.trace, warmups=prepared.warmups,
                              expected_hashes=prepared.input_hashes, sizing=record["working_set"])
    return prepared, ctx


def prepare_workload(systems: Sequence, ctx, ps, prepared) -> tuple:
    """``(ctx, prepared, record)`` ready for the pairs (module docstring). Raises ``RunFailed`` (a probe or
    calibration case that failed) or ``ValueError`` (a sized trace that cannot be built)."""
    ws: WorkloadSettings = ctx.workload
    record = workload_record(ws)
    if ws.working_set:
        prepared, ctx = size_eviction(prepared, ws, ctx, systems, record, ps.kv_sizing)
    if ws.load_levels:
        if ws.capacity:
            record["capacity"] = {"requests_per_s": ws.capacity, "source": "--capacity"}
        else:
            cal = arrivals.calibrate(systems[0], ctx, ps, ws.capacity_policy)
            record["capacity"] = {"requests_per_s": cal["requests_per_s"],
                                  "source": f"measured: one burst of the trace, system {cal['system']}, policy "
                                            f"{cal['policy']}"}
            record["calibration"] = cal
        levels = arrivals.make_levels(prepared, ws.load_levels, record["capacity"]["requests_per_s"])
        record["levels"] = [{"level": lv.level, "rate": lv.rate, "shift": lv.shift, "first_id": lv.first_id}
                            for lv in levels]
        ctx = dataclasses.replace(ctx, levels=tuple(levels))
    return ctx, prepared, record
