"""``--sut vllm``: the LoadGen SUT over the ``local`` transport (vLLM engine workers of this host).

It is ``TransportSUT`` (``sut.core.loadgen_sut``) with ``transport_name = "local"``
(``sut.core.transports.local``) and the routing policy by scenario:

* Offline: ``least_loaded`` (``sut.core.routing.least_loaded``): each sample goes to the engine with
  the fewest outstanding tokens (prompt + 128 new tokens), not round-robin, in chunks of
  ``dispatch_chunk`` samples, so engines start on a large query while the rest is still routed.
* Server / Interactive: ``least_pending`` (``sut.core.routing.least_pending``): each sample at once to
  the engine with the least pending work (requests outstanding + ``first_token_weight`` x those not yet
  at their first token), as in the best vLLM submission of MLPerf v6.1 (AMD). The engines stream: each
  first token goes to LoadGen (``FirstTokenComplete``) as soon as the step that made it returns, then
  the whole sequence (``QuerySamplesComplete``).

An engine that dies fails the run at once (``FatalEvent`` naming the replica). Options:
``LocalOptions`` (``StandaloneOptions`` is the same class): ``dispatch_chunk``, ``allow_prefix_caching``,
``gc_freeze``, ``first_token_weight``. ``run.json``: ``engines`` (each with its ``samples``),
``dispatch_chunk``, ``routing`` (policy, samples routed and answered per engine).
"""

from __future__ import annotations

from sut.base import register_sut
from sut.core.loadgen_sut import TransportSUT
from sut.core.transports.local import LocalOptions
from sut.engine import EngineSettings, check_step_budget, check_weights_present, plan_engines
from sut.errors import EngineError, InputError, RunFailed

#: The options of ``--sut vllm`` under their former name.
StandaloneOptions = LocalOptions


@register_sut("vllm")
class StandaloneSUT(TransportSUT):
    """LoadGen SUT that runs vLLM engines in local worker processes (one per device, or several)."""

    transport_name = "local"

    @classmethod
    def check_engine(cls, engine: EngineSettings) -> None:
        """``InputError`` when the engines cannot be placed here (``--device cuda`` without a GPU, more
        CPU engines than cores, a max_num_seqs above vLLM's default step budget there: ``check_step_budget``) or the
        model folder lacks the weights they would load (``check_weights_present``)."""
        try:
            check_step_budget(engine, plan_engines(engine))
            check_weights_present(engine)
        except EngineError as e:
            raise InputError(str(e)) from None


__all__ = ["LocalOptions", "RunFailed", "StandaloneOptions", "StandaloneSUT"]
