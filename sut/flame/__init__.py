"""The Flame-batched SUT and the ``flame`` transport: requests -> batches -> tasks of Flame sessions -> vLLM.

Client side: ``options`` (``FlameOptions``), ``endpoint`` (endpoint, connect, reachability), ``session``
(application, one replica's session), ``warmup``, ``batcher``, ``tasks`` (task tracker), ``stats``, ``watch``
(task watching on one asyncio loop), ``transport`` (``FlameTransport``, registered as ``flame``), ``client``
(``FlameSUT``, registered as ``--sut flame``). Service side (``python -m sut.flame.serve``):
``service_config`` (the session's common data), ``seats``, ``hostlink`` (host <-> forwarder frames),
``engine_host``, ``service`` (``VllmBatchService``). Shared: ``payload`` (the task/result format),
``app`` + ``app.yaml`` (the Flame application), ``cluster`` (a one-host real Flame cluster) with
``cluster_config`` (its settings, ports and cluster.yaml) and ``netns`` (its network namespace, reachable from
this host's loopback only). See docs/flame.md.
"""
