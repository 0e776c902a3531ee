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

_GATE = ("GateSettings", "evaluate", "run_gate")


def __getattr__(name: str):
    """The gate's names, imported on first use (``python -m accuracy`` checks its dependencies before numpy loads)."""
    if name in _GATE:
        from accuracy import gate

        return getattr(gate, name)
    raise AttributeError(f"module 'accuracy' has no attribute {name!r}")

__all__ = [
    "AccuracyInputError",
    "GateSettings",
    "PunktDataMissingError",
    "TokenizerNotFoundError",
    "evaluate",
    "run_gate",
]
