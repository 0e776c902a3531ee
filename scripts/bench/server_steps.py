"""Server's engine steps next to Offline's, on one started engine, in one process: where does Server lose?

On one H100 with the fp8 preset (docs/benchmarks.md "H100"), Server at 52 queries/s kept all 512 slots busy and
completed 50.57 queries/s, 93.6 % of Offline's 54.01 samples/s. This command drives the preset's engine
(``perf_levers.BASE``; ``PERF_BASE_OVERRIDE`` JSON on top, e.g. ``{"max_num_seqs": 640}``) through both arrival
patterns, one after the other, and logs every engine step (``LLMEngine.step``):

* ``offline``: every prompt queued at once (LoadGen Offline's one query; the prompts cycled to
  ``--offline-samples`` so that the queue outlasts the run);
* ``server``: Poisson arrivals at ``--rate`` queries/s (LoadGen Server's arrival process; ``--seed``), added
  before every engine step;
* ``server-admitK``: the same arrivals, added only every K engine steps while the engine is busy (an idle engine
  adds them at once) and only into free slots (``max_num_seqs`` less the engine's unfinished requests; the rest
  wait in the loop, so vLLM's own queue never refills a slot between admissions: the harness's engine worker
  does the same with ``--admit-every-steps``), one phase per K > 1 of ``--admit-every-steps K [K ...]`` (default
  ``1``: ``server`` only; the Server phases run one after another, in that order, ``admit_every_steps`` K in each
  phase's record).

What it found (one H100, fp8 Llama-3.1-8B, 512 slots, 52 queries/s): tokens per step were equal in both phases
(~507) but Server's steps 3.9 % slower on average. Offline alternates decode-only steps (~23 ms) with
prefill-heavy ones (~7,000 prefill tokens, ~128 ms); Server puts ~4 prefills (~3,400 tokens) into nearly every
step (~79 ms); both fit ms ~ 31 + 0.0139 x prefill tokens for a step with prefills vs ~23 ms decode-only, so a
step with prefills pays ~8 ms fixed, and Server pays it on almost every step. The lever ``--admit-every-steps``
measures: admitting every K steps puts Server's prefills into fewer, larger steps with decode-only steps between.

Every phase runs ``--duration-s`` seconds with ``--max-tokens`` new tokens a request (EOS ignored, as the
harness's ``--benchmark-ignore-eos``); what is left at the end is aborted. Per step: wall ms, tokens generated,
first tokens (prefills completed) and their prompt tokens, requests finished, requests decoding and waiting after
it (arrived, no first token yet: in the engine or held by ``server-admitK``'s loop, ``held``). Over the steady
window (from ``--warm-s`` to the end, Offline also only while its queue is non-empty) each phase gets: steps,
ms per step (median, mean), tokens per step, prefills and prefill tokens per step, decoding and waiting (mean,
last), output tokens/s (over the steps' time) and the steps' share of the window's wall time (below 1 when the
engine idled waiting for arrivals); a Server phase also gets the TTFT (from arrival) and TPOT ((last token -
first token) / (tokens - 1), as LoadGen's) p50 / p99 in ms of the requests that arrived in the window before the
earliest one left unfinished (``requests_timed``, ``timed_to_s``): a first look at a lever against Server's
(2,000 / 100 ms) or Interactive's (500 / 30 ms) limits, e.g. Interactive's rate with
``PERF_BASE_OVERRIDE='{"max_num_batched_tokens": 1536}'``; a 600 s LoadGen run decides. Then, for each Server
phase, ``NAME / offline`` for tokens/s, which is tokens per step over ms per step: which of the two moved says
whether Server's steps are fuller-but-slower or emptier.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set, as ``perf_profile.py``), so
a logged step is one schedule + forward + outputs; the harness's engines run the core in a process of its own, so
absolute tokens/s may differ a little from a LoadGen run's: compare the phases, not the runs.

``--profile-steps K`` (CUDA) also profiles K steps of each phase with ``torch.profiler`` right after its measured
window (``perf_profile.summarize_trace``: kernel categories, GPU busy, CPU gap per step; the profiled steps are
not in the window's statistics).

Writes OUT/server_steps.json (settings, card, vLLM, per-phase window stats and per-step logs, ``ratios``: each
Server phase's name -> its ratios against Offline), OUT/server_steps.png (tokens per step, ms per step and
waiting requests over time, a line per phase) and prints the table (a column per phase). Usage: python
scripts/bench/server_steps.py --model M --dataset cnn_eval.json --out D [--rate 56] [--admit-every-steps 1 2 3]

Checked before the engine starts, each a message and exit 2 with no folder left behind: the settings (``--seed``
>= 0; a phase plans at most ``MAX_ARRIVALS`` = 10,000,000 requests: ``--offline-samples``, and ``--rate`` x
``--duration-s``, plus ``TAIL_S`` with ``--profile-steps``, for Server; ``--admit-every-steps`` each >= 1 and
once), env ``PERF_BASE_OVERRIDE`` (a JSON object that does not set ``model``), ``--dataset`` (a JSON array of
rows with a non-empty integer ``tok_input``) and
``--out`` (a writable folder where server_steps.json and server_steps.png are not folders). A record that cannot
be written later fails the run (exit 1); a figure that cannot be drawn is a warning and a note in the JSON
(``notes``), as is a phase with no steady window (e.g. Offline's queue emptied before ``--warm-s``; each Server
phase's own note, named by the phase).
"""

from __future__ import annotations

import argparse
import bisect
import io
import json
import logging
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

from perf_levers import InputError, base_kwargs, base_override, load_prompts  # noqa: E402

from sut.locality.latency import pct  # noqa: E402

logger = logging.getLogger("server_steps")

#: The most requests a phase may plan: Offline's ``--offline-samples``, Server's expected arrivals (``--rate`` x
#: its seconds). 10 million plan entries take ~1 GB; the preset's runs plan ~8,000.
MAX_ARRIVALS = 10_000_000
JSON_NAME, PNG_NAME = "server_steps.json", "server_steps.png"


class WriteError(OSError):
    """A record (OUT/server_steps.json or .png) that could not be written: the run fails (exit 1)."""


def arrivals(n_prompts: int, rate: float, duration_s: float, seed: int) -> list[tuple[float, int]]:
    """``(arrival s, prompt index)`` of a Poisson process at ``rate``/s over ``duration_s`` (``seed``: numpy's, >=
    0); ``rate`` 0: every index of ``range(n_prompts)`` at 0 (Offline). Prompts are taken in order, cycling.
    ValueError when the plan would hold more than ``MAX_ARRIVALS`` (``n_prompts``, or ``rate`` x ``duration_s``
    expected) or ``rate`` or ``duration_s`` is not finite."""
    if rate <= 0:
        if n_prompts > MAX_ARRIVALS:
            raise ValueError(f"{n_prompts} requests planned; at most MAX_ARRIVALS = {MAX_ARRIVALS}")
        return [(0.0, i) for i in range(n_prompts)]
    if not (math.isfinite(rate) and math.isfinite(duration_s)) or rate * duration_s > MAX_ARRIVALS:
        raise ValueError(f"rate {rate} x {duration_s} s: need finite values and at most MAX_ARRIVALS = "
                         f"{MAX_ARRIVALS} arrivals expected")
    scale = 1.0 / rate
    if not math.isfinite(scale):
        return []
    rng = np.random.default_rng(seed)
    chunk = int(rate * duration_s + 6 * math.sqrt(rate * duration_s)) + 16  # one draw, almost always
    times: list[float] = []
    t = 0.0
    while t < duration_s:  # cumsum from t: the same sums as adding the gaps one by one
        ts = np.cumsum(np.concatenate(([t], rng.exponential(scale, chunk))))[1:]
        times.extend(ts[ts < duration_s].tolist())
        t = float(ts[-1])
    return [(x, i) for i, x in enumerate(times)]


class StepLog:
    """What one phase's steps did; ``steps`` holds one dict per ``LLMEngine.step`` (module docstring)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.length: dict[str, int] = {}  # request id -> tokens so far, while it decodes
        self.open: set[str] = set()  # added, not finished
        self.waiting = 0  # added, no first token yet
        self.held = 0  # arrived, not added yet (``drive`` sets it)
        self.arrival: dict[str, float] = {}  # request id -> its arrival, s into the phase (while open)
        self.first_at: dict[str, float] = {}  # request id -> the end of the step that gave its first token, s
        self.latencies: list[tuple[float, float, Optional[float]]] = []  # finished: (arrival s, TTFT s, TPOT s)

    def submit(self, rid: str, t_arrival: float = 0.0) -> None:
        """A request added to the engine: waiting until its first token; it arrived ``t_arrival`` s into the phase
        (its TTFT counts from there, time held by ``drive`` included)."""
        self.open.add(rid)
        self.waiting += 1
        self.arrival[rid] = t_arrival

    def record(self, t_s: float, ms: float, outs) -> None:
        """One step that started ``t_s`` s into the phase and took ``ms`` ms, from its DELTA ``RequestOutput``s."""
        tokens = first = first_prompt = finished = 0
        t_end = t_s + ms / 1000
        for o in outs:  # RequestOutputKind.DELTA: the tokens this step added
            n = len(o.outputs[0].token_ids)
            before = self.length.get(o.request_id, 0)
            tokens += n
            if before == 0 and n > 0:
                first += 1
                first_prompt += len(o.prompt_token_ids or ())
                self.waiting -= 1
                self.first_at[o.request_id] = t_end
            self.length[o.request_id] = before + n
            if o.finished:
                finished += 1
                self._finished(o.request_id, self.length.pop(o.request_id), t_end)
                self.open.discard(o.request_id)
        self.steps.append({"t_s": round(t_s, 4), "ms": round(ms, 3), "tokens": tokens, "prefills": first,
                           "prefill_tokens": first_prompt, "finished": finished,
                           "decoding": len(self.length), "waiting": self.waiting + self.held, "held": self.held})

    def _finished(self, rid: str, n: int, t_end: float) -> None:
        """Note a finished request's TTFT and TPOT ((last token - first token) / (n - 1), as LoadGen's; None for a
        one-token answer)."""
        t0, t1 = self.arrival.pop(rid, None), self.first_at.pop(rid, None)
        if t0 is not None and t1 is not None:
            self.latencies.append((t0, t1 - t0, (t_end - t1) / (n - 1) if n > 1 else None))

    def unfinished_from_s(self) -> float:
        """The earliest arrival among requests still open (inf when none): every request that arrived before it
        finished, so latencies up to it have no survivor bias."""
        return min(self.arrival.values(), default=float("inf"))


def latency(log: StepLog, from_s: float, to_s: float) -> dict:
    """TTFT and TPOT p50 / p99 (ms) of the requests that arrived in [``from_s``, ``to_s``) and before the
    earliest one left unfinished (``timed_to_s``): Server's latencies over the steady window, for screening a
    lever against the scenario's limits before a LoadGen run (which alone decides)."""
    to_s = min(to_s, log.unfinished_from_s())
    sel = [(f, p) for t, f, p in log.latencies if from_s <= t < to_s]
    ttft = [1000 * f for f, _ in sel]
    tpot = [1000 * p for _, p in sel if p is not None]
    return {"requests_timed": len(sel), "timed_to_s": round(to_s, 3) if sel else None,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99)}


def drive(engine, prompts: Sequence[Sequence[int]], plan: Sequence[tuple[float, int]], params, duration_s: float,
          on_step: Optional[Callable[[float], None]] = None, clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep, keep_going: Callable[[], bool] = lambda: False,
          id_prefix: str = "r", admit_every: int = 1, slots: Optional[int] = None) -> StepLog:
    """Add the requests of ``plan`` as they arrive and step ``engine`` until ``duration_s`` (past it while
    ``keep_going()``, at most ``TAIL_S`` more: the profiler's steps, after the measured window) or until every
    request finished; abort the rest. Admission rule: while the engine has unfinished requests, the arrivals due
    by now are added only when at least ``admit_every`` steps ran since the last admission (1: before every step;
    K > 1: new prefills at most every Kth step, decode-only steps between, and only into free slots: ``slots``
    less the engine's unfinished requests, None no cap; the rest stay due); an idle engine adds a due arrival at
    once. ``on_step(t)`` runs before each step (the profiler's hook); an idle engine waits for the next arrival in
    ``sleep`` naps of at most 1 ms. Request ids are ``id_prefix`` + the plan index."""
    log, due = StepLog(), [t for t, _ in plan]
    t0, nxt, since = clock(), 0, admit_every  # since: steps since the last admission
    while True:
        now = clock() - t0
        if nxt < len(plan) and plan[nxt][0] <= now and (
                since >= admit_every or not engine.has_unfinished_requests()):
            cap = None if admit_every == 1 or slots is None else slots - engine.get_num_unfinished_requests()
            nxt, since = _admit(engine, prompts, plan, nxt, now, params, log, id_prefix, cap), 0
        if (now >= duration_s and not (keep_going() and now < duration_s + TAIL_S)) or (
                nxt == len(plan) and not engine.has_unfinished_requests()):
            break
        if not engine.has_unfinished_requests():
            sleep(min(0.001, max(0.0, plan[nxt][0] - now)))
            continue
        if on_step:
            on_step(now)
        log.held = bisect.bisect_right(due, now) - nxt
        s = clock()
        outs = engine.step()
        log.record(s - t0, 1000 * (clock() - s), outs)
        since += 1
    if log.open:
        engine.abort_request(sorted(log.open))
    return log


def _admit(engine, prompts, plan, nxt: int, now: float, params, log: StepLog, id_prefix: str,
           cap: Optional[int] = None) -> int:
    """``drive``'s admission: add every request of ``plan`` from index ``nxt`` that arrived by ``now``, at most
    ``cap`` (None: all); the next index."""
    end = len(plan) if cap is None else min(len(plan), nxt + max(cap, 0))
    while nxt < end and plan[nxt][0] <= now:
        rid = f"{id_prefix}{nxt}"  # a phase's own ids: an aborted request's late output is never another's
        engine.add_request(rid, {"prompt_token_ids": list(prompts[plan[nxt][1] % len(prompts)])}, params)
        log.submit(rid, plan[nxt][0])
        nxt += 1
    return nxt


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
    """The console table: one row per statistic, a column per phase, then one ``NAME / offline:`` line of ratios
    per Server phase (``res["ratios"]``); a phase without a steady window gets the notes of it and of Offline."""
    ph = res["phases"]
    keys = ("steps", "ms_per_step_median", "ms_per_step_mean", "tokens_per_step", "prefills_per_step",
            "prefill_tokens_per_step", "decoding_mean", "waiting_mean", "waiting_last", "output_tokens_per_s",
            "busy_share", "requests_timed", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")
    width = {p: max(14, len(p) + 2) for p in ph}
    lines = [f"{'steady window':<26}" + "".join(f"{p:>{width[p]}}" for p in ph)]
    for k in keys:
        lines.append(f"{k:<26}" + "".join(f"{str(ph[p]['window'].get(k, '-')):>{width[p]}}" for p in ph))
    for name, rs in res.get("ratios", {}).items():
        r = ", ".join(f"{k} {v:.4f}" for k, v in rs.items() if v is not None)
        notes = [n for n in res.get("notes", []) if n.startswith(("offline:", f"{name}:"))]
        lines.append(f"{name} / offline: " + (r or "none: a phase has no steady window (notes: "
                                               + "; ".join(notes) + ")"))
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


def run_phase(engine, name: str, prompts, a, params, admit_every: int = 1, slots: Optional[int] = None) -> dict:
    """One phase (``offline``, or a Server one: ``server``, ``server-admitK``; ``admit_every``: ``drive``'s, recorded
    as ``admit_every_steps`` for a Server phase; ``slots``: the engine's ``max_num_seqs``): its plan, steps, steady
    window and optional profile."""
    offline = name == "offline"
    plan = arrivals(a.offline_samples if offline else len(prompts), 0.0 if offline else a.rate, a.duration_s, a.seed)
    prof = Profiler(a.profile_steps, a.duration_s) if a.profile_steps > 0 else None
    if prof and not offline:  # arrivals go on while the profiled steps run
        plan = arrivals(len(prompts), a.rate, a.duration_s + TAIL_S, a.seed)
    log = drive(engine, prompts, plan, params, a.duration_s, on_step=prof,
                keep_going=prof.active if prof else (lambda: False), id_prefix=f"{name}-", admit_every=admit_every,
                slots=slots)
    w = window(log.steps, a.warm_s, offline, a.duration_s)
    if not offline and w["steps"]:
        w.update(latency(log, a.warm_s, a.duration_s))
    out = {"requests_planned": len(plan), "window": w, "steps": log.steps}
    if not offline:
        out = {"admit_every_steps": admit_every, **out}
    if not w["steps"]:
        out["note"] = no_window_note(name, log.steps, a)
        logger.warning("%s", out["note"])
    if prof:
        out["profile"] = prof.summary(sum(s["tokens"] for s in log.steps))
    return out


def no_window_note(name: str, steps: Sequence[dict], a) -> str:
    """Why phase ``name``'s steady window (``window``) has no steps: Offline's queue was empty by the window's
    start (all ``--offline-samples`` requests done), or a Server phase had no step from ``--warm-s`` to
    ``--duration-s``."""
    if name == "offline":
        t = next((s["t_s"] for s in steps if s["waiting"] <= 0), steps[-1]["t_s"] if steps else 0.0)
        return (f"offline: no steady window: its queue of {a.offline_samples} requests was empty at {t:.3f} s, "
                f"by --warm-s {a.warm_s:g} s (raise --offline-samples or lower --warm-s)")
    return (f"{name}: no steady window: no engine step from --warm-s {a.warm_s:g} s to --duration-s "
            f"{a.duration_s:g} s (too few arrivals at --rate {a.rate:g}?)")


def per_second(steps: Sequence[dict], key: str, last: bool = False) -> tuple[list[float], list[float]]:
    """``(x s, y)`` of ``key`` over each whole second of a phase that has steps: ``x`` the second's middle, ``y``
    the mean over its steps (``last``: its last step's value). Thousands of steps a phase drawn one by one are a
    solid band; a value a second shows the trend."""
    bins: dict[int, list] = {}
    for s in steps:
        bins.setdefault(int(s["t_s"]), []).append(s[key])
    x = [b + 0.5 for b in sorted(bins)]
    return x, [bins[b][-1] if last else sum(bins[b]) / len(bins[b]) for b in sorted(bins)]


def figure(res: dict) -> bytes:
    """The PNG (bytes; drawn, not written) of tokens per step, ms per step (means a second) and waiting requests
    (each second's last) over time, a line per phase, with the steady-window means of the first two dashed (Agg)."""
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
    ks = ", ".join(str(k) for k in res["settings"].get("admit_every_steps", [1]))
    fig.suptitle(f"engine steps, Offline vs Server at {res['settings']['rate']} queries/s, admitting every K steps "
                 f"while busy, K = {ks} ({res.get('card')}); dotted: the steady window's start, dashed: its mean")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write(path: Path, data) -> None:
    """``data`` (str or bytes) to ``path``; WriteError naming the path when it cannot be written."""
    try:
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
    except OSError as e:
        raise WriteError(f"{path}: cannot write it ({type(e).__name__}: {e})") from e


def _probe_write(out: Path) -> None:
    """Write and remove a probe file in ``out``; OSError when it cannot take files."""
    with tempfile.NamedTemporaryFile(dir=out, prefix=".server_steps_probe_") as f:
        f.write(b"probe")
        f.flush()


def prepare_out(out: Path) -> list[Path]:
    """Make ``out`` (and missing parents) and show that it can take the record: it is a folder, its
    server_steps.json and .png are not folders, a probe file can be written there. The folders made (deepest
    first); InputError naming ``--out`` when it cannot, after removing the folders this call made."""
    made = [p for p in (out, *out.parents) if not p.exists() and not p.is_symlink()]
    try:
        if out.exists() and not out.is_dir():
            raise InputError("not a folder")
        out.mkdir(parents=True, exist_ok=True)
        for name in (JSON_NAME, PNG_NAME):
            if (out / name).is_dir():
                raise InputError(f"{out / name} is a folder")
            if (out / name).exists() and not os.access(out / name, os.W_OK):
                raise InputError(f"{out / name} is not writable")
        _probe_write(out)
    except (OSError, InputError) as e:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                pass
        raise InputError(f"--out {out}: cannot take the record ({e})") from None
    return made


def card() -> str:
    """The GPU's name, ``cpu`` without CUDA, ``unknown`` when torch cannot tell."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a name for the record only
        return "unknown"


def parse(argv=None) -> argparse.Namespace:
    """The command line (module docstring); exit 2 on settings that cannot run (``check``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True, help="cnn_eval-format JSON with tok_input ids")
    ap.add_argument("--samples", type=int, default=1020, help="prompts read (cycled by both phases)")
    ap.add_argument("--offline-samples", type=int, default=8192,
                    help=f"requests Offline queues at once (at most {MAX_ARRIVALS:,})")
    ap.add_argument("--rate", type=float, default=52.0,
                    help=f"Server's Poisson arrivals, queries/s (finite, > 0; rate x seconds at most {MAX_ARRIVALS:,})")
    ap.add_argument("--duration-s", type=float, default=90.0, help="seconds a phase runs")
    ap.add_argument("--warm-s", type=float, default=30.0, help="s into a phase where the steady window starts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="Server's arrivals (numpy; >= 0)")
    ap.add_argument("--phases", nargs="+", default=["offline", "server"], choices=["offline", "server"])
    ap.add_argument("--admit-every-steps", type=int, nargs="+", default=[1], metavar="K",
                    help="Server runs once per K (each >= 1, once): arrivals added every K steps while the engine "
                         "is busy (1: every step; an idle engine adds at once)")
    ap.add_argument("--profile-steps", type=int, default=0, help="steady steps profiled per phase (CUDA)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    problem = check(a)
    if problem:
        ap.error(problem)
    return a


def check(a: argparse.Namespace) -> Optional[str]:
    """What makes the settings ``a`` unable to run, or None: counts below 1, a negative seed, an infinite or NaN
    rate or duration (the Poisson plan would never end), a plan over ``MAX_ARRIVALS``, a bad window or phase list,
    an ``--admit-every-steps`` K below 1 or given twice."""
    for k in ("samples", "offline_samples", "max_tokens"):
        if getattr(a, k) < 1:
            return f"--{k.replace('_', '-')} must be >= 1"
    if a.seed < 0:
        return "--seed must be >= 0 (numpy's generator takes no negative seed)"
    if not (0 < a.rate < math.inf and 0 < a.duration_s < math.inf and 0 <= a.warm_s < a.duration_s):
        return "need finite --rate > 0 and --duration-s > 0, and 0 <= --warm-s < --duration-s"
    server_s = a.duration_s + (TAIL_S if a.profile_steps > 0 else 0.0)  # arrivals go on while profiling
    if a.offline_samples > MAX_ARRIVALS or a.rate * server_s > MAX_ARRIVALS:
        return (f"a phase may plan at most {MAX_ARRIVALS:,} requests: --offline-samples {a.offline_samples}, "
                f"Server --rate {a.rate:g} x {server_s:g} s = {a.rate * server_s:,.0f}")
    if a.profile_steps < 0 or len(set(a.phases)) < len(a.phases):
        return "need --profile-steps >= 0 and each of --phases once"
    ks = a.admit_every_steps
    if min(ks) < 1 or len(set(ks)) < len(ks):
        return f"need --admit-every-steps K >= 1, each once (got {' '.join(map(str, ks))})"
    return None


def main(argv=None) -> int:
    """Check the settings, PERF_BASE_OVERRIDE, the dataset and --out, then start the engine, warm it up (64
    prompts) and run the phases. Exit 2 on bad input (nothing started, no folder left), 1 when a record cannot
    be written."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    a = parse(argv)
    try:
        kwargs = base_kwargs(a.model)
        prompts = load_prompts(a.dataset, a.samples)
        if not prompts:
            raise InputError(f"--dataset {a.dataset}: no prompts")
        out = Path(a.out)
        prepare_out(out)
    except InputError as e:
        logger.error("%s", e)
        return 2
    from vllm import LLM, SamplingParams, __version__

    llm = LLM(**kwargs)
    from vllm.sampling_params import RequestOutputKind

    fixed = dict(temperature=0.0, max_tokens=a.max_tokens, min_tokens=a.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:64]], SamplingParams(**fixed), use_tqdm=False)  # warm-up
    params = SamplingParams(**fixed, output_kind=RequestOutputKind.DELTA)  # every step's new tokens (StepLog)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "card": card(), "vllm": __version__,
           "engine": {k: v for k, v in kwargs.items() if k != "model"}, "engine_override": base_override(),
           "settings": vars(a), "phases": {}}
    try:
        run_phases(llm.llm_engine, prompts, a, params, res, out)
    except WriteError as e:
        logger.error("%s", e)
        return 1
    return 0


def phase_names(a) -> list[tuple[str, int]]:
    """``(name, K)`` of each phase to run, in order: ``offline`` (K 1: all arrive at once to an idle engine), then
    per ``--admit-every-steps`` K ``server`` (K 1) or ``server-admitK``."""
    return [(p, 1) if p == "offline" else ("server" if k == 1 else f"server-admit{k}", k)
            for p in a.phases for k in ([1] if p == "offline" else a.admit_every_steps)]


def run_phases(engine, prompts, a, params, res: dict, out: Path) -> None:
    """Each of ``a.phases`` on ``engine`` (``server`` once per ``--admit-every-steps`` K, one after another:
    ``phase_names``), OUT/server_steps.json rewritten after each (a later phase that fails, e.g. out of memory,
    leaves the earlier ones' record), then the ratios (``res["ratios"]``: each Server phase's name -> its
    ``ratios`` against Offline), the table and the figure. A figure that
    cannot be drawn is a warning and a note (``res["notes"]``, as a phase without a steady window), not a failed
    run; a record that cannot be written raises WriteError. Logs the files written, and only those."""
    path, notes = out / JSON_NAME, res.setdefault("notes", [])
    for name, k in phase_names(a):
        res["phases"][name] = run_phase(engine, name, prompts, a, params, k, res.get("engine", {}).get("max_num_seqs"))
        notes += [res["phases"][name]["note"]] if "note" in res["phases"][name] else []
        write(path, json.dumps(res, indent=1))
    servers = [n for n in res["phases"] if n != "offline"]
    if "offline" in res["phases"] and servers:
        res["ratios"] = {n: ratios(res["phases"][n]["window"], res["phases"]["offline"]["window"]) for n in servers}
    print("\n".join(table(res)))  # also for Server phases alone (--phases server: a latency screen)
    try:
        png = figure(res)
    except Exception as e:  # noqa: BLE001 - drawing only; the steps measured fine and the record is written
        png = None
        notes.append(f"no figure ({type(e).__name__}: {e})")
        logger.warning("%s", notes[-1])
    write(path, json.dumps(res, indent=1))
    if png is not None:
        write(out / PNG_NAME, png)
    logger.info("wrote %s", ", ".join(str(p) for p in (path, out / PNG_NAME if png is not None else None) if p))


if __name__ == "__main__":
    sys.exit(main())
