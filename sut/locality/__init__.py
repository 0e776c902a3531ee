"""Synthetic-locality traces: documents of ~8K tokens with several questions each, routed across
engine replicas with prefix-affinity routing and vLLM prefix caching ON.

THIS IS NOT AN MLPERF BENCHMARK. MLPerf forbids cross-query KV reuse, so nothing here goes
through LoadGen, no file is named ``mlperf_log_*``, every result folder name ends in
``-SYNTHETIC-LOCALITY-NOT-MLPERF`` and every result file says ``"mlperf": false``. The entry point is
``python -m sut.locality`` (never ``python -m sut run``).

Modules: ``trace`` (deterministic trace generator, shifted warm-up traces, input/trace hashes),
``news`` (documents built from CNN/DailyMail news text), ``systems`` (the systems compared: transports
of the dispatch core with their options), ``burst`` (one burst through routing x transport x ledger,
validated and measured), ``pairs`` (the study's pair protocol: fresh engines per case, warm-ups,
placement checks), ``runner`` (trace preparation, run folder, ``locality.json``, figure), ``report``
(console tables), ``study`` (validation of every request, pair report and figure), ``cli_args``
(``python -m sut.locality``'s flags and the settings read from them). Routing policies
are the dispatch core's (``sut.core.routing``).
"""

NOTICE = "synthetic-locality trace with prefix caching ON: NOT an MLPerf result"
RUN_SUFFIX = "-SYNTHETIC-LOCALITY-NOT-MLPERF"


def knob(default, help: str, **extra):  # noqa: A002 - argparse's word
    """A settings field that ``python -m sut.locality`` offers as a flag ``--name`` (``help``; extra
    metadata such as ``choices``): ``dataclasses.field(default=default, metadata={"help": help, ...})``."""
    import dataclasses

    return dataclasses.field(default=default, metadata={"help": help, **extra})
