"""``variable-answers``: answer lengths drawn from a stated distribution between 16 and 512 tokens.

Algorithm
---------
1. **Lengths.** Request ``i`` asks ``round(exp(U(ln 16, ln 512)))`` new tokens (``--answers log_uniform``,
   ``--min-answer-tokens 16``, ``--max-tokens 512``): log-uniform, so every doubling of the length (16-32,
   32-64, ..., 256-512) draws the same share of requests, median ~91 tokens, mean ~143. The lengths come
   from a generator of their own (``trace.answer_lengths``: ``seed``, stream 1): the prompts are those of
   the fixed-length trace of the same settings, and the lengths are part of the trace hash.
2. **Generation.** Every request carries its length (``Request.max_tokens``) with ``ignore_eos``, so it
   generates exactly that many tokens on both systems (the local transport's engine worker and the Flame
   service's engine take it per request; a transport that cannot, ``vllm serve`` over HTTP here, is
   refused before anything starts). The engines' context is sized for 512; the router books the bound
   (512) as each request's decode work, as a router that cannot know the answer length would.
3. **Validation** checks each request's own length; **metrics** add TPOT p50 / p99 (time per output token
   after the first, engine side) and client-side TTFT next to throughput in requests/s and output tokens/s.

Knobs: ``--answers`` (log_uniform), ``--min-answer-tokens`` (16), ``--max-tokens`` (512); the trace's.

Shape on a GPU (preset): 32 news documents of ~8K tokens x 4 questions = 128 requests, one shuffled burst,
~18,000 new tokens in all; about 2 minutes a case on one H100/H200 with two engines.
"""

from __future__ import annotations

NAME = "variable-answers"
_TRACE = {"doc_tokens": 8192, "documents": 32, "questions": 4, "max_tokens": 512, "answers": "log_uniform",
          "min_answer_tokens": 16, "zipf_s": 0.0, "order": "shuffled", "text": "news"}
PRESET = {"trace": _TRACE, "run": {"rate": 0.0, "policies": ("prefix_affinity", "round_robin")},
          "routing": {"release_gate": "never"}, "workload": {}}


def _cell(lat, key: str) -> str:
    return "-" if not lat or lat.get(key) is None else f"{lat[key]:.4f}"


def report_lines(record: dict) -> list[str]:
    """The answer-length distribution and, per case, output tokens/s, TPOT / TTFT p50 / p99 and the request latency
    (arrival to answer, client side: ``timed.latency_s``) p50 / p99."""
    a = (record.get("trace") or {}).get("answer_tokens") or {}
    lines = [f"variable answers: {a.get('total')} new tokens in all, per request min {a.get('min')}, median "
             f"{a.get('p50')}, mean {a.get('mean')}, p99 {a.get('p99')}, max {a.get('max')}",
             f"{'pair':>4}  {'system':<11} {'policy':<22} {'out tok/s':>10} {'TPOT p50':>9} {'TPOT p99':>9} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'req p50':>9} {'req p99':>9}"]
    for c in record.get("cases", []):
        t = c.get("timed")
        if not t:
            continue
        ttft = t.get("client_ttft_s") or t.get("ttft_s")
        lines.append(f"{c['pair']:>4}  {c['system']:<11} {c['policy']:<22} {t['output_tokens_per_s']:>10.1f} "
                     f"{_cell(t.get('tpot_s'), 'p50'):>9} {_cell(t.get('tpot_s'), 'p99'):>9} {_cell(ttft, 'p50'):>9} "
                     f"{_cell(ttft, 'p99'):>9} {_cell(t.get('latency_s'), 'p50'):>9} "
                     f"{_cell(t.get('latency_s'), 'p99'):>9}")
    return lines
