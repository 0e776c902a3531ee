"""The shape of what ``python -m sut.locality report`` reads: one ``cases.jsonl`` record, one run header.

``sut.locality.merge`` checks every record before it merges anything, so that a malformed file is
refused (exit 2, naming run, line and field) instead of failing while the report or the merged run
folder is written. The fields checked are the ones the merged record, the pair report
(``study.pair_report``), the KV-cache summary and the console table (``report.case_rows``) read, and
the workloads' own parts of a case and of a header that their report sections and figure panels read:
``failover`` (replica-loss, ``workloads.replica_loss.report_lines``), each of ``levels`` (arrivals,
``workloads.arrivals``), the client latencies (variable answers), per-replica counts and balance (hot
prefixes), the working set and the router's expected cached share (eviction); their writer is
``pairs.run_case`` (cases) and ``runner.run_header`` (headers).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

from sut.locality.study import METRICS

_MISSING = object()


class Check(NamedTuple):
    """``path`` (dotted, into the record) must satisfy ``ok``, described as ``what``; an absent
    ``required`` field is reported as lacking, an absent optional one is checked as None."""

    path: str
    required: bool
    ok: Callable[[object], bool]
    what: str


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: Integers a JSON reader holds exactly as a double (2**53): a count beyond it is no count this harness wrote, and
#: the report's arithmetic (``requests / wall_s``) would overflow on ones far beyond it.
MAX_INT = 2 ** 53


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT <= v <= MAX_INT


def _obj_or_null(v) -> bool:
    return v is None or isinstance(v, dict)


def _objects(v, item: Callable[[dict], bool]) -> bool:
    """A list of objects, each satisfying ``item``."""
    return isinstance(v, list) and all(isinstance(x, dict) and item(x) for x in v)


def _latency(v) -> bool:
    """Null or a spread of durations / loads (``{"p50": ..}``): every value null or a finite number >= 0."""
    return v is None or (isinstance(v, dict) and all(x is None or (_number(x) and x >= 0) for x in v.values()))


def _nullable_numbers(v) -> bool:
    return v is None or (isinstance(v, list) and all(x is None or _number(x) for x in v))


def _working_set(v) -> bool:
    """A header's eviction sizing (``workloads.eviction``): null, or the numbers its report section prints."""
    return v is None or (isinstance(v, dict) and _int(v.get("documents")) and all(
        _number(v.get(k)) for k in ("document_tokens", "replica_kv_tokens", "ratio")))


def _kv(v) -> bool:
    return v is None or (isinstance(v, dict) and all(v.get(k) is None or _number(v[k]) for k in ("tokens", "blocks")))


CASE_CHECKS = (
    Check("pair", True, lambda v: _int(v) and v >= 0, "an integer >= 0"),
    Check("system", True, lambda v: isinstance(v, str) and v != "", "a system name"),
    Check("policy", True, lambda v: isinstance(v, str) and v != "", "a policy name"),
    Check("timed", True, lambda v: isinstance(v, dict), "an object"),
    Check("timed.requests", True, lambda v: _int(v) and v > 0, "an integer > 0"),
    Check("timed.wall_s", True, lambda v: _number(v) and v > 0, "a number > 0 (seconds)"),
    Check("timed.requests_per_s", True, lambda v: _number(v) and v > 0, "a number > 0"),
    Check("timed.output_tokens_per_s", True, lambda v: _number(v) and v >= 0, "a number >= 0"),
    Check("timed.cached_share", False, lambda v: v is None or (_number(v) and 0 <= v <= 1), "null or in [0, 1]"),
    *(Check(f"timed.{k}", False, _latency, "null or an object of numbers")
      for k in ("ttft_s", "e2e_s", "completion_s", "client_ttft_s", "tpot_s", "latency_s")),
    # <= 1 only: a replica-loss record before the router counted its routed prompt tokens holds a negative share
    # (its re-routed requests' estimates over the answered requests' prompts), still readable
    Check("timed.router_cached_share", False, lambda v: v is None or (_number(v) and v <= 1), "null or a number <= 1"),
    Check("timed.balance", False, _latency, "null or an object of numbers"),
    Check("timed.per_replica", False, lambda v: v is None or _objects(v, lambda x: _int(x.get("requests")) and all(
        x.get(k) is None or _number(x[k]) for k in ("uncached_tokens", "prompt_tokens", "cached_tokens", "done_s"))),
          "a list of objects with an integer requests (uncached_tokens, prompt_tokens, cached_tokens, done_s: "
          "null or numbers)"),
    Check("working_set", False, lambda v: v is None or (isinstance(v, dict) and _nullable_numbers(
        v.get("replica_kv_tokens")) and (v.get("ratio") is None or _number(v["ratio"]))
        and (v.get("note") is None or isinstance(v["note"], str))),
          "null or an object (replica_kv_tokens: a list of numbers or nulls; ratio: null or a number; note: null or "
          "a string)"),
    Check("placement", False, lambda v: v is None or _objects(v, lambda x: _int(x.get("replica"))
                                                              and isinstance(x.get("key"), str)),
          "a list of objects with an integer replica and a key"),
    Check("replicas", False, lambda v: v is None or _objects(v, lambda x: _kv(x.get("kv_cache"))),
          "a list of objects (kv_cache: null or an object with numeric tokens and blocks)"),
    Check("start_s", False, lambda v: v is None or _number(v), "null or a number"),
    Check("routing", False, _obj_or_null, "null or an object"),
    Check("validation", True, lambda v: isinstance(v, dict), "an object"),
    Check("validation.failures", True, lambda v: v == 0, "0 (a finished case passed the validation of every timed "
                                                          "request)"),
    Check("validation.requests_checked", True, _int, "an integer"),
    Check("cleanup.processes_left", False, lambda v: v is None or isinstance(v, list), "null or a list"),
)

#: A replica-loss case's ``failover`` (``burst.failover_record``): what its report section reads.
FAILOVER_CHECKS = (
    Check("killed", True, lambda v: isinstance(v, dict), "an object"),
    Check("killed.at_s", False, lambda v: v is None or _number(v), "null or a number"),
    *(Check(k, True, lambda v: _int(v) and v >= 0, "an integer >= 0")
      for k in ("answered", "rerouted", "failed", "requests")),
    *(Check(k, False, lambda v: v is None or _number(v), "null or a number")
      for k in ("detected_after_s", "recovery_s", "drained_s")),
    Check("detected_how", False, lambda v: v is None or isinstance(v, str), "null or a string"),
    Check("requests_failed", False, lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(x, str) for x in v.values())), "null or an object of reasons (strings)"),
)

#: One load level of an arrivals case (``pairs._timed_levels``): what the pair report and its section read.
LEVEL_CHECKS = (
    Check("level", True, lambda v: _number(v) and 0 < v <= 2, "a fraction in (0, 2]"),
    Check("rate", True, lambda v: _number(v) and v >= 0, "a number >= 0 (requests/s)"),
    Check("timed", True, lambda v: isinstance(v, dict), "an object"),
    *(c for c in CASE_CHECKS if c.path.startswith("timed.")),
    Check("timed.goodput_per_s", True, lambda v: _number(v) and v >= 0, "a number >= 0"),
    Check("timed.goodput_share", False, lambda v: v is None or (_number(v) and 0 <= v <= 1), "null or in [0, 1]"),
    *(Check(f"timed.{k}", False, _latency, "null or an object of numbers") for k in ("client_ttft_s", "tpot_s")),
    Check("validation", True, lambda v: isinstance(v, dict), "an object"),
    Check("validation.failures", True, lambda v: v == 0, "0 (a finished level passed the validation of every "
                                                         "request)"),
    Check("validation.requests_checked", True, _int, "an integer"),
)

#: The metrics a run's pair report may compare: ``study.METRICS`` and the arrivals workload's goodput.
REPORT_METRICS = (*METRICS, "goodput_per_s")

HEADER_CHECKS = (
    Check("systems", False, lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(s, dict) and _obj_or_null(s.get("options")) for s in v.values())),
          "null or an object of systems, each an object with an options object"),
    Check("runtime", False, _obj_or_null, "null or an object"),
    Check("trace", False, _obj_or_null, "null or an object"),
    Check("trace_settings", False, _obj_or_null, "null or an object"),
    Check("trace.answer_tokens", False, _latency, "null or an object of numbers"),
    Check("trace.popularity", False, _obj_or_null, "null or an object"),
    Check("trace.popularity.hottest", False, lambda v: v is None or _objects(v, lambda x: _number(x.get("share"))),
          "null or a list of objects with a numeric share"),
    *(Check(f"trace.{k}", False, lambda v: v is None or (_int(v) and v >= 0), "null or an integer >= 0")
      for k in ("requests", "documents", "prompt_tokens", "document_tokens")),
    Check("trace.reusable_share_upper_bound", False, lambda v: v is None or (_number(v) and 0 <= v <= 1),
          "null or in [0, 1]"),
    Check("trace_settings.zipf_s", False, lambda v: v is None or (_number(v) and v >= 0), "null or a number >= 0"),
    Check("trace_settings.answers", False, lambda v: v is None or isinstance(v, str), "null or a string"),
    Check("report_metric", False, lambda v: v is None or v in REPORT_METRICS, f"null or one of {REPORT_METRICS}"),
    Check("workload", False, _obj_or_null, "null or an object"),
    Check("workload.settings", False, _obj_or_null, "null or an object"),
    Check("workload.calibration", False, lambda v: v is None or (
        isinstance(v, dict) and all(isinstance(v.get(k), str) for k in ("system", "policy"))
        and _number(v.get("requests_per_s")) and v["requests_per_s"] > 0),
          "null or an object with a system, a policy and requests_per_s > 0"),
    Check("workload.working_set", False, _working_set,
          "null or an object with an integer documents and numeric document_tokens, replica_kv_tokens and ratio"),
)


def _at(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def nonfinite(value, path: str = "") -> Optional[tuple[str, float]]:
    """The dotted path (list items as ``[i]``) and value of the first NaN or infinite number in a decoded JSON
    value, else None. JSON has no such numbers, but Python's reader takes ``NaN`` and ``Infinity``, and a merged
    record would carry them on to readers that refuse them."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "(the value)", value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = nonfinite(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def problem(record, checks=CASE_CHECKS, prefix: str = "") -> Optional[str]:
    """What is wrong with ``record`` (a decoded JSON value) against ``checks``, as a phrase that
    follows "line N" or "run_header.json" (e.g. ``"field timed.requests_per_s is 0.0, not a number > 0"``);
    None when nothing is. Checks stop at the first problem (an absent ``timed`` is not reported again
    for each metric). ``prefix``: where ``record`` sits in its case (``failover.``), for the field names."""
    if not isinstance(record, dict):
        where = f"field {prefix.rstrip('.')} " if prefix else ""
        return f"{where}is {type(record).__name__} {_short(record)}, not a JSON object"
    if checks is CASE_CHECKS and "error" in record:
        return f"is a failed case ({record['error']})"
    bad = nonfinite(record) if not prefix else None  # once, from the top of a case or header
    if bad:
        return f"field {bad[0]} is {bad[1]!r}, not a finite number"
    lack = [prefix + c.path for c in checks if c.required and "." not in c.path and record.get(c.path) is None]
    if lack:
        return f"lacks {lack}"
    for c in checks:
        v = _at(record, c.path)
        if v is _MISSING and c.required:
            return f"lacks field {prefix}{c.path}"
        if not c.ok(None if v is _MISSING else v):
            return f"field {prefix}{c.path} is {_short(v)}, not {c.what}"
    if checks is CASE_CHECKS:
        return _counts_problem(record) or _failover_problem(record) or _levels_problem(record)
    if checks is LEVEL_CHECKS:
        return _level_counts_problem(record, prefix)
    return None


def _counts_problem(record: dict) -> Optional[str]:
    """Counts of one timed burst that contradict each other: ``requests_per_s`` against ``requests / wall_s``
    (beyond their rounding), the requests validated and each replica's requests against ``requests``. A burst
    that lost a replica (``timed.answered``, the replica-loss workload) counts its answered requests in
    ``requests_per_s`` and per replica, and ``answered + failed`` must be ``requests``."""
    t = record["timed"]
    n, wall, rate = t["requests"], t["wall_s"], t["requests_per_s"]
    served, what = (t["answered"], "answered") if "answered" in t else (n, "requests")
    if "answered" in t and not (_int(served) and _int(t.get("failed")) and served + t["failed"] == n):
        return (f"fields timed.answered {_short(served)} + timed.failed {_short(t.get('failed'))} are not "
                f"timed.requests {n}")
    if abs(served / wall - rate) > 0.01 * rate + 1e-3:
        return (f"field timed.requests_per_s is {_short(rate)}, but its {what} / wall_s is {served} / {wall} = "
                f"{served / wall:.4f}")
    checked = record["validation"]["requests_checked"]
    if checked != n:
        return f"field validation.requests_checked is {checked}, but timed.requests is {n}"
    per = t.get("per_replica")
    if per and sum(x["requests"] for x in per) != served:
        return (f"field timed.per_replica counts {sum(x['requests'] for x in per)} requests, but timed.{what} is "
                f"{served}")
    return timed_problem(t, "timed.")


#: Slack for a time that must not exceed ``wall_s``: both are rounded to 4 decimals (seconds).
TIME_SLACK_S = 2e-4
#: Token counts of a timed burst (``burst._metrics``) and of each replica's share (``latency.replica_load``).
TOKEN_COUNTS = ("output_tokens", "prompt_tokens", "cached_tokens")


def timed_problem(t: dict, prefix: str) -> Optional[str]:
    """Figures of one timed burst (``t``: a case's or a load level's ``timed``) that contradict each other (a
    hand-edited record): a negative token count (per replica too), ``output_tokens_per_s`` other than
    ``output_tokens / wall_s`` or ``cached_share`` other than ``cached_tokens / prompt_tokens`` beyond their rounding,
    more cached than prompt tokens, a completion or a replica's last answer after ``wall_s`` (which ends at the last
    answer). Fields a record lacks (older records) are not checked."""
    wall = t["wall_s"]
    per = t.get("per_replica") or []
    for where, rec in [("", t)] + [(f"per_replica.{i}.", x) for i, x in enumerate(per)]:
        for k in TOKEN_COUNTS + (("uncached_tokens", "requests") if where else ()):
            v = rec.get(k)
            if v is not None and not (_int(v) and v >= 0):
                return f"field {prefix}{where}{k} is {_short(v)}, not an integer >= 0"
    out, rate = t.get("output_tokens"), t["output_tokens_per_s"]
    if out is not None and abs(out / wall - rate) > 0.01 * rate + 0.01:
        return (f"field {prefix}output_tokens_per_s is {_short(rate)}, but its output_tokens / wall_s is {out} / "
                f"{wall} = {out / wall:.2f}")
    prompt, cached, share = t.get("prompt_tokens"), t.get("cached_tokens"), t.get("cached_share")
    if prompt is not None and cached is not None and cached > prompt:
        return f"field {prefix}cached_tokens is {cached}, more than its prompt_tokens {prompt}"
    if None not in (prompt, cached, share) and abs(cached / max(1, prompt) - share) > 1e-4 + 1e-9:
        return (f"field {prefix}cached_share is {_short(share)}, but its cached_tokens / prompt_tokens is {cached} / "
                f"{prompt} = {cached / max(1, prompt):.4f}")
    last = [("completion_s.p99", (t.get("completion_s") or {}).get("p99"))]
    last += [(f"per_replica.{i}.done_s", x.get("done_s")) for i, x in enumerate(per)]
    for name, v in last:
        if v is not None and v > wall + TIME_SLACK_S:
            return (f"field {prefix}{name} is {_short(v)}, after timed.wall_s {wall} (the burst ends at its last "
                    "answer)")
    return None


def _failover_problem(record: dict) -> Optional[str]:
    """A replica-loss case's ``failover`` (when present): its shape, and outcomes that add up to the trace and
    agree with ``timed.answered`` / ``timed.failed`` (every request answered, re-routed or failed, once)."""
    f = record.get("failover")
    if f is None:
        return None
    why = problem(f, FAILOVER_CHECKS, "failover.")
    if why:
        return why
    t = record["timed"]
    if f["answered"] + f["rerouted"] + f["failed"] != t["requests"] or f["requests"] != t["requests"]:
        return (f"field failover counts {f['answered']} answered + {f['rerouted']} rerouted + {f['failed']} failed "
                f"of {f['requests']} requests, but timed.requests is {t['requests']}")
    if "answered" in t and (f["answered"] + f["rerouted"], f["failed"]) != (t["answered"], t.get("failed")):
        return (f"field failover counts {f['answered'] + f['rerouted']} answered (re-routed included) and "
                f"{f['failed']} failed, but timed.answered is {t['answered']} and timed.failed {t.get('failed')}")
    return None


def _levels_problem(record: dict) -> Optional[str]:
    """An arrivals case's ``levels`` (when present): a non-empty list of levels in increasing order, each of
    ``LEVEL_CHECKS`` and with as many requests as the case's timed burst."""
    levels = record.get("levels")
    if levels is None:
        return None
    if not isinstance(levels, list) or not levels:
        return f"field levels is {_short(levels)}, not a non-empty list of load levels"
    for i, lv in enumerate(levels):
        why = problem(lv, LEVEL_CHECKS, f"levels.{i}.")
        if why:
            return why
    steps = [lv["level"] for lv in levels]
    if steps != sorted(set(steps)):
        return f"field levels has the levels {steps}, not distinct ones in increasing order"
    return None


def _level_counts_problem(level: dict, prefix: str) -> Optional[str]:
    """One level's counts: the requests validated are its requests."""
    checked, n = level["validation"]["requests_checked"], level["timed"]["requests"]
    if checked != n:
        return f"field {prefix}validation.requests_checked is {checked}, but {prefix}timed.requests is {n}"
    return timed_problem(level["timed"], f"{prefix}timed.")


#: Header fields that ``locality.json`` may hold more of than ``run_header.json``: the run appends its deviation
#: notes (and a note on a figure it could not draw) to the header's own (``runner.finish_record``).
GROWN_FIELDS = ("notes",)


def header_files_problem(record: dict, header: dict) -> Optional[str]:
    """Where a run's ``locality.json`` (``record``) contradicts its ``run_header.json`` (``header``), which
    ``runner.run_study`` writes from one header (a hand-edited file, or one copied from another run): the first field
    both carry (dotted, e.g. ``pair_settings.policies`` or ``systems.flame.options.batch_size``; a key only one of
    them holds inside such a field counts) whose values differ, as a phrase that follows "run RUN:"; for a field of
    :data:`GROWN_FIELDS`, the header's list that is not where the record's begins. None when they agree."""
    for key in sorted(set(record) & set(header)):
        a, b = record[key], header[key]
        if key in GROWN_FIELDS and isinstance(a, list) and isinstance(b, list):
            if a[:len(b)] != b:
                return (f"field {key} of locality.json does not begin with its run_header.json's "
                        f"{_short(b)}: the two files disagree")
            continue
        found = _difference(a, b, key)
        if found:
            where, x, y = found
            x, y = ("absent" if v is _MISSING else _short(v) for v in (x, y))
            return (f"field {where} is {x} in locality.json but {y} in run_header.json: the two files disagree (one "
                    "was edited, or copied from another run)")
    return None


def _difference(a, b, path: str) -> Optional[tuple[str, object, object]]:
    """``(path, a's value, b's value)`` of the first place where JSON values ``a`` and ``b`` differ (``_MISSING``:
    the key is absent there; lists of one length that hold objects or lists are compared item by item, ``path.i``,
    other lists as a whole); None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            found = _difference(a.get(k, _MISSING), b.get(k, _MISSING), f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(
            isinstance(x, (dict, list)) for x in a + b):
        return next((f for i, (x, y) in enumerate(zip(a, b)) if (f := _difference(x, y, f"{path}.{i}"))), None)
    if type(a) is not type(b) or a != b:
        return path, a, b
    return None


def _short(v, width: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= width else text[:width - 3] + "..."
