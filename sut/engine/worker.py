"""The engine worker process: build ``vllm.LLM`` once, read it back, then serve the pipe.

``worker_main`` (the spawned process's entry point) pins itself to its slot (``CUDA_VISIBLE_DEVICES``
or the vLLM CPU thread binding), sends its output to the engine log, builds the engine, reports
``Ready(info)`` (or ``Failed``) and runs ``serve``: the same add-request / step loop that
``LLM.generate`` runs, fed from the pipe (``sut.engine.messages``). New requests are added the moment
they arrive (the loop blocks on the pipe only while nothing runs), or with ``admit_every_steps`` N > 1
only every N engine steps while the engine is busy (an idle engine admits at once), and then only into free
sequence slots (``max_num_seqs`` less the engine's unfinished requests; the worker holds the rest), so that
vLLM's own waiting queue never refills a slot between admissions: Server's arrivals then reach the engine in
groups, their prefills share fewer, larger steps and the steps between decode only, as Offline's do (on one
H100 a step that mixes prefill into ~500 decodes cost ~8 ms more than a decode-only step, whatever its prefill
tokens, and Server mixed nearly every step: ``scripts/bench/server_steps.py``). Each step's finished requests
go back as one ``Done`` of ``Completion``s (``sut.engine.outputs``), preceded by a ``Firsts`` of that
step's first tokens when the worker streams.

Modes: Offline keeps vLLM's ``FinalOnly`` outputs (no per-step output objects); ``stream`` (Server /
Interactive) and ``detail`` (the locality runner: first-token times) switch to ``DELTA`` outputs;
only ``stream`` reports first tokens.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from sut.engine.devices import EngineSlot
from sut.engine.gcmon import GcPauseMonitor
from sut.engine.logs import redirect_output
from sut.engine.messages import (
    Done,
    Failed,
    Firsts,
    Generate,
    RawDone,
    RawGenerate,
    Ready,
    ResetCache,
    Stats,
    StatsQuery,
    Stop,
)
from sut.engine.outputs import DeltaCollector, FinalCollector
from sut.engine.readback import read_back
from sut.engine.settings import EngineSettings, GenerationSettings
from sut.errors import EngineError
from sut.messages import Completion


class _Terminated(BaseException):
    """SIGTERM in an engine worker that shares its parent's process group."""


def _raise_terminated(*_):
    raise _Terminated()


#: Longest directory for vLLM's ZMQ IPC sockets: a Unix socket path holds at most 107 bytes and vLLM appends
#: ``/<uuid4>`` (37 bytes) to ``VLLM_RPC_BASE_PATH`` (default: the temp dir, which Flame's executor manager
#: sets inside the application's working directory, e.g. under a long run folder).
MAX_RPC_DIR = 64


def short_rpc_dir(env: dict, tempdir: str, fallback: str = "/tmp") -> Optional[str]:
    """The ``VLLM_RPC_BASE_PATH`` to set when the one in effect (``env``'s, else ``tempdir``) is longer than
    ``MAX_RPC_DIR`` bytes: ``fallback``; None when it is short enough."""
    current = env.get("VLLM_RPC_BASE_PATH") or tempdir
    return fallback if len(current.encode()) > MAX_RPC_DIR else None


def _pin(slot: EngineSlot, own_process_group: bool, log_path: Optional[Path]) -> None:
    """Log redirection, process group, signals, the slot's environment and the process title."""
    if log_path is not None:
        redirect_output(log_path)
    if own_process_group:
        os.setpgrp()  # own process group: the parent ends vLLM's children with one killpg
    else:
        signal.signal(signal.SIGTERM, _raise_terminated)  # the group's SIGTERM: clean exit through `finally`
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked since spawn: start_with_sigint_blocked
    os.environ.update(dict(slot.env))
    _thread_only_progress_lock()
    rpc_dir = short_rpc_dir(os.environ, tempfile.gettempdir())
    if rpc_dir:
        os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir  # else vLLM's engine-core socket path may not fit
    try:  # show up as sut-engine-N in ps/top (setproctitle comes with vLLM)
        import setproctitle

        setproctitle.setproctitle(f"sut-engine-{slot.index} ({slot.kind}:{slot.device})")
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def _thread_only_progress_lock() -> None:
    """Give tqdm a thread lock before vLLM draws its first bar ("Loading safetensors checkpoint shards" with real
    weights). tqdm's default lock also makes a ``multiprocessing`` semaphore, which this worker's ``os._exit``
    (:func:`_exit_now`) never unlinks: the parent's resource tracker then warned "1 leaked semaphore objects to clean
    up at shutdown" after every real-weights run. One process draws the bars here, so a thread lock is enough."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker_main(conn: mpc.Connection, settings: EngineSettings, gen: GenerationSettings, slot: EngineSlot,
                own_process_group: bool = True, gc_freeze: bool = False, detail: bool = False,
                log_path: Optional[Path] = None, stream: bool = False) -> None:
    """Entry point of an engine worker process (spawned).

    ``own_process_group``: start a new process group (the local transport ends vLLM's children with
    one killpg); False keeps the worker in its parent's group, so that whoever ends the parent's
    group (Flame's executor manager at unbind) ends the engine too.
    ``gc_freeze``: after start-up, ``gc.freeze()`` the heap and time every GC pause; the largest pause
    is logged at shutdown and reported on a ``StatsQuery``.
    ``detail`` / ``stream``: delta outputs with first-token times; ``stream`` also reports first
    tokens (see the module docstring).
    ``log_path``: stdout and stderr (vLLM's logs, warnings, tracebacks) go to this file, before vLLM
    is imported; None keeps the parent's.
    """
    _pin(slot, own_process_group, log_path)
    gcmon = GcPauseMonitor(f"engine-{slot.index}")
    try:
        import torch
        import vllm
        from vllm import LLM

        llm = LLM(**settings.vllm_kwargs(slot.gpu_share))
        params = gen.sampling_params()
        info = read_back(llm, vllm, torch, slot)
        if gc_freeze:
            gcmon.install()
            info["gc_frozen_objects"] = gcmon.freeze()
        conn.send(Ready(info))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(Failed(f"engine {slot.index} failed to start:\n{traceback.format_exc()}"))
        return
    stopped = False
    try:
        serve(conn, llm.llm_engine, params, gcmon.stats, llm=llm, detail=detail, stream=stream,
              admit_every=settings.admit_every_steps, slots=settings.max_num_seqs)
        stopped = True
    except (EOFError, BrokenPipeError, _Terminated):
        pass  # parent is gone, or the shared process group is being ended
    except BaseException as e:  # noqa: BLE001 - a failed answer check (EngineError) needs no traceback
        why = str(e) if isinstance(e, EngineError) else f"\n{traceback.format_exc()}"
        try:
            conn.send(Failed(f"engine {slot.index} failed: {why}"))
        except (OSError, EOFError):
            pass
    finally:
        if gc_freeze:
            gcmon.unfreeze()  # before the engine's objects are released
            gcmon.uninstall()
            st = gcmon.stats()
            print(f"engine {slot.index} (pid {os.getpid()}): largest GC pause {st['max_pause_ms']:.1f} ms "
                  f"(generation {st['max_pause_generation']}), {st['collections']} collections, "
                  f"{st['total_ms']:.0f} ms in total", flush=True)
        if stopped and own_process_group:  # a normal Stop: the parent ends the group right after
            _exit_now()
        del llm  # otherwise (parent gone, error): vLLM's own shutdown ends its children


def _exit_now() -> None:
    """End this worker at once (exit code 0) after a normal ``Stop``: the parent ends its process group
    right after (``EngineHandle.shutdown``), which ends vLLM's own child processes too. Not when the
    parent is gone or serving failed: then nobody ends the group, and vLLM's own shutdown (``del llm``)
    must end its EngineCore. Its own children (vLLM's EngineCore) are ended and reaped first. This skips
    vLLM's engine shutdown (it runs a full ``gc.collect``) and the interpreter's teardown: measured on
    2 busy CPU cores with the tiny model, 2-4 s and 6-12 s of a 9-17 s stop."""
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: Python's own helper processes, which end by themselves once this process is gone (killing the resource
#: tracker would leave its shared-memory segments behind).
_MP_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _end_children(term_wait: float = 5.0) -> None:
    """SIGTERM this process's descendants (vLLM's EngineCore on a GPU), wait up to ``term_wait`` s, SIGKILL
    what is left, and reap the direct children, so that none is left as an orphan (a container's PID 1 may
    never reap it, and the parent would see the process group alive)."""
    import psutil

    procs = []
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for p in children:
        try:
            if not any(h in " ".join(p.cmdline()) for h in _MP_HELPERS):
                procs.append(p)
        except psutil.Error:
            continue  # gone meanwhile
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 2.0)):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=wait)
        if not procs:
            return


def serve(conn: mpc.Connection, engine, params, stats_fn: Optional[Callable[[], dict]] = None, llm=None,
          detail: bool = False, stream: bool = False, admit_every: int = 1, slots: Optional[int] = None) -> None:
    """The hot loop: the same add_request/step cycle as ``LLM.generate``, fed from the pipe
    (messages: ``sut.engine.messages``). ``admit_every``: while the engine is busy, the pipe is read (stats
    answered, ``Stop`` seen) and requests added only once ``admit_every`` steps ran since the last admission; an
    idle engine reads it at once (module docstring). With ``admit_every`` > 1 requests are held here and added
    only into free slots: ``slots`` (the engine's ``max_num_seqs``; None: no cap) less its unfinished requests.
    Returns on ``Stop``; raises ``EOFError`` when the parent is gone."""
    raw_params = params
    if stream or detail:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        collect = DeltaCollector(report_firsts=stream)
    else:
        collect = FinalCollector()
    held: Optional[deque] = deque() if admit_every > 1 else None  # read from the pipe, not yet added
    since_intake = admit_every  # steps since the last admission
    while True:
        # Stage 1: intake. Block only when nothing is running or held; while busy, every admit_every steps.
        busy = engine.has_unfinished_requests()
        if not busy:
            _check_none_dropped(collect, held)
        if not busy or since_intake >= admit_every:
            got = conn.poll(0 if busy or held else None)
            if got and not _intake(conn, engine, params, collect, stats_fn, llm, raw_params, held):
                return
            if held:  # an admission (a stats query alone is not one), even when no slot is free
                since_intake = 0
                _release(engine, held, slots)
        # Stage 2: one engine step.
        if not engine.has_unfinished_requests():
            continue
        since_intake += 1
        firsts, done = collect.step(engine.step())
        # Stage 3: first tokens, then finished requests.
        if firsts:
            conn.send(Firsts(firsts))
        if done:
            conn.send(Done(done))


def _release(engine, held: deque, slots: Optional[int]) -> None:
    """Add held ``(request id, prompt ids, params)`` in arrival order, at most ``slots`` less the engine's
    unfinished requests (all of them when ``slots`` is None)."""
    free = len(held) if slots is None else slots - engine.get_num_unfinished_requests()
    add = engine.add_request
    for _ in range(min(free, len(held))):
        rid, ids, p = held.popleft()
        add(rid, {"prompt_token_ids": ids}, p)


def _check_none_dropped(collect, held: Optional[deque]) -> None:
    """On an idle engine (no unfinished request): raise ``EngineError`` naming the requests it was given and
    never finished (vLLM dropped them without an output), which would otherwise fail the run only at the
    harness's stall limit, minutes later."""
    if len(collect.t_add) > (len(held) if held else 0):
        lost = collect.unanswered(held or ())
        if lost:
            raise EngineError(f"the engine is idle but never finished {len(lost)} request(s) it was given "
                              f"(request ids {', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''})")


def _intake(conn, engine, params, collect, stats_fn, llm, raw_params, held: Optional[deque] = None) -> bool:
    """Handle every message waiting on the pipe (at least one); a ``Generate``'s requests go to the engine, or
    to ``held`` when given (``serve``'s admission), and are recorded in ``collect.t_add``. False on ``Stop``.
    Raises ``EngineError`` for a request id given again while it runs or is held (vLLM would run both under one
    id, and one answer would be lost or delivered for the other's prompt)."""
    t_add = collect.t_add
    while True:
        msg = conn.recv()
        kind = type(msg)
        if kind is Generate:  # held: queued from now, the time held counts as time in the queue
            add, now = engine.add_request, time.monotonic
            for req in msg.requests:
                rid, ids, p = str(req[0]), req[1].tolist(), _params_for(params, req)
                if rid in t_add:
                    raise EngineError(f"request {rid} was given again while it still runs here (a request id "
                                      "is given once at a time; its two answers could not be told apart)")
                if held is None:
                    add(rid, {"prompt_token_ids": ids}, p)
                else:
                    held.append((rid, ids, p))
                t_add[rid] = now()
        elif kind is Stop:
            return False
        elif kind is StatsQuery:
            conn.send(Stats(stats_fn() if stats_fn else {}))
        elif kind is ResetCache:
            ok = bool(engine.reset_prefix_cache()) if not engine.has_unfinished_requests() else False
            conn.send(Stats({"reset_prefix_cache": ok}))
        elif kind is RawGenerate:
            conn.send(RawDone(*raw_generate(llm, raw_params, msg.requests)))
        else:
            raise EngineError(f"engine worker: unknown message {msg!r}")
        if not conn.poll(0):
            return True


#: Sampling parameters of requests that ask their own output length, per (parameters, length).
_LENGTH_PARAMS: dict = {}


def _params_for(params, req):
    """``params``, or a copy asking the request's own output length (``Request.max_tokens`` > 0: exactly that
    many with ``ignore_eos``, else at most; ``min_tokens`` capped by it). Copies are cached per length."""
    asked = req[3] if len(req) > 3 else 0
    if not asked or asked == params.max_tokens:
        return params
    key = (id(params), int(asked))  # the serve loop's params live as long as the worker
    if key not in _LENGTH_PARAMS:
        p = params.clone()
        p.max_tokens = int(asked)
        p.min_tokens = int(asked) if params.ignore_eos else min(params.min_tokens, int(asked))
        _LENGTH_PARAMS[key] = p
    return _LENGTH_PARAMS[key]


def raw_generate(llm, params, batch) -> tuple[float, list[Completion]]:
    """One plain ``LLM.generate`` over ``[(request id, int32 prompt)]`` on an idle engine; returns
    ``(seconds, [Completion])`` (no timestamps). Raises ``EngineError`` if the engine is busy, or when an
    output's ``prompt_token_ids`` are not its own prompt's (``LLM.generate`` returns them in input order)."""
    from vllm.inputs import TokensPrompt

    if llm is None or llm.llm_engine.has_unfinished_requests():
        raise EngineError("raw generate needs an idle engine")
    prompts = [TokensPrompt(prompt_token_ids=r[1].tolist()) for r in batch]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    for r, p, o in zip(batch, prompts, outs):
        got = getattr(o, "prompt_token_ids", None)
        if got is not None and list(got) != p["prompt_token_ids"]:
            raise EngineError(f"raw generate: the output for request {int(r[0])} answers another prompt")
    return dt, [Completion(int(r[0]), np.asarray(o.outputs[0].token_ids, dtype=np.int32),
                           getattr(o, "num_cached_tokens", None)) for r, o in zip(batch, outs)]
