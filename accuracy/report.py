"""Output-length statistics, the histogram PNG and the MLPerf ``accuracy.txt`` file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from accuracy.constants import MAX_NEW_TOKENS, ROUGE_KEYS

log = logging.getLogger(__name__)


def length_stats(lengths: Sequence[int], ends_in_eos: Sequence[bool], max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Generated tokens per sample (as logged, a trailing EOS included).

    Args:
        lengths: tokens per sample, shape ``(n,)``.
        ends_in_eos: whether each sample's last id is an EOS id, shape ``(n,)``.
        max_new_tokens: the cap (128).

    Returns:
        plain floats/ints: ``samples``, ``total_tokens``, ``mean``, ``p50``, ``p90``, ``min``,
        ``max``, ``at_cap_share`` and ``eos_share`` (fractions in [0, 1]), ``max_new_tokens``.
        With no samples every statistic is None.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    eos = np.asarray(ends_in_eos, dtype=bool)
    if arr.size == 0:
        return {k: None for k in ("mean", "p50", "p90", "min", "max", "at_cap_share", "eos_share")} | {
            "samples": 0, "total_tokens": 0, "max_new_tokens": int(max_new_tokens)}
    return {
        "samples": int(arr.size),
        "total_tokens": int(arr.sum()),
        "mean": round(float(arr.mean()), 3),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "min": int(arr.min()),
        "max": int(arr.max()),
        "at_cap_share": round(float((arr == max_new_tokens).mean()), 6),
        "eos_share": round(float(eos.mean()), 6),
        "max_new_tokens": int(max_new_tokens),
    }


def histogram_edges(top: int, width: int = 4) -> np.ndarray:
    """Bin edges for integer token counts 0..``top``: ``width`` counts per bin, the last bin ending at ``top + 0.5``
    (so samples at the cap sit left of the cap line drawn there, not in a bin past it)."""
    return np.arange(top + 0.5, -0.5 - width, -width)[::-1]


def write_histogram(lengths: Sequence[int], path: str | os.PathLike, max_new_tokens: int = MAX_NEW_TOKENS, title: str = "") -> Path:
    """Write a small PNG histogram of tokens per sample (matplotlib Agg canvas; no pyplot state). Drawn into
    ``PATH.tmp``, then renamed: a write cut short (a full disk, Ctrl-C) leaves no partial PNG, and an earlier one
    stays as it was."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arr = np.asarray(lengths, dtype=np.int64)
    top = max(max_new_tokens, int(arr.max()) if arr.size else 0)
    fig = Figure(figsize=(6, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(arr, bins=histogram_edges(top), color="#4c72b0", edgecolor="white", linewidth=0.4)
    ax.axvline(max_new_tokens + 0.5, color="#c44e52", linestyle="--", linewidth=1, label=f"cap {max_new_tokens}")
    ax.set_xlabel("generated tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title(title or f"{arr.size} samples", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def format_accuracy_txt(scores: dict) -> str:
    """The result block evaluation.py prints, which the submission checker greps.

    ROUGE values appear as quoted strings with 4 decimals, ``gen_len``/``gen_num`` as plain
    ints, e.g. ``{'rouge1': '38.8638', ..., 'gen_len': 3077653, 'gen_num': 5000}`` (the form of
    the NVIDIA edge sample ``accuracy.txt``). The ``hash=`` line that
    ``truncate_accuracy_log.py`` appends is not written.
    """
    parts = [f"'{k}': '{round(float(scores[k]), 4)}'" for k in ROUGE_KEYS]
    parts += [f"'gen_len': {int(scores['gen_len'])}", f"'gen_num': {int(scores['gen_num'])}"]
    return "\nResults\n\n{" + ", ".join(parts) + "}\n"


def preview(ids: Iterable, limit: int = 10) -> str:
    """``"a, b, c, ... (+n more)"`` for log lines."""
    items = list(ids)
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


#: Largest ``run.json`` read beside an accuracy log (a real one is a few hundred KB).
MAX_RUN_RECORD_BYTES = 1 << 26


def run_record_beside(accuracy_log: str | os.PathLike) -> dict | None:
    """The ``run.json`` next to ``accuracy_log`` (parsed), or None: no such file, no regular file of at most
    :data:`MAX_RUN_RECORD_BYTES` (a FIFO would block the read), unreadable, or not a JSON object."""
    from accuracy.boundedread import BoundedReadError, read_regular
    from accuracy.jsontext import parse_json

    path = Path(accuracy_log).parent / "run.json"
    try:
        rec = parse_json(read_regular(path, MAX_RUN_RECORD_BYTES).decode("utf-8"))
    except (BoundedReadError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return rec if isinstance(rec, dict) else None


def run_max_samples(accuracy_log: str | os.PathLike) -> int | None:
    """``run_settings.max_samples`` of the ``run.json`` next to ``accuracy_log`` (what ``python -m
    sut run --max-samples N`` recorded), or None: no such file, unreadable, or no positive int there."""
    try:
        value = run_record_beside(accuracy_log)["run_settings"]["max_samples"]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def suggested_max_samples(checks: dict, given: int | None, recorded: int | None) -> int | None:
    """The ``--max-samples`` value that would make a failing coverage check pass, or None.

    Args:
        checks: ``accuracy.json`` → ``checks`` (``missing``, ``unknown_qsl_idx``, ``expected_samples``).
        given: the ``--max-samples`` the gate ran with (None: the whole dataset).
        recorded: the run's own ``max_samples`` from its ``run.json`` (:func:`run_max_samples`).

    Returns:
        ``recorded`` when samples are missing or unknown and it differs from ``given``; else, with
        no ``run.json``, K when exactly the dataset's first K samples were logged (the rest missing),
        as a ``--max-samples K`` run logs them.
    """
    missing, unknown = list(checks.get("missing") or []), list(checks.get("unknown_qsl_idx") or [])
    if not missing and not unknown:
        return None
    if recorded is not None:
        return recorded if recorded != given else None
    n = int(checks.get("expected_samples") or 0)
    k = n - len(missing)
    if not unknown and 1 <= k < n and missing == list(range(k, n)):
        return k
    return None
