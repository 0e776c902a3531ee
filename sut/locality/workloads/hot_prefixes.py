"""``hot-prefixes``: Zipf popularity of documents, many questions on the hot ones: does affinity overload the
replicas that own the hot documents, and what does the router's release do?

Algorithm
---------
1. **Popularity.** ``documents x questions`` questions are spread over the documents with weights
   ``1 / rank^s`` (``--zipf-s``, default 1.1: Preble's ablation, ``../shared/research/routing_anchors_2026-12.md``
   section 1), at least one each (``trace.questions_per_document``). With 32 documents x 4 the hottest gets
   ~23 % of the requests, the five hottest ~52 %; ``describe`` prints the shares.
2. **Policies.** ``round_robin`` (cache-blind), ``prefix_affinity`` with the release gate ``excess`` (an
   owner more than ``--release-tokens`` of estimated uncached prefill busier than the least busy replica
   sends the request elsewhere: a *release*) and ``prefix_affinity_never`` (the study's router: the owner
   keeps every request of its documents).
3. **Metrics.** Per replica: requests, prompt, cached and uncached tokens, output tokens and when its last
   request finished (``done_s``); ``balance`` = max / min across replicas of requests, uncached tokens and
   ``done_s`` (1.0 = even; SGLang's gateway treats > 1.5 as imbalanced); the router's hits, new prefixes
   and releases; the cached share (engine counts) next to the router's expected one; TTFT p50 / p99.

Knobs: ``--zipf-s`` (1.1), ``--release-gate`` (excess), ``--release-tokens`` (65,536), ``--policies``;
the trace's.

Shape on a GPU (preset): 32 news documents of ~8K tokens x 4 questions on average = 128 requests of 32 new
tokens, one shuffled burst; about 2 minutes a case on one H100/H200 with two engines, three policies.
"""

from __future__ import annotations

NAME = "hot-prefixes"
_TRACE = {"doc_tokens": 8192, "documents": 32, "questions": 4, "max_tokens": 32, "zipf_s": 1.1, "order": "shuffled",
          "text": "news"}
PRESET = {"trace": _TRACE, "run": {"rate": 0.0, "policies": ("prefix_affinity", "prefix_affinity_never",
                                                              "round_robin")},
          "routing": {"release_gate": "excess"}, "workload": {}}


def popularity(trace, top: int = 5) -> dict:
    """The ``top`` hottest documents' shares of the requests, and the share of the ``top`` together."""
    count: dict[int, int] = {}
    for r in trace:
        count[r.document] = count.get(r.document, 0) + 1
    hot = sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    n = max(1, len(trace))
    return {"hottest": [{"document": d, "requests": c, "share": round(c / n, 4)} for d, c in hot],
            f"top{top}_share": round(sum(c for _, c in hot) / n, 4)}


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def report_lines(record: dict) -> list[str]:
    """Zipf s and the hottest documents; per case each replica's load, the balance and the releases."""
    ts = record.get("trace_settings") or {}
    pop = (record.get("trace") or {}).get("popularity") or {}
    hot = ", ".join(f"{x['share']:.1%}" for x in pop.get("hottest", []))
    lines = [f"hot prefixes: Zipf s = {ts.get('zipf_s')}; the hottest documents' shares of requests: {hot}",
             f"{'pair':>4}  {'system':<11} {'policy':<22} {'requests per replica':>21} "
             f"{'uncached tokens per replica':>28}"
             f" {'done s per replica':>19} {'max/min req':>11} {'max/min uncached':>16} {'released':>8}"]
    for c in record.get("cases", []):
        t = c.get("timed")
        if not t:
            continue
        per, bal = t.get("per_replica") or [], t.get("balance") or {}
        lines.append(f"{c['pair']:>4}  {c['system']:<11} {c['policy']:<22} "
                     f"{' '.join(str(p['requests']) for p in per):>21} "
                     f"{' '.join(str(p.get('uncached_tokens', '-')) for p in per):>28} "
                     f"{' '.join(str(p.get('done_s', '-')) for p in per):>19} "
                     f"{_ratio(bal.get('requests_max_over_min')):>11} {_ratio(bal.get('uncached_max_over_min')):>16} "
                     f"{(c.get('routing') or {}).get('releases', '-'):>8}")
    return lines
