"""One report from the finished cases of several locality runs (``python -m sut.locality report``).

A study (5 pairs x systems x policies) may span several device sessions, each cut off by its device
time. Every run appends each finished case to ``<run>/cases.jsonl`` and writes its settings first, as
``<run>/run_header.json`` (``runner.run_header``); a run that ended writes them into ``locality.json``
too. This module reads those files and builds one record from them:

* **settings**: each run's header (``locality.json``, else ``run_header.json``; a run holding both whose two files
  disagree on a field both carry is refused, ``case_schema.header_files_problem``). Runs whose trace hash,
  trace preset, model revision, engine settings (the model's path aside: the revision names the model),
  generation, router settings, protocol (warm-ups, rate, arrival seed), report metric, the workloads' knobs
  and what was measured before the pairs (``arrivals``' capacity and levels, ``eviction``'s KV tokens: a run
  that resumes another passes them as ``--capacity`` / ``--kv-tokens``) or the settings of a system they
  both ran differ are refused (``BadInput``, exit 2, naming the run and the field). A run without a
  header (cut off by a version that wrote none) can only be reported alone: its settings are unknown
  and the record says so;
* **cases**: every ``cases.jsonl`` line must be a finished case of the shape ``case_schema`` checks
  (``BadInput`` naming run, line and field), with the workload parts its run's header names (an arrivals run's
  load levels in ``levels``, a replica-loss run's ``failover``: ``_workload_problem``); a last line without
  its newline that is no JSON (the run stopped while appending it) is skipped and noted. A case whose
  ``timed.cached_share`` exceeds its trace's ``reusable_share_upper_bound`` (in the header's ``trace``) by more than
  :data:`CACHED_SHARE_SLACK` is refused: no cache can skip more than the shared prefixes. A folder given
  twice, or a copy of another run, is refused naming both runs: a case of one folder counts as a copy of
  a case of another (the same system and policy) when it is the same record, when it has the same
  identity (``start_s`` and its engines' process ids, which no two runs share), or when every timing
  (``timed.wall_s`` and the p50/p90/p99 of ``ttft_s``, ``e2e_s``, ``completion_s``, at least
  :data:`MIN_TIMINGS` of them) is within :data:`NEAR_REL` of the other's (genuine repeats on one H200
  differ by 0.4 % or more in at least one of them);
* **pairs**: renumbered in run order, then by the run's own pair number; every case keeps its
  ``source`` (run folder, pair, position in that run);
* **complete pairs only**: a pair counts for a policy when every system of the merged runs finished
  that policy in it; the others are listed in ``dropped`` and left out of the per-run records
  (``runs``) and so of the medians and ratios (``sut.locality.study.pair_report``); no complete pair
  at all is refused. The report is computed by ``build``, before any folder is made.

``write_merged`` writes the record as a new run folder (``...-SYNTHETIC-LOCALITY-NOT-MLPERF``) with
``locality.json``, ``locality.png`` and the console table: the same code as ``run``
(``runner.finish_record``). Each case's logs stay in its source run's folder.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from accuracy.boundedread import GREW, TOO_LARGE, BoundedReadError, read_regular
from accuracy.jsontext import JSONLinesError, parse_json, read_jsonl
from sut.errors import BadInput
from sut.locality.case_schema import HEADER_CHECKS, header_files_problem, problem
from sut.locality.pairs import run_records
from sut.locality.runner import HEADER, finish_record
from sut.locality.study import pair_report

#: Header fields that must be equal in every merged run (dotted paths into the header); ``trace_preset`` first, so
#: that runs of two presets are told apart by their presets' names, not by their traces' hashes. eviction's sized
#: capacity (``workload.working_set.replica_kv_tokens``) is not compared: it shapes only the documents count, which
#: ``trace_hash`` covers, and the engines' blocks are in ``engine_settings`` (records before 2026-12-07 hold vLLM's
#: own token figure, 65,514 for the 65,536 of 4,096 blocks of 16, later ones blocks x block size).
COMPARED = ("trace_preset", "trace_hash", "model.revision", "engine_settings", "generation", "router_settings",
            "pair_settings.warmups", "pair_settings.rate", "pair_settings.arrival_seed", "report_metric",
            "workload.settings", "workload.capacity.requests_per_s", "workload.levels")
#: How far a case's ``timed.cached_share`` may exceed its trace's ``reusable_share_upper_bound``: the bound counts
#: whole shared prefixes (``trace.describe``), the engines count cached tokens in whole blocks, which can add the
#: few leading ids that the questions of one document share (``"\n\nQuestion"``: a few ids of ~8,000-id
#: prompts), and both are rounded to 4 decimals.
CACHED_SHARE_SLACK = 0.005
#: Two cases' timings closer than this (relative, every one of them) make one a copy of the other: the real
#: H200 cases of ``tests/data/locality_h200_cut_off`` differ by 0.38 % to 1.5 % in their most distant timing.
NEAR_REL = 1e-3
#: Timings are recorded to 4 decimals (seconds): one shorter than ``RESOLUTION_S / NEAR_REL`` (0.1 s) cannot tell
#: a copy from a repeat (two millisecond bursts of a test double round to the same value), so it is not compared.
RESOLUTION_S = 1e-4
#: Largest ``cases.jsonl``, ``locality.json`` or ``run_header.json`` read (the other inputs' bound): a case of the
#: largest trace (100,000 requests) holds ~7 MB of output hashes; a larger file, a FIFO or a device is refused unread.
MAX_FILE_BYTES = 1 << 30
#: Fewest timings both cases must have for :data:`NEAR_REL` to judge (a case records 10).
MIN_TIMINGS = 4
#: Engine settings whose value here means the same as unset (None): a run that gives ``--admit-every-steps 1``
#: merges with one that does not (``sut.engine.worker.serve`` treats both as "admit every step").
UNSET_AS = {"admit_every_steps": 1}
_ABSENT = object()
#: Fields of a host, not of the experiment: left out of the comparison.
HOST_FIELDS = {"engine_settings": ("model",),
               # measured by the first run, given to the next one (--capacity, --kv-tokens): their values are compared
               "workload.settings": ("capacity", "kv_tokens"),
               "options": ("endpoint", "urls", "fleet", "servers", "app_workdir", "service_log_dir", "lock_dir",
                           "session_id")}
#: System options added after runs were recorded that only bound the wait for a fault (a finished case measured
#: nothing they changed): a run recorded before the option existed merges with one that leaves it unset (None).
#: ``engine_stall_s``: the Flame service's hung-engine watchdog.
ADDED_UNSET_OPTIONS = ("engine_stall_s",)


@dataclass
class SourceRun:
    """One run folder as read: ``header`` (None: unknown) and where it came from, the run's status
    and error (from ``locality.json``; None when it never wrote one), its finished cases, notes on
    what was skipped (a cut-off last line of ``cases.jsonl``)."""

    path: Path
    header: Optional[dict]
    header_file: Optional[str]
    status: Optional[str]
    error: Optional[str]
    cases: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class Merged:
    """The merged record's settings part (``record``), its cases (renumbered), the per-run records
    of complete pairs (``runs``), their pair report (``study.pair_report``), the trace shape and the
    placement (per source run)."""

    record: dict
    cases: list
    runs: list
    report: dict
    shape: dict
    placement: list


def _read_text(path: Path, run: Path) -> str:
    """``path``'s text; ``BadInput`` naming run and file for one that is no regular file of at most
    :data:`MAX_FILE_BYTES` (a FIFO is never opened, so it cannot block the command) or not UTF-8."""
    try:
        return read_regular(path, MAX_FILE_BYTES).decode("utf-8")
    except (BoundedReadError, UnicodeDecodeError) as e:
        raise BadInput(f"error: run {run}: cannot read {path.name}: {_why(e)}") from None


def _why(e: Exception) -> str:
    if isinstance(e, BoundedReadError) and e.problem in (TOO_LARGE, GREW):
        return f"{e} of {MAX_FILE_BYTES:,} bytes"
    return str(e)


def _present(path: Path) -> bool:
    """``path`` exists as anything (a FIFO, folder or dangling link too: read, and refused, as a run file)."""
    return path.is_symlink() or path.exists()


def _read_header(path: Path, run: Path) -> dict:
    """The run's header file (``BadInput`` naming run, file and field when it is no header)."""
    try:
        header = parse_json(_read_text(path, run))
    except ValueError as e:
        raise BadInput(f"error: run {run}: cannot read {path.name}: {e}") from None
    why = problem(header, HEADER_CHECKS)
    if why:
        raise BadInput(f"error: run {run}: {path.name} {why}")
    return header


def _is_merged_report(run: Path) -> bool:
    """True when ``run/locality.json`` is a record ``write_merged`` wrote (``"merged": true``)."""
    try:
        return parse_json(read_regular(run / "locality.json", MAX_FILE_BYTES)).get("merged") is True
    except (BoundedReadError, ValueError, AttributeError):
        return False


def read_cases(run: Path) -> tuple[list[dict], list[str]]:
    """The finished cases of ``run/cases.jsonl`` and notes on what was skipped: a last line that is
    not JSON and has no newline (the run was stopped while appending it: ``accuracy.jsontext.read_jsonl``)
    is skipped with a note.
    ``BadInput`` naming run, line and field for any other bad line (``case_schema.problem``)."""
    path = run / "cases.jsonl"
    if not _present(path):
        if _is_merged_report(run):
            raise BadInput(f"error: run {run} is a merged report (written by `report`): merge its source runs "
                           "instead (listed in its locality.json under sources)")
        raise BadInput(f"error: run {run}: no cases.jsonl (not a locality run folder, or one older than cases.jsonl)")
    try:
        jl = read_jsonl(path, max_bytes=MAX_FILE_BYTES)
    except JSONLinesError as e:
        raise BadInput(f"error: run {run}: cases.jsonl line {e.line} is not JSON ({e.reason})") from None
    except (OSError, BoundedReadError) as e:
        raise BadInput(f"error: run {run}: cannot read {path.name}: {_why(e)}") from None
    cases, notes = [], []
    if jl.cut_line is not None:
        notes.append(f"run {run}: cases.jsonl line {jl.cut_line} is cut off (the run stopped while writing it): "
                     "skipped")
    for n, case in jl.records:
        why = problem(case)
        if why:
            raise BadInput(f"error: run {run}: cases.jsonl line {n} {why}")
        cases.append(case)
    twice = sorted(k for k, count in Counter((c["pair"], c["system"], c["policy"]) for c in cases).items()
                   if count > 1)
    if twice:
        raise BadInput(f"error: run {run}: cases.jsonl holds pair {twice[0][0]}, system {twice[0][1]}, "
                       f"policy {twice[0][2]} twice")
    if not cases:
        raise BadInput(f"error: run {run}: cases.jsonl holds no finished case")
    return cases, notes


def load_run(path: str | Path) -> SourceRun:
    """Read one run folder (``BadInput`` for a folder without cases.jsonl or with unreadable files)."""
    run = Path(path)
    if not run.is_dir():
        what = "a file, not a run folder (give the folder that holds it)" if run.exists() else "no such folder"
        raise BadInput(f"error: run {run}: {what}")
    cases, notes = read_cases(run)
    status = error = None
    header, header_file = None, None
    if _present(run / "locality.json"):
        header, header_file = _read_header(run / "locality.json", run), "locality.json"
        status, error = header.get("status"), header.get("error")
        why = header_files_problem(header, _read_header(run / HEADER, run)) if _present(run / HEADER) else None
        if why:
            raise BadInput(f"error: run {run}: {why}")
    elif _present(run / HEADER):
        header, header_file = _read_header(run / HEADER, run), HEADER
    if header is not None:
        _check_cases_against_header(run, header, cases)
    for c in cases:
        left = (c.get("cleanup") or {}).get("processes_left")
        if left:
            notes.append(f"run {run}: pair {c['pair']}, {c['system']}, {c['policy']} left {len(left)} process(es) "
                         f"behind after its engines stopped: {_short_list(left)}")
    return SourceRun(run, header, header_file, status, error, cases, notes)


def _short_list(items: list) -> str:
    text = json.dumps(items)
    return text if len(text) <= 200 else text[:197] + "..."


def _check_cases_against_header(run: Path, header: dict, cases: Sequence[dict]) -> None:
    """``BadInput`` for a case whose system, policy or pair its run's own settings never had (a hand-edited line)."""
    ps = header.get("pair_settings") if isinstance(header.get("pair_settings"), dict) else {}
    systems = header.get("systems") if isinstance(header.get("systems"), dict) else None
    policies, pairs = ps.get("policies"), ps.get("pairs")
    trace = header.get("trace") if isinstance(header.get("trace"), dict) else {}
    requests = trace.get("requests")
    bound = trace.get("reusable_share_upper_bound")
    for c in cases:
        where = f"error: run {run}: cases.jsonl case pair {c['pair']}, {c['system']}, {c['policy']}"
        if isinstance(requests, int) and not isinstance(requests, bool) and c["timed"]["requests"] != requests:
            raise BadInput(f"{where}: timed.requests {c['timed']['requests']} is not the run's trace of {requests} "
                           "requests")
        if systems is not None and c["system"] not in systems:
            raise BadInput(f"{where}: system {c['system']!r} is not one of the run's systems {sorted(systems)}")
        if isinstance(policies, list) and c["policy"] not in policies:
            raise BadInput(f"{where}: policy {c['policy']!r} is not one of the run's policies {policies}")
        if isinstance(pairs, int) and not isinstance(pairs, bool) and c["pair"] >= pairs:
            raise BadInput(f"{where}: pair {c['pair']} is past the run's {pairs} pair(s)")
        share = c["timed"].get("cached_share")
        if _is_number(bound) and share is not None and share > bound + CACHED_SHARE_SLACK:
            raise BadInput(f"{where}: timed.cached_share {share} is above its trace's reusable_share_upper_bound "
                           f"{bound} (no prefix cache skips more than the shared prefixes)")
        why = _workload_problem(header, c)
        if why:
            raise BadInput(f"{where}: {why}")


def _workload_problem(header: dict, case: dict) -> Optional[str]:
    """What a case lacks of its run's workloads (``header["workload"]``): an arrivals run's case has the run's
    load levels (``levels``), a replica-loss run's case its ``failover``; a case of neither has neither."""
    w = header.get("workload") if isinstance(header.get("workload"), dict) else {}
    levels = [x.get("level") for x in w.get("levels") or [] if isinstance(x, dict)]
    have = [x["level"] for x in case.get("levels") or []]
    if have != levels:
        return f"levels {have} are not the run's load levels {levels} (workload.levels)"
    kill = (w.get("settings") or {}).get("kill_after") if isinstance(w.get("settings"), dict) else None
    killed = _is_number(kill) and kill > 0
    if killed != (case.get("failover") is not None):
        return ("no failover record, but the run killed a replica (workload.settings.kill_after)" if killed else
                "a failover record, but the run killed no replica (workload.settings.kill_after)")
    return None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(header: dict, dotted: str):
    value = header
    for part in dotted.split("."):
        value = (value or {}).get(part) if isinstance(value, dict) else None
    if isinstance(value, dict) and dotted in HOST_FIELDS:
        value = {k: v for k, v in value.items() if k not in HOST_FIELDS[dotted]}
    if isinstance(value, dict) and dotted == "engine_settings":  # unset = vLLM's own, as in a header
        value = {k: v for k, v in value.items()  # written before the field existed, or its default spelled out
                 if v is not None and UNSET_AS.get(k, _ABSENT) != v}
    return value


def _differing(a, b) -> str:
    """The keys of two settings dicts whose values differ, with both values (``a`` the first run's), or the two
    values when they are not both dicts."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"{b!r} vs {a!r}"
    keys = sorted(k for k in set(a) | set(b) if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    return ", ".join(f"{k}: {b.get(k, 'unset')!r} vs {a.get(k, 'unset')!r}" for k in keys)


def _system_settings(sys_rec: dict) -> dict:
    opts = {k: v for k, v in (sys_rec.get("options") or {}).items()
            if k not in HOST_FIELDS["options"] and not (k in ADDED_UNSET_OPTIONS and v is None)}
    return dict(sys_rec, options=opts)


def _differing_system(a: dict, b: dict) -> str:
    """:func:`_differing` of two systems' settings: their options' keys when the options differ, else the
    other keys (transport, fresh_engines)."""
    if a.get("options") != b.get("options"):
        return _differing(a.get("options") or {}, b.get("options") or {})
    return _differing({k: v for k, v in a.items() if k != "options"}, {k: v for k, v in b.items() if k != "options"})


def check_compatible(runs: Sequence[SourceRun]) -> None:
    """``BadInput`` naming the run and field where a run's settings differ from the first run's, or
    when a run without a header is merged with others."""
    unknown = [r for r in runs if r.header is None]
    if unknown and len(runs) > 1:
        raise BadInput(f"error: run {unknown[0].path}: no locality.json or {HEADER} (cut off by a version that wrote "
                       "no header): its settings are unknown, so it can only be reported alone")
    first = runs[0]
    for r in runs[1:]:
        for name in COMPARED:
            a, b = _get(first.header, name), _get(r.header, name)
            if a != b:
                raise BadInput(f"error: run {r.path}: {name} differs from run {first.path}'s ({_differing(a, b)}); "
                               "only runs of the same trace and settings can be merged")
        both = set(first.header.get("systems") or {}) & set(r.header.get("systems") or {})
        for s in sorted(both):
            a, b = _system_settings(first.header["systems"][s]), _system_settings(r.header["systems"][s])
            if a != b:
                raise BadInput(f"error: run {r.path}: systems.{s} (its transport or options) differs from run "
                               f"{first.path}'s ({_differing_system(a, b)}); only runs of the same systems' settings "
                               "can be merged")


def check_distinct(runs: Sequence[SourceRun]) -> None:
    """``BadInput`` for a folder given twice (by any path: each is resolved once) or a copy of another
    run (``cp -r``, the same run fetched twice, its numbers nudged): a case that :func:`copy_of` finds to be
    a copy of a case of another run. A copy merged would count its pairs twice."""
    resolved = [r.path.resolve() for r in runs]
    twice = sorted(str(p) for p, count in Counter(resolved).items() if count > 1)
    if twice:
        raise BadInput(f"error: run {twice[0]} is given twice")
    for i, r in enumerate(runs):
        for earlier in runs[:i]:
            for c in r.cases:
                for e in earlier.cases:
                    why = copy_of(c, e)
                    if why:
                        raise BadInput(f"error: run {r.path} holds the same case as run {earlier.path} (pair "
                                       f"{c['pair']}, {c['system']}, {c['policy']}; {why}): a copy of that run; "
                                       "give each run once")


def _timings(case: dict) -> dict:
    """``{name: seconds}``: ``timed.wall_s`` and the p50/p90/p99 of ``ttft_s``, ``e2e_s``, ``completion_s`` present."""
    t = case["timed"]
    out = {"wall_s": t["wall_s"]}
    for k in ("ttft_s", "e2e_s", "completion_s"):
        for p, v in (t.get(k) or {}).items():
            if _is_number(v):
                out[f"{k}.{p}"] = v
    return out


def _identity(case: dict):
    """``(start_s, engine pids)`` of a case, or None when it lacks either."""
    pids = [x.get("pid") for x in case.get("replicas") or []]
    if case.get("start_s") is None or not pids or not all(_is_number(p) for p in pids):
        return None
    return case["start_s"], tuple(pids)


def copy_of(a: dict, b: dict) -> Optional[str]:
    """Why case ``a`` is a copy of case ``b`` (module docstring; both of one system and policy), or None."""
    if (a["system"], a["policy"]) != (b["system"], b["policy"]):
        return None
    if json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True):
        return "an identical record"
    ident = _identity(a)
    if ident is not None and ident == _identity(b):
        return f"the same start_s {ident[0]} and engine pids {list(ident[1])}"
    ta, tb = _timings(a), _timings(b)
    both = sorted(k for k in set(ta) & set(tb) if max(abs(ta[k]), abs(tb[k])) * NEAR_REL >= RESOLUTION_S)
    if a["timed"]["requests"] != b["timed"]["requests"] or len(both) < MIN_TIMINGS:
        return None
    if all(abs(ta[k] - tb[k]) <= NEAR_REL * max(abs(ta[k]), abs(tb[k])) for k in both):
        return (f"all {len(both)} timings within {NEAR_REL:.1%} of its, e.g. wall_s {ta['wall_s']} vs "
                f"{tb['wall_s']}")
    return None


def renumber(runs: Sequence[SourceRun]) -> list[dict]:
    """Every case with its pair renumbered (run order, then the run's pair) and its ``source``."""
    out, base = [], 0
    for r in runs:
        pairs = sorted({int(c["pair"]) for c in r.cases})
        new = {p: base + i for i, p in enumerate(pairs)}
        for c in r.cases:
            src = {"run": str(r.path), "pair": int(c["pair"]), "order": c.get("order")}
            out.append(dict(c, pair=new[int(c["pair"])], source=src))
        base += len(pairs)
    return out


def complete_pairs(cases: Sequence[dict], systems: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """``(kept, dropped)``: the cases whose pair has every system of ``systems`` for their policy, and
    one entry per incomplete (pair, policy): ``pair``, ``policy``, ``systems`` finished, ``missing``,
    ``source`` (run and pair, for merged cases). Also the figure's rule (``workloads.figure.groups``)."""
    groups: dict = {}
    for c in cases:
        groups.setdefault((c["pair"], c["policy"]), []).append(c)
    kept, dropped = [], []
    for (pair, policy), cs in sorted(groups.items()):
        have = sorted(c["system"] for c in cs)
        missing = sorted(set(systems) - set(have))
        if missing:
            src = cs[0].get("source")  # a merged case's; a run's own cases (the figure's) have none
            dropped.append({"pair": pair, "policy": policy, "systems": have, "missing": missing,
                            **({"source": {k: src[k] for k in ("run", "pair")}} if src else {})})
        else:
            kept += cs
    return kept, dropped


def _runtime_notes(runs: Sequence[SourceRun]) -> list[str]:
    first = runs[0].header.get("runtime") or {}
    notes = []
    for r in runs[1:]:
        other = r.header.get("runtime") or {}
        diff = sorted(k for k in set(first) | set(other) if k != "platform" and first.get(k) != other.get(k))
        if diff:
            notes.append(f"run {r.path} ran other runtime versions than run {runs[0].path}: {', '.join(diff)}")
    return notes


def _order_notes(cases: Sequence[dict]) -> list[str]:
    """A note when the merged pairs do not alternate which system runs first (a run alternates its own pairs;
    runs of one pair each all start the same way): per policy, how many pairs began with each system."""
    first: dict = {}
    for c in cases:
        key = (c["policy"], c["pair"])
        if c.get("order") is not None and (key not in first or c["order"] < first[key][0]):
            first[key] = (c["order"], c["system"])
    notes = []
    for policy in sorted({p for p, _ in first}):
        counts = Counter(sys for (p, _), (_, sys) in first.items() if p == policy)
        if (len(counts) == 1 and sum(counts.values()) > 1) or max(counts.values()) - min(counts.values()) > 1:
            spread = ", ".join(f"{sys} first in {n}" for sys, n in sorted(counts.items()))
            notes.append(f"{policy}: the merged pairs do not alternate which system runs first ({spread}); an order "
                         "effect (a warmer host for the second system) is not averaged out; a run of one pair starts "
                         "with the first of its --systems")
    return notes


def _source_notes(runs: Sequence[SourceRun], dropped: Sequence[dict]) -> list[str]:
    notes = [n for r in runs for n in r.notes]
    for r in runs:
        if r.status is None:
            notes.append(f"run {r.path} was cut off before its locality.json (its {len(r.cases)} finished case(s) "
                         "from cases.jsonl)")
        elif r.status != "ok":
            notes.append(f"run {r.path} ended {r.status}: {r.error} (its finished cases only)")
    for d in dropped:
        notes.append(f"pair {d['pair']} ({d['source']['run']} pair {d['source']['pair']}), {d['policy']}: dropped, "
                     f"no {', '.join(d['missing'])} case")
    return notes


def _placement(cases: Sequence[dict]) -> list[dict]:
    """Each source run's replica -> device, from its first case with a placement."""
    out, seen = [], set()
    for c in cases:
        run = c["source"]["run"]
        if run in seen or not c.get("placement"):
            continue
        seen.add(run)
        case = f"pair{c['source']['pair']}-{c['system']}-{c['policy']}"
        out += [{"replica": p["replica"], "key": p["key"], "first_seen_in": f"{run}: {case}"} for p in c["placement"]]
    return out


def _report(kept: Sequence[dict], runs: Sequence[SourceRun], dropped: Sequence[dict],
            metric: str = "requests_per_s") -> tuple[list, dict]:
    """The per-run records of the complete pairs and their pair report; ``BadInput`` when no pair is
    complete or the report cannot be made."""
    names = ", ".join(str(r.path) for r in runs)
    if not kept:
        lacks = "; ".join(f"pair {d['source']['pair']} of {d['source']['run']} ({d['policy']}) lacks "
                          f"{', '.join(d['missing'])}" for d in dropped[:5])
        raise BadInput(f"error: runs {names}: no complete pair (a pair counts when every system finished its policy "
                       f"in it): {lacks}")
    records = run_records(kept)
    try:
        return records, pair_report(records, metric)
    except ValueError as e:
        raise BadInput(f"error: runs {names}: no report from their cases: {e}") from None


def build(paths: Sequence[str | Path], command: str = "") -> Merged:
    """Read, check and merge the runs and compute their report (module docstring); nothing is written.
    ``BadInput`` (exit 2) as ``load_run``, ``check_compatible``, ``check_distinct`` raise it, and when no
    pair is complete."""
    if not paths:
        raise BadInput("error: report needs at least one run folder")
    runs = [load_run(p) for p in paths]
    check_compatible(runs)
    check_distinct(runs)
    cases = renumber(runs)
    known = runs[0].header is not None
    if known:
        systems = sorted({s for r in runs for s in (r.header.get("systems") or {})} | {c["system"] for c in cases})
        record = dict(runs[0].header)
        for k in ("status", "error", "cases", "runs", "report", "figure", "record_path", "placement", "kv_cache",
                  "notes", "kind", "mlperf", "notice"):
            record.pop(k, None)
        notes = _runtime_notes(runs)
    else:
        systems = sorted({c["system"] for c in cases})
        record = {"trace_preset": None, "systems": {s: {"transport": next(c.get("transport") for c in cases
                                                                          if c["system"] == s)} for s in systems}}
        notes = [f"settings unknown: run {runs[0].path} has no header (locality.json or {HEADER}); the trace, engine "
                 "and system settings are not recorded (each case's replicas record their engine arguments)"]
    kept, dropped = complete_pairs(cases, systems)
    records, report = _report(kept, runs, dropped, record.get("report_metric") or "requests_per_s")
    record.update(command=command, status="ok", error=None, merged=True, settings_known=known,
                  sources=[{"run": str(r.path), "header": r.header_file, "status": r.status, "error": r.error,
                            "cases": len(r.cases), "runtime": (r.header or {}).get("runtime"),
                            "pairs": [{"pair": old, "merged_pair": new} for old, new in
                                      sorted({(c["source"]["pair"], c["pair"]) for c in cases
                                              if c["source"]["run"] == str(r.path)})]} for r in runs],
                  dropped=dropped, notes=notes + _source_notes(runs, dropped) + _order_notes(kept))
    return Merged(record, cases, records, report, (runs[0].header or {}).get("trace") or {}, _placement(cases))


def write_merged(m: Merged, d: Path) -> dict:
    """Write the merged record into the (new) run folder ``d``: ``locality.json``, ``locality.png``."""
    return finish_record(d, dict(m.record), m.cases, m.runs, m.shape, m.placement, report=m.report)
