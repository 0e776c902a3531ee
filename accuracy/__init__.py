"""Accuracy dev gate for MLPerf Inference Llama 3.1 8B: ROUGE + output length, offline,
from LoadGen's ``mlperf_log_accuracy.json``.

Use from code::

    from accuracy import run_gate
    result = run_gate("RUN/mlperf_log_accuracy.json", "cnn_eval.json", "MODEL_DIR", "RUN/accuracy")
    result["passed"], result["scores"], result["checks"]

or from the shell: ``python -m accuracy --accuracy-log ... --dataset ... --tokenizer ...``
(exit 0 pass, 1 fail, 2 bad input). See ``docs/accuracy.md``.
"""

from __future__ import annotations

from accuracy.errors import AccuracyInputError, PunktDataMissingError, TokenizerNotFoundError
from accuracy.gate import GateSettings, evaluate, run_gate

__all__ = [
    "AccuracyInputError",
    "GateSettings",
    "PunktDataMissingError",
    "TokenizerNotFoundError",
    "evaluate",
    "run_gate",
]
