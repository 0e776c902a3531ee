"""Engine layer: one vLLM engine per device (or several per device), each in its own worker process.

Algorithm
---------
``EngineSettings`` (one frozen dataclass, built from the CLI or from code) -> ``plan_engines`` (one
``EngineSlot`` per visible GPU, or per CPU core group) -> ``EnginePool`` starts one spawned worker
process per slot through an ``EngineHandle``. A worker pins itself, builds ``vllm.LLM`` once, reads
its configuration back, reports ``Ready`` and then runs the same add-request / step loop that
``LLM.generate`` runs, fed from a pipe of typed messages: new requests are added the moment they
arrive and finished outputs go back after each step as ``sut.messages.Completion`` records
(with cached prompt tokens and timestamps), first tokens as ``FirstToken`` where the worker streams.
The ``local`` transport (``sut.core.transports.local``) and the Flame service drive it.

Modules (one concern each):

* ``settings``: ``EngineSettings``, ``GenerationSettings``, ``ModelInfo`` / ``read_model_info``,
  ``settings_from_mapping``.
* ``devices``: ``EngineSlot``, ``plan_engines``, ``CPU_ENV``.
* ``gcmon``: ``GcPauseMonitor``.
* ``logs``: ``engine_log_path``, ``log_tail``, the worker's output redirection.
* ``messages``: the worker pipe's message kinds. ``outputs``: step outputs -> ``Completion`` /
  ``FirstToken``. ``readback``: the engine's read-back record. ``worker``: the worker process.
* ``handle``: ``EngineHandle`` (one worker). ``pool``: ``EnginePool`` (every worker of a run).
"""

from sut.engine.devices import CPU_ENV, EngineSlot, check_step_budget, plan_engines
from sut.engine.gcmon import GcPauseMonitor
from sut.engine.handle import DoneCallback, EngineHandle, FatalCallback, FirstCallback
from sut.engine.logs import ENGINE_LOG_TAIL_LINES, engine_log_path, log_tail
from sut.engine.outputs import DeltaCollector, FinalCollector
from sut.engine.pool import EnginePool
from sut.engine.readback import kv_cache_capacity, read_back
from sut.engine.settings import (
    EngineSettings,
    GenerationSettings,
    ModelInfo,
    check_weights_present,
    read_model_info,
    settings_from_mapping,
)
from sut.engine.worker import serve, worker_main

__all__ = ["CPU_ENV", "check_step_budget", "DeltaCollector", "DoneCallback", "ENGINE_LOG_TAIL_LINES", "EngineHandle",
           "EnginePool", "EngineSettings", "EngineSlot", "FatalCallback", "FinalCollector", "FirstCallback",
           "GcPauseMonitor", "GenerationSettings", "ModelInfo", "check_weights_present", "engine_log_path",
           "kv_cache_capacity", "log_tail",
           "plan_engines", "read_back", "read_model_info", "serve", "settings_from_mapping", "worker_main"]
