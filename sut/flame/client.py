"""The Flame-batched SUT (``--sut flame``): the LoadGen SUT over the ``flame`` transport.

``FlameSUT`` is a ``sut.core.loadgen_sut.TransportSUT`` whose transport is ``flame``
(``sut.flame.transport``: batches -> tasks of one Flame session per replica -> vLLM engines in Flame
services); its options are the transport's ``FlameOptions`` (``sut.flame.options``). Offline only
(Flame 0.6 has no first-token event; ``sut.scenarios.check_backend`` refuses the others). The run's
dataset goes to the transport, which refuses a batch size that cannot fit one Flame message before
any session exists and sends the dataset's path and hash to the services with ``payload=indices``.

Before anything starts (``preflight``, exit 2 and no run folder): a Flame endpoint must be given (option
``endpoint`` / ``--flame-endpoint``, ``FLAME_ENDPOINT`` or ``~/.flame/flame.yaml``) and its session manager
must accept a connection, then answer a Flame call, each within ``sut.flame.endpoint.PREFLIGHT_TIMEOUT_S`` seconds.

"""

from __future__ import annotations

from sut.base import SUTContext, register_sut
from sut.core.loadgen_sut import TransportSUT
from sut.engine import EngineSettings, EngineSlot, check_step_budget
from sut.errors import EngineError, InputError, RunFailed
from sut.flame.endpoint import check_control_plane
from sut.flame.options import MAX_EXECUTORS_PER_ENGINE, FlameOptions

__all__ = ["FlameSUT"]


@register_sut("flame")
class FlameSUT(TransportSUT):
    """LoadGen SUT that sends batches of samples as Flame tasks to vLLM services."""

    transport_name = "flame"

    def __init__(self, ctx: SUTContext, transport=None):
        super().__init__(ctx, transport)
        if hasattr(self.transport, "use_dataset"):
            self.transport.use_dataset(ctx.dataset)

    @classmethod
    def check_settings(cls, engine: EngineSettings) -> None:
        """``InputError`` for a ``--device cpu`` ``max_num_seqs`` above vLLM's default per-step budget of a CPU
        engine when ``max_num_batched_tokens`` is unset (``sut.engine.check_step_budget``): the services' engines
        would refuse it at their start. On GPUs the services' cards are not known here: not checked."""
        if engine.device == "cpu":
            try:
                check_step_budget(engine, [EngineSlot(0, "cpu", "service")])
            except EngineError as e:
                raise InputError(f"--sut flame: {e}") from None

    @classmethod
    def preflight(cls, options: FlameOptions, engine: EngineSettings) -> None:
        """``InputError`` when the executors a replica session asks for exceed ``MAX_EXECUTORS_PER_ENGINE``,
        ``min_executors`` exceeds the executors a replica session asks for, no Flame
        endpoint is given, or its session manager does not accept a connection and answer a Flame call, each within
        ``PREFLIGHT_TIMEOUT_S`` seconds (``sut.flame.endpoint.check_control_plane``)."""
        per_engine = options.per_engine(engine.max_num_seqs)
        if per_engine > MAX_EXECUTORS_PER_ENGINE:
            raise InputError(f"--sut flame: {per_engine:,} executors per engine (engine_fill {options.engine_fill:g} x "
                             f"max_num_seqs {engine.max_num_seqs} / batch_size {options.batch_size} + executor_slack "
                             f"{options.executor_slack}) is more than {MAX_EXECUTORS_PER_ENGINE}: raise --batch-size "
                             "or lower engine_fill")
        if options.min_executors is not None and options.min_executors > per_engine:
            raise InputError(f"--sut flame: min_executors {options.min_executors} is more than the {per_engine} "
                             "executor(s) a replica session asks for (executors_per_engine); the warm-up could never "
                             "reach it")
        try:
            check_control_plane(options.endpoint)
        except RunFailed as e:
            raise InputError(f"--sut flame: {e}") from None
