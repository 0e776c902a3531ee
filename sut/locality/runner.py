"""A locality run from settings to record: run folder, trace, warm-ups and hashes, the pair protocol,
``locality.json``, the figure.

``prepare_trace`` builds the measured trace, its id-shifted warm-ups (``trace.warmup_traces``) and
the hashes that validation and the record use. ``run_study`` runs every case
(``sut.locality.pairs``) and writes into the run folder (made first by ``make_run_dir``; its name
ends in ``-SYNTHETIC-LOCALITY-NOT-MLPERF``):

* ``run_header.json`` (first, before any engine starts): the settings part of ``locality.json``
  (``run_header``), so that a run cut off later can be merged (``sut.locality.merge``);
* ``cases.jsonl``: each finished case's record as soon as it is done (kept if the run is cut off);
* ``locality.json``: ``"mlperf": false``; ``status`` (``ok`` | ``failed``) and ``error``; runtime
  versions, model (path, config sha256, the revision the router hashes), trace settings, shape,
  trace hash, every input hash, the warm-ups' shifts and hashes; engine, generation, routing and
  protocol settings; each system's transport and options; every case (replica records, placement,
  warm-ups, timed metrics, routing counters, validation, output-id hashes, transport stats such as
  Flame's batch distribution, cleanup); the per-run records and the pair report
  (``sut.locality.study.pair_report``); notes on deviations from the study (e.g. replicas sharing
  one GPU where the study had one GPU each);
* ``locality.png`` (``study.plot_pair_report``): throughput per pair and system, pair ratios with
  the 99 % line, cached share per policy;
* ``<case>/``: each case's engine, server or service logs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sut.errors import EngineError, RunFailed
from sut.flame.endpoint import STANDIN_NOTE
from sut.locality import NOTICE, RUN_SUFFIX
from sut.locality.pairs import PairSettings, StudyContext, run_pairs, run_records
from sut.locality.study import pair_report, plot_pair_report
from sut.locality.systems import System
from sut.locality.trace import (
    TraceRequest,
    TraceSettings,
    describe,
    input_hash,
    make_trace,
    shift_trace,
    trace_hash,
    warmup_shifts,
)
from sut.locality.workloads.prepare import prepare_workload, workload_record
from sut.record.write import version

log = logging.getLogger(__name__)

#: Written by ``run`` before its first case: the run's settings (``run_header``), for merging.
HEADER = "run_header.json"


@dataclass
class PreparedTrace:
    """The measured trace, its warm-ups (``shifts``) and hashes (``input_hashes[rid]``); ``extra``: more
    shifted copies measured apart from it (the ``arrivals`` levels after the first), each ``(shift, trace,
    input hashes)``."""

    settings: TraceSettings
    trace: list
    warmups: list
    shifts: list
    input_hashes: list
    shape: dict
    extra: list = dataclasses.field(default_factory=list)

    def record(self) -> dict:
        out = {"trace_settings": self.settings, "trace": self.shape, "trace_hash": trace_hash(self.trace),
               "input_hashes": self.input_hashes,
               "warmups": [{"shift": s, "trace_hash": trace_hash(w)} for s, w in zip(self.shifts, self.warmups)]}
        if self.extra:
            out["level_copies"] = [{"shift": s, "trace_hash": trace_hash(t)} for s, t, _ in self.extra]
        return out


def prepare_trace(ts: TraceSettings, warmups: int, trace: Optional[Sequence[TraceRequest]] = None,
                  extra: int = 0) -> PreparedTrace:
    """Build (or take) the trace, its ``warmups`` shifted copies and ``extra`` more (shifts that keep every
    copy apart from the trace and from each other). ``ValueError`` as ``make_trace`` / ``warmup_shifts`` raise
    it (bad news input, ids that cannot be shifted)."""
    trace = list(trace if trace is not None else make_trace(ts))
    shifts = warmup_shifts(trace, warmups + extra, ts.id_limit) if warmups + extra else []
    copies = [shift_trace(trace, s, ts.id_limit) for s in shifts]
    shape = describe(trace)
    if ts.zipf_s > 0:
        from sut.locality.workloads.hot_prefixes import popularity

        shape["popularity"] = popularity(trace)
    return PreparedTrace(ts, trace, copies[:warmups], shifts[:warmups], [input_hash(r.prompt) for r in trace], shape,
                         [(s, c, [input_hash(r.prompt) for r in c])
                          for s, c in zip(shifts[warmups:], copies[warmups:])])


def make_run_dir(output_dir: str, run_name: Optional[str], label: str) -> Path:
    """Create the run folder (name ends in ``-SYNTHETIC-LOCALITY-NOT-MLPERF``) before any engine starts.

    Raises ``FileExistsError`` for a folder that exists, ``OSError`` when it cannot be created.
    """
    name = run_name or (_dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + label)
    d = Path(output_dir) / (name + RUN_SUFFIX)
    d.mkdir(parents=True, exist_ok=False)
    return d


def runtime_versions() -> dict:
    """Python, the packages that run the experiment, and this repository's commit (``sut.record.provenance``)."""
    from sut.record.provenance import harness_commit

    return {"python": platform.python_version(), "platform": platform.platform(),
            **{d: version(d) for d in ("vllm", "torch", "transformers", "flamepy", "numpy")}, **harness_commit()}


def write_record(d: Path, record: dict, name: str = "locality.json") -> Path:
    """Write ``record`` (marked ``"mlperf": false``) as ``name`` into the run folder ``d``; returns its path."""
    record = dict({"kind": "synthetic-locality", "mlperf": False, "notice": NOTICE}, **record)
    path = d / name
    path.write_text(json.dumps(record, indent=1, default=_json_default))
    return path


def append_case(d: Path, rec: dict) -> None:
    """Append one finished case's record as a line of ``<run>/cases.jsonl``, so that a run cut off
    before ``locality.json`` is written (a device budget that ends) keeps every case it finished."""
    with open(d / "cases.jsonl", "a") as fh:
        fh.write(json.dumps(rec, default=_json_default) + "\n")


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def kv_cache_summary(engines: Sequence[dict], shape: dict) -> dict:
    """Each replica's KV-cache capacity (blocks x block size, blocks, block size, vLLM's own token figure; from the
    replicas' read-back ``kv_cache``, ``sut.engine.readback.kv_cache_capacity``), the total, and the trace's distinct document tokens
    (``shape["document_tokens"]``) that the caches would need to hold at once."""
    unknown = {"blocks": None, "block_size": None, "tokens": None, "tokens_from": None, "vllm_tokens": None}
    per = [dict({"replica": i}, **(e.get("kv_cache") or unknown)) for i, e in enumerate(engines)]
    known = [p["tokens"] for p in per if p.get("tokens") is not None]
    return {"per_replica": per, "tokens_total": sum(known) if len(known) == len(per) else None,
            "trace_document_tokens": shape.get("document_tokens")}


def deviation_notes(cases: Sequence[dict]) -> list[str]:
    """How the run's set-up differs from the study's (one GPU per replica, fresh engines). Every case's
    placement counts: a merge of runs from different hosts names every device and says the cases did not
    all run on one placement."""
    notes = []
    placements = {tuple(p["key"] for p in c["placement"]) for c in cases if c.get("placement")}
    shared = sorted(pl for pl in placements if len(pl) > 1 and len(set(pl)) < len(pl))
    if shared:
        devices = sorted({k for pl in shared for k in pl})
        note = (f"{len(shared[0])} replicas share {len(set(shared[0]))} device(s) ({', '.join(devices)}); "
                "the study ran one GPU per replica (two B200s)")
        if len(placements) > 1:
            note += f"; the cases ran on {len(placements)} different placements (runs from different hosts merged)"
        notes.append(note)
    if any(not c.get("fresh_engines", True) for c in cases):
        notes.append("some systems ran on servers that were already running: not fresh engines per pair")
    if any(((c.get("transport_stats") or {}).get("flame") or {}).get("control_plane") == "stand-in" for c in cases):
        notes.append(f"{STANDIN_NOTE}; the flame / standalone ratios are no result")
    return notes


def run_header(systems: Sequence[System], prepared: PreparedTrace, ps: PairSettings, base_record: dict) -> dict:
    """What a run is, known before its first case: ``base_record`` (command, trace preset, runtime,
    model, engine, generation and router settings), the trace record and the protocol and systems'
    settings. ``run_study`` writes it as ``run_header.json`` first, so that a run cut off before
    ``locality.json`` can still be merged (``sut.locality.merge``)."""
    return dict(base_record, **prepared.record(), pair_settings=ps, systems={s.name: s.record() for s in systems})


def finish_record(d: Path, record: dict, cases: Sequence[dict], runs: Sequence[dict], shape: dict,
                  placement: Sequence[dict], report: Optional[dict] = None) -> dict:
    """Add the cases, per-run records, notes, KV-cache summary and (with ``runs`` and no ``error``)
    the pair report (``report`` when already computed, else ``pair_report(runs)``) and ``locality.png``
    to ``record``; write ``locality.json`` into ``d``. Shared by ``run`` and ``report`` (merged runs,
    whose report is computed before their folder is made)."""
    record.update(placement=list(placement), notes=list(record.get("notes", [])) + deviation_notes(cases),
                  cases=list(cases), runs=list(runs))
    first = next((c for c in cases if c.get("replicas")), None)
    if first:
        record["kv_cache"] = kv_cache_summary(first["replicas"], shape or {})
    if runs and not record.get("error"):
        metric = record.get("report_metric") or "requests_per_s"
        record["report"] = report if report is not None else pair_report(runs, metric)
        record["figure"] = _figure(runs, d, metric, record)
    record["record_path"] = str(write_record(d, record))
    return record


def _figure(runs: Sequence[dict], d: Path, metric: str, record: dict) -> Optional[str]:
    """Draw ``locality.png``; its name, or None with a warning and a note in ``record`` when drawing fails (a
    figure must never fail a run that measured fine: ``locality.json`` holds every value it would show). An
    ``OSError`` (disk full, no permission) is a write failure like the record's own and is raised."""
    try:
        return plot_pair_report(runs, d / "locality.png", metric, record=record).name
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - any plotting error; the record and the console report still come
        log.warning("locality.png not drawn: %s: %s", type(e).__name__, e)
        record.setdefault("notes", []).append(f"locality.png not drawn ({type(e).__name__}: {e}); every value is "
                                              "in locality.json")
        return None


def run_study(systems: Sequence[System], prepared: PreparedTrace, ctx: StudyContext, ps: PairSettings,
              base_record: dict) -> tuple[dict, Optional[str]]:
    """Write ``run_header.json``, run every case; write ``locality.json`` (and, with results,
    ``locality.png``) into ``ctx.run_dir``. Returns ``(record, error)``; ``error`` None when every
    case passed."""
    if ctx.workload.active:
        try:
            ctx, prepared, wrec = prepare_workload(systems, ctx, ps, prepared)
        except (RunFailed, EngineError, ValueError) as e:
            error = f"preparing the workload failed: {e}"
            log.error("%s", error)
            header = run_header(systems, prepared, ps, dict(base_record, workload=workload_record(ctx.workload)))
            return finish_record(ctx.run_dir, dict(header, status="failed", error=error), [], [], prepared.shape,
                                 _placement(ctx)), error
        base_record = dict(base_record, workload=wrec)
    header = run_header(systems, prepared, ps, base_record)
    write_record(ctx.run_dir, header, HEADER)
    finished: list[dict] = []

    def on_case(rec: dict) -> None:
        append_case(ctx.run_dir, rec)
        finished.append(rec)

    def cut_short(status: str, error: str) -> dict:  # the finished cases, no pair report
        return finish_record(ctx.run_dir, dict(header, status=status, error=error), finished, [], prepared.shape,
                             _placement(ctx))

    try:
        cases, error = run_pairs(systems, ctx, ps, on_case=on_case)
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: a run that finished cases keeps them, with a record saying so
        if finished:
            cut_short("interrupted", f"interrupted after {len(finished)} finished case(s); they are in cases.jsonl "
                                     "(python -m sut.locality report RUN [RUN...] merges them with other runs' cases)")
        raise
    except Exception as e:  # a fault no case check names (a harness bug): the record still says failed, and why
        log.exception("the run stopped on an unexpected error")
        error = f"unexpected error after {len(finished)} finished case(s): {type(e).__name__}: {e}"
        return cut_short("failed", error), error
    record = dict(header, status="failed" if error else "ok", error=error)
    return finish_record(ctx.run_dir, record, cases, run_records(cases), prepared.shape, _placement(ctx)), error


def _placement(ctx: StudyContext) -> list[dict]:
    return [{"replica": r, "key": k, "first_seen_in": c} for r, (k, c) in sorted(ctx.placement.items())]


def command_line() -> str:
    return "python -m sut.locality " + " ".join(sys.argv[1:])
