"""Console tables of ``python -m sut.locality``: the trace's shape (``describe``) and a run's results.

Every function returns plain text (lines joined by ``\\n``); the CLI prints it. The run report
shows what ``locality.json`` holds per case (one row per pair x system x policy): requests/s, output
tokens/s, the engine-reported cached share of input tokens, latencies, start-up time, requests per
replica and the router's counters; then the pair report (``sut.locality.study.report_lines``:
medians with min-max, flame / standalone per pair, prefix_affinity / round_robin per system), the
placement and any deviation from the study's set-up.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sut.locality import NOTICE
from sut.locality.trace import TraceSettings


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def describe_table(ts: TraceSettings, shape: dict, ws=None, preset: Optional[str] = None) -> str:
    """The trace's settings and shape (``trace.describe``) as labelled rows, then the workload's
    (``workloads.report.workload_rows``: ``ws``, a ``WorkloadSettings``); lengths in tokens."""
    from sut.locality.workloads import WorkloadSettings
    from sut.locality.workloads.report import workload_rows

    popularity = ("uniform (--zipf-s 0)" if ts.zipf_s == 0 else
                  f"Zipf s = {ts.zipf_s}: the hottest document gets {shape['hot_document_share']:.1%} of requests")
    news = ts.text == "news"
    text = (f"news: {ts.dataset}, " + (f"tokenized with {ts.tokenizer}" if ts.tokenizer else "its tok_input ids")
            if news else "random token ids")
    rows = [
        ("text", "", text),
        ("documents", _n(shape["documents"]), f"mean {ts.doc_tokens:,} tokens, uniform +-{ts.doc_jitter:.0%}"),
        ("questions per document", f"{ts.questions:,}", f"mean; popularity {popularity}"),
        ("question length", f"{shape['question_mean']:,.0f}" if news else f"{ts.question_tokens:,}",
         f"tokens, mean (longest {shape['question_max']}, bound {int(ts.question_tokens * 1.5)})" if news
         else "tokens, mean, uniform +-50%"),
        ("output tokens per request", f"{ts.max_tokens:,}",
         "--max-tokens (exactly: EOS is ignored, and validation checks the length)" if ts.answers == "fixed" else
         f"--max-tokens: the longest answer; each request asks its own ({ts.answers}, see answer tokens below; "
         "exactly that many: EOS is ignored, validation checks the length)"),
        ("requests", _n(shape["requests"]), f"arrival order {ts.order}, seed {ts.seed}"),
        ("prompt tokens, total", _n(shape["prompt_tokens"]), "BOS + document + question, all requests"),
        ("prompt tokens, mean", f"{shape['prompt_mean']:,.0f}", ""),
        ("longest prompt, this trace", _n(shape["prompt_max"]), "tokens"),
        ("longest prompt, any seed", _n(ts.max_prompt_tokens), "tokens: the bound these settings allow"),
        ("--max-model-len needed", _n(ts.max_prompt_tokens + ts.max_tokens),
         "longest prompt (any seed) + --max-tokens; the default of `run`"),
        ("distinct document tokens", _n(shape.get("document_tokens")),
         "what the replicas' prefix caches hold to serve every repeat from cache"),
        ("hottest document's share", f"{shape['hot_document_share']:.1%}", "of requests"),
        ("reusable prompt share", f"{shape['reusable_share_upper_bound']:.1%}",
         "upper bound on the prefix-cache hit rate (perfect cache, perfect routing)"),
    ]
    rows += workload_rows(ts, ws or WorkloadSettings(), shape)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = ["synthetic-locality trace (NOT an MLPerf benchmark; nothing started)"
             + (f": preset {preset}" if preset else "")]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def _router_cell(st: dict) -> str:
    """The prefix-affinity router's counters (``-`` for a counter the record lacks; ``-`` alone for another
    policy's record)."""
    if "affinity_hits" not in st:
        return "-"
    return ", ".join(f"{label} {st.get(k, '-')}" for label, k in (
        ("hits", "affinity_hits"), ("new", "new_prefixes"), ("released", "releases"), ("no key", "no_key"),
        ("evicted", "evictions")))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Columns sized to fit; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = []
    for r in [header, *rows]:
        cells = [f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _p(lat: Optional[dict], key: str) -> str:
    return _f(lat.get(key)) if lat else "-"


def _share(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def case_rows(cases: Sequence[dict]) -> list[str]:
    """One row per finished case: throughput, cached share, latencies (engine TTFT / e2e where the
    transport reports them; completion = client side, from the burst's release), start-up seconds,
    requests per replica and the router's counters."""
    rows = []
    for c in cases:
        t = c.get("timed")
        if not t:
            rows.append((str(c["pair"]), c["system"], c["policy"], "failed", *["-"] * 9))
            continue
        rows.append((str(c["pair"]), c["system"], c["policy"], f"{t['requests_per_s']:,.3f}",
                     f"{t['output_tokens_per_s']:,.1f}", _share(t.get("cached_share")), _p(t.get("ttft_s"), "p50"),
                     _p(t.get("ttft_s"), "p99"), _p(t.get("e2e_s"), "p50"), _p(t.get("completion_s"), "p50"),
                     _f(c.get("start_s"), 1), " ".join(str(p["requests"]) for p in t.get("per_replica") or []) or "-",
                     _router_cell(c.get("routing") or {})))
    return _table(("pair", "system", "policy", "req/s", "out tok/s", "cached", "TTFT p50 s", "TTFT p99 s",
                   "e2e p50 s", "done p50 s", "start s", "per replica", "router (prefix_affinity)"), rows, left=3)


def _kv_cache_line(kv: dict) -> str:
    """The report's line on the replicas' KV-cache capacity (``record["kv_cache"]``, ``runner.kv_cache_summary``);
    replicas that did not report it (``vllm serve`` replicas: ``--http``) are said to be unknown, not shown as -."""
    need = _n(kv.get("trace_document_tokens"))
    tokens = [p.get("tokens") for p in kv.get("per_replica") or []]
    if not any(t is not None for t in tokens):
        return (f"KV cache per replica: not read back from these replicas (vllm serve replicas do not report it); "
                f"the trace's distinct documents need {need} tokens")
    cells = ", ".join(_n(t) for t in tokens)
    return f"KV cache per replica (blocks x block size): {cells} tokens; the trace's distinct documents need {need}"


def study_tables(record: dict) -> str:
    """The console report of a locality run from its ``locality.json`` record (``runner.run_study``), with the
    sections of the workloads beyond the study (``workloads.report.workload_lines``)."""
    from sut.locality.study import report_lines
    from sut.locality.workloads.report import calibration_line, workload_lines

    lines = [NOTICE, *[f"note: {n}" for n in record.get("notes", [])]]
    if record.get("placement"):
        places = dict.fromkeys(f"replica {p['replica']} on {p['key']}" for p in record["placement"])  # a merged
        lines.append("placement (checked on every case against the replicas' own records): "  # report: once a run
                     + ", ".join(places))
    if record.get("kv_cache"):
        kv = record["kv_cache"]
        lines.append(_kv_cache_line(kv))
    lines += ["", *case_rows(record.get("cases", []))]
    lines += workload_lines(record)
    cal = calibration_line(record)
    if cal:
        lines.append(cal)
    if record.get("report"):
        lines += ["", *report_lines(record["report"])]
    lines += ["", "cached = prompt tokens the engines served from their prefix caches / all prompt tokens; TTFT and "
              "e2e are engine-side; done = completion time from the burst's release (client side)"]
    if record.get("error"):
        lines.append(f"RUN FAILED: {record['error']}")
    lines.append(f"every field: {record.get('record_path')}" + (f"; figure: {record['figure']}" if record.get("figure")
                                                                 else ""))
    return "\n".join(lines)
