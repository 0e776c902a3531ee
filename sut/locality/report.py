"""Console tables of ``python -m sut.locality``: the trace's shape (``describe``) and a run's results.

Every function returns plain text (lines joined by ``\\n``); the CLI prints it. The run tables show
what ``locality.json`` holds per policy run (one row per policy and round): throughput and latency,
engine-reported prefix-cache hit rate overall and per replica, request and prompt-token skew
(max / mean over replicas), how many replicas served the hottest document, the router's counters,
and each replica's KV-cache capacity as vLLM reports it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sut.locality import NOTICE
from sut.locality.trace import TraceSettings


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def describe_table(ts: TraceSettings, shape: dict) -> str:
    """The trace's settings and shape (``trace.describe``) as labelled rows; lengths in tokens."""
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
        ("output tokens per request", f"{ts.max_tokens:,}", "--max-tokens (at most; exactly with --ignore-eos)"),
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
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = ["synthetic-locality trace (NOT an MLPerf benchmark; nothing started)"]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def kv_cache_lines(engines: Sequence[dict], document_tokens: Optional[int]) -> list[str]:
    """One line per replica with its KV-cache capacity (tokens, blocks x block size) as vLLM reports
    it, and how it compares with the trace's distinct document tokens."""
    lines = []
    total = 0
    for e in engines:
        kv = e.get("kv_cache") or {}
        total += kv.get("tokens") or 0
        lines.append(f"  replica {e.get('engine')}: {_n(kv.get('tokens'))} tokens "
                     f"({_n(kv.get('blocks'))} blocks x {_n(kv.get('block_size'))}) on "
                     f"{(e.get('device') or {}).get('kind', '?')}:{(e.get('device') or {}).get('slot', '?')}")
    head = f"KV cache per replica as vLLM reports it ({_n(total)} tokens in all)"
    if document_tokens and total:
        share = document_tokens / total
        head += (f"; the trace's distinct documents need {document_tokens:,} tokens "
                 + (f"({share:.1%} of it)" if share <= 1 else f"({share:.1f}x it: repeats find evicted blocks)"))
    return [head + ":"] + lines


def _router_cell(st: dict) -> str:
    if "affinity_hits" not in st:
        return "-"
    return (f"hits {st['affinity_hits']}, new {st['new_prefixes']}, released {st['releases']}, "
            f"no key {st['no_key']}, evicted {st['evictions']}")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Columns sized to fit; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = []
    for r in [header, *rows]:
        cells = [f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def run_tables(records: Sequence[dict], summary: dict, engines: Sequence[dict], shape: dict, record_path) -> str:
    """The console report of a finished run (``records`` from ``runner.replay``, ``summary`` from
    ``runner.summarize``, ``engines`` the pool's read-back infos, ``shape`` the trace's ``describe``)."""
    lines = [NOTICE, *kv_cache_lines(engines, shape.get("document_tokens")), ""]
    lines += _table(
        ("policy", "round", "out tok/s", "hit rate", "TTFT p50 s", "TTFT p99 s", "e2e p50 s"),
        [(r["policy"], str(r.get("round", 0)), f"{r['output_tokens_per_s']:,.1f}", _f(r["cache_hit_rate"]),
          _f(r["ttft_s"]["p50"]), _f(r["ttft_s"]["p99"]), _f(r["e2e_s"]["p50"])) for r in records])
    lines.append("")
    lines += _table(
        ("policy", "round", "hit rate per replica", "requests per replica", "req skew", "token skew",
         "hot doc on", "router (prefix_affinity)"),
        [(r["policy"], str(r.get("round", 0)), " ".join(_f(p["cache_hit_rate"], 2) for p in r["per_replica"]),
          " ".join(str(p["requests"]) for p in r["per_replica"]), _f(r["request_skew"], 2),
          _f(r["prompt_token_skew"], 2), str(r["hot_document_replicas"]), _router_cell(r["router"]))
         for r in records], left=1)
    lines.append("")
    base = next((k[len("throughput_ratio_to_"):] for s in summary.values() for k in s
                 if k.startswith("throughput_ratio_to_")), "?")
    lines += _table(
        ("policy", "runs", "out tok/s", f"vs {base}", "hit rate", "TTFT p50 s"),
        [(name, str(s["runs"]), f"{s['output_tokens_per_s']:,.1f}", _f(s["throughput_ratio_to_" + base]),
          _f(s["cache_hit_rate"]), _f(s["ttft_p50_s"])) for name, s in summary.items()])
    lines += ["", "skew = max / mean over replicas; hot doc on = replicas that served the hottest document; "
              "hit rates are engine-reported (cached prompt tokens / prompt tokens)",
              f"every field, per replica and per run: {record_path}"]
    return "\n".join(lines)
