"""Options of the ``flame`` transport (``--sut flame``; ``--option KEY=VALUE`` or a preset's ``[options]``).

``FlameOptions`` is the transport's ``options_cls``: a frozen dataclass whose values arrive typed
(``sut.engine.settings_from_mapping``: a preset's ``"4"`` is refused, not coerced). Fields with their
own CLI flag say so in ``metadata["flag"]``; the CLI builds its "flame SUT" flag group from them.

Sizing: with ``executors_per_engine = max(2, ceil(engine_fill x max_num_seqs / batch_size)) +
executor_slack`` (default fill 2) executors feeding each engine, the engine always holds more
sequences than it can run, and a task never waits behind another of its replica (see
``executors_per_engine``).

Study settings (``../shared/research/study.md`` §6, the synthetic-locality entry point):
``FlameOptions.for_locality()`` = batch limit 128, batch-formation window 10 ms; zlib payload
(``compress``) and the frozen start-up heap (``gc_freeze``) are on by default, and every request of
a batch is always submitted to the engine at once (the engine host's asynchronous admission).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

#: Largest ``batch_size`` accepted: an engine runs at most ``max_num_seqs`` sequences at once (2,048 at most in the
#: H200 sweep, ../shared/research/anchors_2026-12.md section 4), so a bigger task only queues inside one executor.
MAX_BATCH_SIZE = 4096

#: Largest ``engine_fill``: executors holding 2x ``max_num_seqs`` keep an engine >= 99.9 % busy
#: (``executors_per_engine``), so more only asks Flame for executors that wait (1e308 overflowed the count).
MAX_ENGINE_FILL = 64.0

#: Most executors one replica session may ask for (``executors_per_engine``, ``min_executors``, ``executor_slack``):
#: batch 1 at 2x 2,048 sequences; each executor is one service instance, so 1e18 only stalled the warm-up.
MAX_EXECUTORS_PER_ENGINE = 4096

#: Time limits and intervals (seconds) that must be finite and > 0: 0 or less would give up at once (a close that
#: never waits leaves the session Open with its executors Bound after the harness exits; a warm-up that fails before
#: it starts), inf or NaN would wait for good or never.
POSITIVE_SECONDS = ("warmup_timeout_s", "warmup_stall_s", "warmup_log_s", "engine_start_timeout_s", "health_check_s",
                    "slot_wait_s", "close_timeout_s", "engine_stall_s", "unbind_wait_s", "leave_wait_s",
                    "unreachable_timeout_s")

#: The study's Flame settings (batch limit 128, batch-formation window 10 ms).
LOCALITY_DEFAULTS = {"batch_size": 128, "batch_window_ms": 10.0}


def _flag(name: str, help_: str) -> dict:
    return {"flag": name, "help": help_}


@dataclass(frozen=True)
class FlameOptions:
    """Options of the flame transport (units in the names: ``_ms``, ``_s``).

    Extension points (tests and experiments; a benchmark leaves them unset): ``engine_factory`` =
    ``"module:callable"`` that the service imports and calls as ``factory(slot, engine_settings,
    generation_settings, gc_freeze=..., **engine_factory_args)`` instead of building
    ``sut.engine.EngineHandle``; ``service_hooks`` = ``"module:callable"`` called once per service
    process with ``**service_hooks_args``, returning an object whose optional ``on_enter(service)``
    and ``on_task(service, batch_id)`` methods the service calls (fault injection). Both travel in
    the session's common data; the service processes must be able to import the module (the
    application's ``PYTHONPATH`` starts with the repository root).
    """

    batch_size: int = field(default=32, metadata=_flag("--batch-size", "samples per Flame task (32 and 64 ship as presets)"))
    batch_window_ms: float = field(default=20.0, metadata=_flag(
        "--batch-window-ms", "how long a partial batch waits for more samples"))
    endpoint: Optional[str] = field(default=None, metadata=_flag(
        "--flame-endpoint", "Flame session manager, e.g. http://HOST:8080 (default FLAME_ENDPOINT / ~/.flame/flame.yaml)"))
    app: str = field(default="sut-vllm", metadata=_flag("--flame-app", "registered Flame application name (default sut-vllm)"))
    register_app: str = "if_missing"  # if_missing | never
    app_workdir: Optional[str] = None
    engines: int = field(default=1, metadata=_flag(
        "--flame-engines", "engine replicas (default 1): one Flame session each, replica r pinned to engine slot r of "
                           "the executor hosts (GPUs x engines per GPU, in sut.engine.plan_engines order)"))
    executors_per_engine: Optional[int] = field(default=None, metadata=_flag(
        "--executors-per-engine", "Flame executors feeding one engine (default max(2, ceil(engine_fill x max_num_seqs / "
                                  "batch_size)) + executor_slack = max(2, ceil(2 x max_num_seqs / batch_size)))"))
    engine_fill: float = 2.0
    executor_slack: int = 0
    min_executors: Optional[int] = None  # per replica session; default: all of its executors
    inflight_per_executor: int = 2
    payload: str = "tokens"  # tokens | indices
    compress: bool = True  # zlib level 1 of task and result bodies
    gc_freeze: bool = True  # services and engines freeze their start-up heap (gc.freeze)
    resreq: Optional[str] = None
    session_id: Optional[str] = None
    lock_dir: Optional[str] = None
    warmup_timeout_s: float = 1800.0
    warmup_stall_s: float = 120.0  # fail the warm-up when Flame gives a session no new executor for this long
    warmup_log_s: float = 10.0  # how often the warm-up logs what it waits for
    warmup_hold_ms: float = 200.0  # how long the service holds each warm-up ping (at most 5 s; 0: not held)
    engine_start_timeout_s: float = 1800.0
    health_check_s: float = 5.0  # how often a running transport asks Flame whether its sessions and executors still live
    # A service waits this long for an engine slot held by another session's engine host. 300 s: a closed session's
    # executors still Binding finish starting their engine before they can leave (a run right after a
    # Ctrl-C'd warm-up waited 80 s on CPU; an 8B engine on a GPU takes 1-3 min to start).
    slot_wait_s: float = 300.0
    close_timeout_s: float = 600.0
    # A service ends its engine (and fails its tasks) when the engine has answered nothing for this long with requests
    # outstanding (stopped or hung): Flame v0.6.0 cannot cancel a running task, so without it a hung engine held the
    # session open past close_timeout_s and its service processes for good. None: the run's --stall-timeout-s.
    engine_stall_s: Optional[float] = None
    unbind_wait_s: float = 20.0  # after the close: an executor of the run still Unbinding this long lost its service
    # After a lost node: how long the stop asks the session's surviving executors to end their services (a session
    # with tasks of a dead executor manager can never be closed in Flame v0.6.0, so Flame never ends them itself).
    leave_wait_s: float = 30.0
    unreachable_timeout_s: float = 15.0  # give up closing when the session manager stays unreachable this long
    service_log_dir: Optional[str] = None  # default: <run folder>/flame-service (services on this host); "none"
    engine_factory: Optional[str] = None  # "module:callable"; default sut.engine.EngineHandle
    engine_factory_args: Optional[dict] = None
    service_hooks: Optional[str] = None  # "module:callable"; default none
    service_hooks_args: Optional[dict] = None
    allow_prefix_caching: bool = False
    dispatch_chunk: int = 512
    record_tasks: bool = True
    aio_watch: bool = True  # all watch streams on one grpc.aio loop; false: flamepy's Session.watch_task per thread

    def __post_init__(self):
        for name in ("batch_size", "engines", "inflight_per_executor", "dispatch_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be at most {MAX_BATCH_SIZE} (samples per Flame task), got {self.batch_size}")
        if self.resreq is not None:
            import flamepy

            try:
                flamepy.ResourceRequirement.from_string(self.resreq)
            except ValueError as e:
                raise ValueError(f"resreq {self.resreq!r}: {e} (e.g. cpu=1,mem=2g,gpu=1)") from None
        self._check_executor_counts()
        if not math.isfinite(self.batch_window_ms) or self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.payload not in ("tokens", "indices"):
            raise ValueError(f"payload must be tokens or indices, got {self.payload!r}")
        if self.register_app not in ("if_missing", "never"):
            raise ValueError(f"register_app must be if_missing or never, got {self.register_app!r}")
        if not (math.isfinite(self.engine_fill) and 0 < self.engine_fill <= MAX_ENGINE_FILL):
            raise ValueError(f"engine_fill must be in (0, {MAX_ENGINE_FILL:g}], got {self.engine_fill}")
        for name in POSITIVE_SECONDS:
            value = getattr(self, name)  # None: unset where the field allows it (engine_stall_s: the run's)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.warmup_hold_ms) and self.warmup_hold_ms >= 0):
            raise ValueError(f"warmup_hold_ms must be a finite number >= 0 (0: a warm-up ping holds no executor), "
                             f"got {self.warmup_hold_ms}")
        for name in ("engine_factory", "service_hooks"):
            spec = getattr(self, name)
            if spec is not None and (spec.count(":") != 1 or not all(spec.split(":"))):
                raise ValueError(f"{name} must be 'module:callable', got {spec!r}")
            args = getattr(self, f"{name}_args")
            if args is not None and not isinstance(args, dict):
                raise ValueError(f"{name}_args must be a JSON object (keyword arguments), got {args!r}")

    def _check_executor_counts(self) -> None:
        """``ValueError`` for ``executors_per_engine`` / ``min_executors`` below 1 or ``executor_slack`` below 0, and
        any of them above ``MAX_EXECUTORS_PER_ENGINE`` (a session asking for more only stalls its warm-up)."""
        for name, least in (("executors_per_engine", 1), ("min_executors", 1), ("executor_slack", 0)):
            v = getattr(self, name)
            if v is not None and not least <= v <= MAX_EXECUTORS_PER_ENGINE:
                raise ValueError(f"{name} must be in [{least}, {MAX_EXECUTORS_PER_ENGINE}], got {v}")

    @classmethod
    def for_locality(cls, **overrides) -> "FlameOptions":
        """The study's settings (``LOCALITY_DEFAULTS``) with ``overrides`` on top."""
        return cls(**dict(LOCALITY_DEFAULTS, **overrides))

    def per_engine(self, max_num_seqs: int) -> int:
        """Executors per engine (replica session): the option, else ``executors_per_engine(...)``."""
        return self.executors_per_engine or executors_per_engine(max_num_seqs, self.batch_size, self.engine_fill,
                                                                 self.executor_slack)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


#: Fewest executors feeding one engine (see ``executors_per_engine``).
MIN_EXECUTORS_PER_ENGINE = 2


def executors_per_engine(max_num_seqs: int, batch_size: int, fill: float = 2.0, slack: int = 0) -> int:
    """Executors one engine needs so that it always holds more sequences than it can run.

    A task returns only when its longest sample is done, so the finished samples of a running
    batch hold no engine slot while the batch waits for its last one. With executors holding
    ``fill`` x ``max_num_seqs`` sequences the engine stays full even when output lengths vary
    (``python scripts/bench/bench_flame.py --simulate-fill``: 1x + one batch keeps it 67-82 % busy
    with 20..128-token outputs, 2x keeps it >= 99.9 % busy).

    At least 2: a Flame executor runs its tasks one after another, so with one executor a replica's
    second task (e.g. the 2 requests beyond the batch limit 128 when prefix affinity routes 130 of a
    burst to one replica) waits until the whole first task is done and then runs alone: a tail of
    one extra small-batch run (H200, study-reuse trace, ``max_num_seqs`` 64: +0.35 s on an 18.4 s
    burst, Flame / standalone 0.974 instead of ~0.995; docs/benchmarks.md). With two, the engine gets
    both tasks' requests at once, as the standalone engine does.
    """
    return max(MIN_EXECUTORS_PER_ENGINE, math.ceil(fill * max_num_seqs / batch_size)) + slack
