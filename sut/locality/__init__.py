"""Synthetic-locality traces: documents of ~8K tokens with several questions each, routed across
engine replicas with prefix-affinity routing and vLLM prefix caching ON.

THIS IS NOT AN MLPERF BENCHMARK. MLPerf forbids cross-query KV reuse, so nothing here goes
through LoadGen, no file is named ``mlperf_log_*``, every result folder name ends in
``-SYNTHETIC-LOCALITY-NOT-MLPERF`` and every result file says ``"mlperf": false``. The entry point is
``python -m sut.locality`` (never ``python -m sut run``).

Modules: ``trace`` (deterministic trace generator, shifted warm-up traces, input/trace hashes),
``news`` (documents built from CNN/DailyMail news text), ``router`` (routing policies by name),
``runner`` (drives an engine pool with a policy and measures it), ``report`` (console tables),
``study`` (the study's validation of every request, pair report and figure).
"""

NOTICE = "synthetic-locality trace with prefix caching ON: NOT an MLPerf result"
RUN_SUFFIX = "-SYNTHETIC-LOCALITY-NOT-MLPERF"
