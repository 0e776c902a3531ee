"""The dispatch core: one path from a request to an engine replica and back, for every SUT.

Layers (``docs/architecture.md`` draws them):

* ``sut.messages``: the typed records that cross the layers (``Request``, ``Completion``,
  ``FirstToken``, ``FatalEvent``, ``ReplicaRecord``).
* ``sut.core.transport``: the one ``Transport`` interface (start / submit / results / stats /
  stop) and the factory ``make_transport(name, spec)``. Implementations: ``local`` (in-process
  vLLM workers, ``sut.core.transports.local``), ``flame`` (batches as tasks of Flame sessions,
  ``sut.flame.transport``), ``http`` (running ``vllm serve`` OpenAI-compatible servers,
  ``sut.core.transports.http``).
* ``sut.core.routing``: routing policies (``round_robin``, ``least_loaded``, ``least_pending``,
  ``prefix_affinity``): one interface, one file per policy; the policy keeps the load.
* ``sut.core.guard``: the one prefix-caching guard, called wherever an engine becomes ready.
* ``sut.core.dispatcher``: ``Dispatcher`` = routing x transport x ledger (``sut.ledger.sample``): every
  request answered exactly once, unknown or duplicate = fatal, a fatal event answers every
  outstanding request.
* ``sut.core.loadgen_sut``: ``TransportSUT``, the LoadGen SUT over a dispatcher (``--sut vllm``,
  ``--sut flame``, ``--sut vllm-http``).
"""
