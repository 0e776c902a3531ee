"""Deterministic synthetic data in the cnn_eval format, and a matching word-level tokenizer.

Used by the embedded default run (no real model or data set can be downloaded) and for
full-size (13,368-sample) pools on the GPU host.

Token-length distribution of ``tok_input`` (BOS and a 27-token stand-in for the prompt
template included): lognormal with median ``median`` (782) and shape ``sigma`` (0.44), clipped
to ``[min_len, max_len]`` = [76, 2540]. These match the published full-set CNN/DailyMail
figures (``../shared/data/README.md``: max 2,540, mean ≈ 870, median ≈ 782, p99 ≈ 2,125;
estimates digitized from a public histogram). The generator prints the achieved statistics.

Token ids are drawn uniformly from ``[1000, 120000)``, inside the Llama 3 vocabulary and below
its special tokens (128000+). The same seed always gives the same file.

The word-level tokenizer maps id ``i`` to a pronounceable pseudo-word (and back), with the
Llama 3 special tokens at their real ids, so generated ids decode to text that ROUGE can score.
It is a stand-in for pipelines that need *a* tokenizer of the Llama 3 vocabulary size; it is
not the Llama 3 tokenizer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accuracy.preflight import SYNTHETIC_INSTRUCTION
from sut.constants import LLAMA3_BOS, LLAMA3_VOCAB

log = logging.getLogger(__name__)

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_SYL = [o + v for o in _ONSETS for v in _VOWELS]  # 128 syllables

#: Llama 3 special tokens with fixed ids (Meta Llama 3 tokenizer; 128000..128255 are special).
SPECIAL_TOKENS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}


def word(i: int) -> str:
    """Pseudo-word for token id ``i`` (bijective: three base-128 syllables)."""
    a, b, c = i // (128 * 128), (i // 128) % 128, i % 128
    return _SYL[a] + _SYL[b] + _SYL[c]


@dataclass(frozen=True)
class SyntheticSettings:
    """Settings of the synthetic dataset (see module docstring for the source of each default)."""

    samples: int = 13368
    seed: int = 0
    median: float = 782.0
    sigma: float = 0.44
    min_len: int = 76
    max_len: int = 2540
    header_len: int = 28  # BOS + template stand-in (the real template costs 28 tokens)
    ref_tokens_mean: float = 43.0  # reference summary length (highlights: mean 42.6 tokens)


def make_lengths(s: SyntheticSettings) -> np.ndarray:
    """Prompt lengths in tokens, int64 array of shape ``(s.samples,)``."""
    rng = np.random.default_rng(s.seed)
    lens = rng.lognormal(np.log(s.median), s.sigma, s.samples)
    return np.clip(np.round(lens), max(s.min_len, s.header_len + 1), s.max_len).astype(np.int64)


def make_records(s: SyntheticSettings) -> list[dict]:
    """cnn_eval-format records: ``instruction``, ``input`` (text of the body ids), ``tok_input``, ``output``."""
    lens = make_lengths(s)
    rng = np.random.default_rng(s.seed + 1)
    header = [LLAMA3_BOS] + rng.integers(1000, 120000, s.header_len - 1).tolist()
    records = []
    for n in lens:
        body = rng.integers(1000, 120000, int(n) - s.header_len).tolist()
        ref_len = max(8, int(rng.normal(s.ref_tokens_mean, 12)))
        ref = rng.integers(1000, 120000, ref_len).tolist()
        records.append({
            "instruction": dict(SYNTHETIC_INSTRUCTION),
            "input": " ".join(word(t) for t in body),
            "tok_input": header + body,
            "output": " ".join(word(t) for t in ref) + ".",
        })
    return records


def write_dataset(path: str | Path, s: SyntheticSettings) -> dict:
    """Write the dataset JSON; return its prompt-length statistics."""
    recs = make_records(s)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recs, separators=(",", ":")))
    lens = np.array([len(r["tok_input"]) for r in recs])
    stats = {"samples": len(recs), "mean": float(lens.mean()), "p50": float(np.median(lens)),
             "p99": float(np.percentile(lens, 99)), "min": int(lens.min()), "max": int(lens.max())}
    log.info("wrote %s: %s", path, stats)
    return stats


def write_tokenizer(folder: str | Path, vocab_size: int = LLAMA3_VOCAB) -> Path:
    """Write a HF ``tokenizers`` word-level tokenizer of ``vocab_size`` ids into ``folder``.

    Files: ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (the EOS ids
    128001/128008/128009 of Llama 3.1, as in ``sut/models/tiny-llama3``, so that the gate scored with
    this folder alone cuts at the same EOS ids as the run). Loadable with
    ``transformers.AutoTokenizer.from_pretrained(folder)``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {SPECIAL_TOKENS.get(i) or (f"<|reserved_{i}|>" if i >= 128000 else word(i)): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[128001]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = [SPECIAL_TOKENS[i] for i in sorted(SPECIAL_TOKENS)] + [f"<|reserved_{i}|>" for i in range(128000, vocab_size) if i not in SPECIAL_TOKENS]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[128000], eos_token=SPECIAL_TOKENS[128009],
                                   unk_token=SPECIAL_TOKENS[128001])
    fast.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "do_sample": False, "eos_token_id": [128001, 128008, 128009]}))
    return folder
