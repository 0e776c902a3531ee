"""Constants of the MLPerf Llama 3.1 8B accuracy check, each with its public source.

Sources (paraphrased in ``../shared/research/mlperf_llama31_8b.md`` §1.4, §4):

- mlcommons/inference ``tools/submission/submission_checker/constants.py`` (v5.1/v6.0/v6.1
  sections, identical): ``accuracy-target`` and ``accuracy-upper-limit`` of ``llama3.1-8b``
  and ``llama3.1-8b-edge``; the 99 % ROUGE and 90 %/110 % ``gen_len`` factors.
- mlcommons/inference ``language/llama3.1-8b/README.md`` ("Accuracy Target"): the same
  reference values, produced with a BF16 GPU run.
- mlcommons/inference ``language/llama3.1-8b/evaluation.py``: ROUGE types, stemming,
  post-processing, ``gen_len`` (characters) and ``gen_num``, the printed result format.
- MLPerf inference rules, "Summarization (Llama3.1-8B) max_new_tokens 128".
- meta-llama/llama-models ``models/llama3/tokenizer.py`` and the Llama 3 model card: the
  split regex and the 256 special tokens at ids 128000..128255 (see
  ``../shared/data/llama3_tokenizer/SOURCE.md``).
- Llama-3.1-8B-Instruct ``generation_config.json``: EOS ids 128001, 128008, 128009.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

#: ROUGE types scored, in the order evaluation.py reports them (HF ``evaluate`` "rouge" defaults).
ROUGE_KEYS: tuple[str, ...] = ("rouge1", "rouge2", "rougeL", "rougeLsum")

#: Decimal places of the ROUGE values evaluation.py prints (``round(mean * 100, 4)``).
ROUGE_DECIMALS = 4

#: ROUGE must be at least this fraction of the reference (checker: 99 % variant only).
ROUGE_MIN_FRACTION = 0.99
#: ``gen_len`` must lie within these fractions of the reference (README 90 %; checker's
#: ``accuracy-upper-limit`` adds 110 %).
GEN_LEN_MIN_FRACTION = 0.90
GEN_LEN_MAX_FRACTION = 1.10

#: Maximum new tokens per sample (rules table; reference SUT ``max_tokens=128``).
MAX_NEW_TOKENS = 128

#: Dataset sizes (cnn_eval.json: CNN/DailyMail 3.0.0 validation split; edge subset).
DATACENTER_SAMPLES = 13_368
EDGE_SAMPLES = 5_000


def _ref(rouge1: float, rouge2: float, rougeL: float, rougeLsum: float, gen_len: int, gen_num: int) -> Mapping:
    return MappingProxyType(
        {"rouge1": rouge1, "rouge2": rouge2, "rougeL": rougeL, "rougeLsum": rougeLsum, "gen_len": gen_len, "gen_num": gen_num}
    )


#: Reference results (submission checker constants.py ``accuracy-target``; ROUGE ×100,
#: ``gen_len`` in characters of post-processed predictions, ``gen_num`` samples).
REFERENCES: Mapping[str, Mapping] = MappingProxyType(
    {
        "datacenter": _ref(38.7792, 15.9075, 24.4957, 35.793, 8_167_644, DATACENTER_SAMPLES),
        "edge": _ref(39.06, 16.1147, 24.6375, 36.124, 3_051_113, EDGE_SAMPLES),
    }
)

#: Llama 3 pre-tokenizer split pattern (meta-llama/llama-models ``models/llama3/tokenizer.py``).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Number of BPE ranks in the Llama 3 ``tokenizer.model``; special ids start here.
LLAMA3_NUM_BASE_TOKENS = 128_000
#: Number of special tokens (ids 128000..128255), so the vocabulary has 128,256 ids.
LLAMA3_NUM_SPECIAL_TOKENS = 256
#: Named Llama 3.1 special tokens by id; every other id in 128000..128255 is
#: ``<|reserved_special_token_K|>`` (the reserved names never affect decoding, since special
#: tokens are skipped).
LLAMA3_NAMED_SPECIALS: Mapping[int, str] = MappingProxyType(
    {
        128000: "<|begin_of_text|>",
        128001: "<|end_of_text|>",
        128004: "<|finetune_right_pad_id|>",
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128008: "<|eom_id|>",
        128009: "<|eot_id|>",
        128010: "<|python_tag|>",
    }
)
#: EOS ids of Llama-3.1-8B-Instruct (``generation_config.json`` ``eos_token_id``); the default
#: for a bare Llama 3 ``tokenizer.model`` with no ``generation_config.json`` beside it.
LLAMA31_EOS_IDS: tuple[int, ...] = (128001, 128008, 128009)

#: File names written into the output directory.
ACCURACY_JSON = "accuracy.json"
ACCURACY_TXT = "accuracy.txt"
HISTOGRAM_PNG = "output_lengths.png"

#: Exit codes of ``python -m accuracy``.
EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
#: Stopped by Ctrl-C (the shell's 128 + SIGINT), as every command of the harness.
EXIT_INTERRUPTED = 130
