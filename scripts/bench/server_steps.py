"""Server's engine steps next to Offline's, on one started engine, in one process: where does Server lose?

On one H100 with the fp8 preset (docs/benchmarks.md "H100"), Server at 52 queries/s kept all 512 slots busy and
completed 50.57 queries/s, 93.6 % of Offline's 54.01 samples/s. This command drives the preset's engine
(``perf_levers.BASE``; ``PERF_BASE_OVERRIDE`` JSON on top, e.g. ``{"max_num_seqs": 640}``) through both arrival
patterns, one after the other, and logs every engine step (``LLMEngine.step``):

* ``offline``: every prompt queued at once (LoadGen Offline's one query; the prompts cycled to
  ``--offline-samples`` so that the queue outlasts the run);
* ``server``: Poisson arrivals at ``--rate`` queries/s (LoadGen Server's arrival process; ``--seed``).

Both phases run ``--duration-s`` seconds with ``--max-tokens`` new tokens a request (EOS ignored, as the
harness's ``--benchmark-ignore-eos``); what is left at the end is aborted. Per step: wall ms, tokens generated,
first tokens (prefills completed) and their prompt tokens, requests finished, requests decoding and waiting after
it. Over the steady window (from ``--warm-s`` to the end, Offline also only while its queue is non-empty) each
phase gets: steps, ms per step (median, mean), tokens per step, prefills and prefill tokens per step, decoding
and waiting (mean, last), output tokens/s (over the steps' time) and the steps' share of the window's wall
time (below 1 when the engine idled waiting for arrivals). Then ``server / offline`` for tokens/s, which is tokens
per step over ms per step: which of the two moved says whether Server's steps are fuller-but-slower or emptier.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set, as ``perf_profile.py``), so
a logged step is one schedule + forward + outputs; the harness's engines run the core in a process of its own, so
absolute tokens/s may differ a little from a LoadGen run's: compare the phases, not the runs.

``--profile-steps K`` (CUDA) also profiles K steps of each phase with ``torch.profiler`` right after its measured
window (``perf_profile.summarize_trace``: kernel categories, GPU busy, CPU gap per step; the profiled steps are
not in the window's statistics).

Writes OUT/server_steps.json (settings, card, vLLM, per-phase window stats and per-step logs, ratios),
OUT/server_steps.png (tokens per step, ms per step and waiting requests over time, both phases) and prints the
table. Usage: python scripts/bench/server_steps.py --model M --dataset cnn_eval.json --out D [--rate 56]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_levers import base_kwargs, load_prompts  # noqa: E402


def arrivals(n_prompts: int, rate: float, duration_s: float, seed: int) -> list[tuple[float, int]]:
    """``(arrival s, prompt index)`` of a Poisson process at ``rate``/s over ``duration_s``; ``rate`` 0: every
    index of ``range(n_prompts)`` at 0 (Offline). Prompts are taken in order, cycling."""
    if rate <= 0:
        return [(0.0, i) for i in range(n_prompts)]
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            return out
        out.append((t, len(out)))


class StepLog:
    """What one phase's steps did; ``steps`` holds one dict per ``LLMEngine.step`` (module docstring)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.length: dict[str, int] = {}  # request id -> tokens so far, while it decodes
        self.open: set[str] = set()  # added, not finished
        self.waiting = 0

    def submit(self, rid: str) -> None:
        """A request added to the engine: waiting until its first token."""
        self.open.add(rid)
        self.waiting += 1

    def record(self, t_s: float, ms: float, outs) -> None:
        """One step that started ``t_s`` s into the phase and took ``ms`` ms, from its DELTA ``RequestOutput``s."""
        tokens = first = first_prompt = finished = 0
        for o in outs:  # RequestOutputKind.DELTA: the tokens this step added
            n = len(o.outputs[0].token_ids)
            before = self.length.get(o.request_id, 0)
            tokens += n
            if before == 0 and n > 0:
                first += 1
                first_prompt += len(o.prompt_token_ids or ())
                self.waiting -= 1
            self.length[o.request_id] = before + n
            if o.finished:
                finished += 1
                self.length.pop(o.request_id)
                self.open.discard(o.request_id)
        self.steps.append({"t_s": round(t_s, 4), "ms": round(ms, 3), "tokens": tokens, "prefills": first,
                           "prefill_tokens": first_prompt, "finished": finished,
                           "decoding": len(self.length), "waiting": self.waiting})


def drive(engine, prompts: Sequence[Sequence[int]], plan: Sequence[tuple[float, int]], params, duration_s: float,
          on_step: Optional[Callable[[float], None]] = None, clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep, keep_going: Callable[[], bool] = lambda: False,
          id_prefix: str = "r") -> StepLog:
    """Add each request of ``plan`` at its arrival time and step ``engine`` until ``duration_s`` (past it while
    ``keep_going()``, at most ``TAIL_S`` more: the profiler's steps, after the measured window) or until every
    request finished; abort the rest. ``on_step(t)`` runs before each step (the profiler's hook); an idle engine
    waits for the next arrival in ``sleep`` naps of at most 1 ms. Request ids are ``id_prefix`` + the plan index."""
    log = StepLog()
    t0, nxt = clock(), 0
    while True:
        now = clock() - t0
        while nxt < len(plan) and plan[nxt][0] <= now:
            rid = f"{id_prefix}{nxt}"  # a phase's own ids: an aborted request's late output is never another's
            engine.add_request(rid, {"prompt_token_ids": list(prompts[plan[nxt][1] % len(prompts)])}, params)
            log.submit(rid)
            nxt += 1
        if (now >= duration_s and not (keep_going() and now < duration_s + TAIL_S)) or (
                nxt == len(plan) and not engine.has_unfinished_requests()):
            break
        if not engine.has_unfinished_requests():
            sleep(min(0.001, max(0.0, plan[nxt][0] - now)))
            continue
        if on_step:
            on_step(now)
        s = clock()
        outs = engine.step()
        log.record(s - t0, 1000 * (clock() - s), outs)
    if log.open:
        engine.abort_request(sorted(log.open))
    return log


def window(steps: Sequence[dict], warm_s: float, offline: bool, end_s: float = float("inf")) -> dict:
    """Statistics of the steps started in [``warm_s``, ``end_s``) s (module docstring); ``offline``: the window also
    ends when the queue empties. ``output_tokens_per_s`` is over the steps' own time; ``busy_share`` is that time
    over the window's wall time (below 1: the engine idled between arrivals or the loop's adds took time)."""
    end = len(steps)
    if offline:
        end = next((i for i, s in enumerate(steps) if s["t_s"] >= warm_s and s["waiting"] <= 0), len(steps))
    w = [s for s in steps[:end] if warm_s <= s["t_s"] < end_s]
    if not w:
        return {"steps": 0}
    wall = sum(s["ms"] for s in w) / 1000
    to_s = round(w[-1]["t_s"] + w[-1]["ms"] / 1000, 4)
    mean = lambda k: round(sum(s[k] for s in w) / len(w), 3)  # noqa: E731
    return {"steps": len(w), "from_s": w[0]["t_s"], "to_s": to_s,
            "busy_share": round(wall / (to_s - w[0]["t_s"]), 4) if to_s > w[0]["t_s"] else None,
            "ms_per_step_median": round(statistics.median(s["ms"] for s in w), 3),
            "ms_per_step_mean": round(1000 * wall / len(w), 3), "tokens_per_step": mean("tokens"),
            "prefills_per_step": mean("prefills"), "prefill_tokens_per_step": mean("prefill_tokens"),
            "decoding_mean": mean("decoding"), "waiting_mean": mean("waiting"), "waiting_last": w[-1]["waiting"],
            "finished": sum(s["finished"] for s in w),
            "output_tokens_per_s": round(sum(s["tokens"] for s in w) / wall, 2) if wall else None}


def ratios(server: dict, offline: dict) -> dict:
    """``server / offline`` of tokens/s, tokens per step, ms per step (mean) and prefill tokens per step."""
    out = {}
    for k in ("output_tokens_per_s", "tokens_per_step", "ms_per_step_mean", "prefill_tokens_per_step"):
        a, b = server.get(k), offline.get(k)
        out[k] = round(a / b, 4) if a is not None and b else None
    return out


def table(res: dict) -> list[str]:
    """The console table: one row per statistic, a column per phase, then the ratios."""
    ph = res["phases"]
    keys = ("steps", "ms_per_step_median", "ms_per_step_mean", "tokens_per_step", "prefills_per_step",
            "prefill_tokens_per_step", "decoding_mean", "waiting_mean", "waiting_last", "output_tokens_per_s",
            "busy_share")
    lines = [f"{'steady window':<26}{'offline':>14}{'server':>14}"]
    for k in keys:
        lines.append(f"{k:<26}" + "".join(f"{str(ph[p]['window'].get(k, '-')):>14}" for p in ("offline", "server")))
    r = res["ratios"]
    lines.append("server / offline: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items() if v is not None))
    return lines


#: Seconds a phase may run past --duration-s for the profiled steps (they come after the measured window: the
#: profiler slows the steps it records, and Server's queue then needs a while to settle).
TAIL_S = 60.0


class Profiler:
    """``--profile-steps``: ``torch.profiler`` over ``steps`` engine steps from the first step at ``start_s`` (the
    phase's end: ``drive``'s ``on_step`` and ``keep_going``); ``summary()`` is ``perf_profile.summarize_trace`` of
    them. A profiler that fails is stopped and its error kept: the phase keeps its step log."""

    def __init__(self, steps: int, start_s: float):
        self.left, self.start_s, self.prof, self.done, self.t0, self.error = steps, start_s, None, False, 0.0, None
        self.count, self.wall = 0, 0.0  # steps profiled so far; their wall s

    def __call__(self, now: float) -> None:
        if self.done or self.left <= 0 or now < self.start_s:
            return
        try:
            self._tick()
        except Exception as e:  # noqa: BLE001 - a profiler that fails must not cost the phase its step log
            self.done, self.error = True, f"{type(e).__name__}: {e}"
            self._stop()

    def active(self) -> bool:
        """Steps still to profile (``drive``'s ``keep_going``)."""
        return self.left > 0 and not self.done

    def _stop(self) -> None:
        if self.prof is not None:
            try:
                self.prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - already failing; the error above is the one kept
                pass

    def _tick(self) -> None:
        import torch

        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof, self.t0 = torch.profiler.profile(activities=acts), time.perf_counter()
            self.prof.__enter__()
        self.count += 1
        if self.count > self.left:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.t0
            self.done = True
            self.prof.__exit__(None, None, None)

    def summary(self, tokens: int) -> Optional[dict]:
        """The profiled steps' summary; ``{"error": ...}`` when profiling failed; None when it never started."""
        if self.error or not self.done:
            return {"error": self.error} if self.error else None
        from perf_profile import summarize_trace

        try:
            with tempfile.TemporaryDirectory() as td:
                trace = Path(td) / "trace.json"
                self.prof.export_chrome_trace(str(trace))
                res = summarize_trace(trace, self.left, self.wall, tokens)
        except Exception as e:  # noqa: BLE001 - as in __call__
            return {"error": f"{type(e).__name__}: {e}"}
        res.pop("top_kernels", None)
        return res


def run_phase(engine, name: str, prompts, a, params) -> dict:
    """One phase (``offline`` or ``server``): its plan, steps, steady window and optional profile."""
    offline = name == "offline"
    plan = arrivals(a.offline_samples if offline else len(prompts), 0.0 if offline else a.rate, a.duration_s, a.seed)
    prof = Profiler(a.profile_steps, a.duration_s) if a.profile_steps > 0 else None
    if prof and not offline:  # arrivals go on while the profiled steps run
        plan = arrivals(len(prompts), a.rate, a.duration_s + TAIL_S, a.seed)
    log = drive(engine, prompts, plan, params, a.duration_s, on_step=prof,
                keep_going=prof.active if prof else (lambda: False), id_prefix=f"{name}-")
    w = window(log.steps, a.warm_s, offline, a.duration_s)
    out = {"requests_planned": len(plan), "window": w, "steps": log.steps}
    if prof:
        out["profile"] = prof.summary(sum(s["tokens"] for s in log.steps))
    return out


def per_second(steps: Sequence[dict], key: str, last: bool = False) -> tuple[list[float], list[float]]:
    """``(x s, y)`` of ``key`` over each whole second of a phase that has steps: ``x`` the second's middle, ``y``
    the mean over its steps (``last``: its last step's value). Thousands of steps a phase drawn one by one are a
    solid band; a value a second shows the trend."""
    bins: dict[int, list] = {}
    for s in steps:
        bins.setdefault(int(s["t_s"]), []).append(s[key])
    x = [b + 0.5 for b in sorted(bins)]
    return x, [bins[b][-1] if last else sum(bins[b]) / len(bins[b]) for b in sorted(bins)]


def figure(res: dict, path: Path) -> None:
    """Tokens per step, ms per step (means a second) and waiting requests (each second's last) over time, both
    phases, with the steady-window means of the first two dashed (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    panels = (("tokens", "tokens_per_step", "tokens generated per step (mean a second)"),
              ("ms", "ms_per_step_mean", "ms per step (mean a second)"),
              ("waiting", None, "requests waiting (no first token; each second's last)"))
    for i, (name, ph) in enumerate(res["phases"].items()):
        for ax, (k, wk, _) in zip(axes, panels):
            ax.plot(*per_second(ph["steps"], k, last=k == "waiting"), color=f"C{i}", linewidth=1, label=name)
            if wk and ph["window"].get(wk) is not None:
                ax.axhline(ph["window"][wk], color=f"C{i}", linestyle="--", linewidth=0.8)
    axes[2].set_yscale("symlog")  # Offline's queue is thousands, Server's a few
    axes[2].set_ylim(bottom=0)
    for ax, (_, _, label) in zip(axes, panels):
        ax.axvline(res["settings"]["warm_s"], color="grey", linestyle=":")
        ax.set(xlabel="s from the phase's start", title=label)
        ax.legend(fontsize=8)
    fig.suptitle(f"engine steps, Offline vs Server at {res['settings']['rate']} queries/s ({res.get('card')}); "
                 "dotted: the steady window's start, dashed: its mean")
    fig.savefig(path, dpi=110)


def card() -> str:
    """The GPU's name, ``cpu`` without CUDA, ``unknown`` when torch cannot tell."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a name for the record only
        return "unknown"


def parse(argv=None) -> argparse.Namespace:
    """The command line (module docstring); exit 2 on settings that cannot run (an infinite or NaN rate would
    never end the Poisson plan)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True, help="cnn_eval-format JSON with tok_input ids")
    ap.add_argument("--samples", type=int, default=1020, help="prompts read (cycled by both phases)")
    ap.add_argument("--offline-samples", type=int, default=8192, help="requests Offline queues at once")
    ap.add_argument("--rate", type=float, default=52.0, help="Server's Poisson arrivals, queries/s")
    ap.add_argument("--duration-s", type=float, default=90.0, help="seconds a phase runs")
    ap.add_argument("--warm-s", type=float, default=30.0, help="s into a phase where the steady window starts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", nargs="+", default=["offline", "server"], choices=["offline", "server"])
    ap.add_argument("--profile-steps", type=int, default=0, help="steady steps profiled per phase (CUDA)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for k in ("samples", "offline_samples", "max_tokens"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if not (0 < a.rate < math.inf and 0 < a.duration_s < math.inf and 0 <= a.warm_s < a.duration_s):
        ap.error("need finite --rate > 0 and --duration-s > 0, and 0 <= --warm-s < --duration-s")
    if a.profile_steps < 0 or len(set(a.phases)) < len(a.phases):
        ap.error("need --profile-steps >= 0 and each of --phases once")
    return a


def main(argv=None) -> int:
    """Start the engine, warm it up (64 prompts), run the phases; 2 when the dataset has no prompts."""
    a = parse(argv)
    prompts = load_prompts(a.dataset, a.samples)
    if not prompts:
        print(f"{a.dataset}: no prompts", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from vllm import LLM, SamplingParams, __version__

    kwargs = base_kwargs(a.model)
    llm = LLM(**kwargs)
    from vllm.sampling_params import RequestOutputKind

    fixed = dict(temperature=0.0, max_tokens=a.max_tokens, min_tokens=a.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:64]], SamplingParams(**fixed), use_tqdm=False)  # warm-up
    params = SamplingParams(**fixed, output_kind=RequestOutputKind.DELTA)  # every step's new tokens (StepLog)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "card": card(), "vllm": __version__,
           "engine": {k: v for k, v in kwargs.items() if k != "model"}, "settings": vars(a), "phases": {}}
    run_phases(llm.llm_engine, prompts, a, params, res, out)
    return 0


def run_phases(engine, prompts, a, params, res: dict, out: Path) -> None:
    """Each of ``a.phases`` on ``engine``, OUT/server_steps.json rewritten after each (a later phase that fails,
    e.g. out of memory, leaves the earlier ones' record), then the ratios, the table and the figure; a figure that
    cannot be drawn leaves a warning, not a failed run."""
    path = out / "server_steps.json"
    for name in a.phases:
        res["phases"][name] = run_phase(engine, name, prompts, a, params)
        path.write_text(json.dumps(res, indent=1))
    if {"offline", "server"} <= set(res["phases"]):
        res["ratios"] = ratios(res["phases"]["server"]["window"], res["phases"]["offline"]["window"])
        print("\n".join(table(res)))
        path.write_text(json.dumps(res, indent=1))
    try:
        figure(res, out / "server_steps.png")
    except Exception as e:  # noqa: BLE001 - the steps measured fine; the record is written
        print(f"warning: no figure ({type(e).__name__}: {e})", file=sys.stderr)
    print(f"wrote {path}, {out / 'server_steps.png'}")

if __name__ == "__main__":
    sys.exit(main())
