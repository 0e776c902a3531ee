"""MLPerf conformance for Llama 3.1 8B: the TEST06 check.

TEST06 (mlcommons/inference ``compliance/TEST06``; the only compliance test of ``llama3.1-8b``,
none for ``llama3.1-8b-edge``; research notes §5) is a short performance run with LoadGen's audit
config ``loadgen_configs/TEST06/audit.config`` (mode 2 = PerformanceOnly, about 100 responses
sampled into ``mlperf_log_accuracy.json``, ``min_query_count 100``, ``min_duration 0``, equal-issue
off). Its verification reads that log and checks, for every logged response:

1. first token (not in Offline, where it prints ``Skipped``): the ``token_data`` ids are a prefix
   of ``data``;
2. EOS: the response ends with at most one EOS id (two or more trailing EOS ids fail);
3. sample length: the number of int32 ids in ``data`` equals ``token_count``; here also: no response holds
   more ids than the run's ``max_tokens`` (``run.json`` ``generation.max_tokens``; 128, the reference's, when
   there is no record). Neither the reference ``run_verification.py`` nor the submission checker looks at
   that; a longer answer is no answer the benchmark's generation settings can give, so it fails this line.

``write_test06`` writes ``<out>/TEST06/verify_accuracy.txt`` with the same lines the reference
``run_verification.py`` writes (the submission checker greps them) and copies the log to
``<out>/TEST06/accuracy/``, in a folder renamed into place once complete (never a verdict without its log).
This check uses every EOS id of the model (Llama 3.1: 128001, 128008, 128009) where the reference takes one
``--eos_token_id``, and it also looks at the first id of a
response; it is therefore never looser than the reference. Running the reference script on the
same folder is still what a submitter should do before submitting (README).

The submission layout (``PackageSettings``, ``package``) lives in :mod:`sut.submission.scenario`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from accuracy.loadgen_log import hex_bytes, locality_folder_why
from sut.constants import DEFAULT_MODEL_KEY, LLAMA31_EOS, MAX_NEW_TOKENS
from sut.data.paths import first_missing
from sut.errors import ComplianceError
from sut.record.read import MLPERF_SCENARIOS, check_record, eos_ids, read_json, vocab_size

__all__ = ["Test06Result", "verify_run_folder", "verify_test06", "write_test06"]

log = logging.getLogger(__name__)

_INT32 = np.dtype("<i4")


# ---------------------------------------------------------------------------------------------- TEST06
@dataclass(frozen=True)
class Test06Result:
    """Outcome of the TEST06 checks on one accuracy log.

    Attributes:
        scenario: LoadGen scenario of the run (``Offline`` skips the first-token check).
        samples: logged responses checked.
        first_token: ``"True"``, ``"False"`` or ``"Skipped"`` (the reference's words).
        eos: no response ends with two or more EOS ids.
        sample_length: ``token_count`` equals the int32 id count of every response, and none holds more
            ids than the run's ``max_tokens``.
        failures: one line per failing response (``qsl_idx`` and what failed), at most 20.
    """

    __test__ = False  # not a pytest test class despite its name

    scenario: str
    samples: int
    first_token: str
    eos: bool
    sample_length: bool
    failures: tuple = ()

    @property
    def passed(self) -> bool:
        return self.first_token != "False" and self.eos and self.sample_length

    def verify_accuracy_txt(self) -> str:
        """The text of ``TEST06/verify_accuracy.txt``, line for line as the reference writes it."""
        return (f"First token check pass: {self.first_token}\n"
                f"EOS check pass: {self.eos}\n"
                f"Sample length check pass: {self.sample_length}\n"
                + ("TEST06 verification complete\n" if self.passed else "TEST06 verification failed\n"))


def _ids(hex_text: object, where: str) -> np.ndarray:
    """LoadGen's hex ``data`` as int32 token ids; ``ComplianceError`` naming ``where``."""
    raw = hex_bytes(hex_text, where, ComplianceError)
    if len(raw) % 4:
        raise ComplianceError(f"{where}: {len(raw)} bytes is not a whole number of int32 token ids")
    return np.frombuffer(raw, dtype=_INT32)


def _log_records(path: Path, scenario: str) -> list:
    """The records of a TEST06 accuracy log; ``ComplianceError`` if it is not a non-empty JSON list, ``scenario`` is
    not a LoadGen scenario, or a record has no ``seq_id`` that is a non-negative integer or repeats one (naming the
    record): LoadGen gives every logged response its own ``seq_id``."""
    records = read_json(path, "accuracy log")
    if not isinstance(records, list):
        raise ComplianceError(f"{path}: expected a JSON list of LoadGen accuracy records")
    if not records:
        raise ComplianceError(f"{path}: no responses were logged; a TEST06 run logs about 100 "
                              "(was the run made with loadgen_configs/TEST06/audit.config?)")
    if scenario not in MLPERF_SCENARIOS:
        raise ComplianceError(f"unknown scenario {scenario!r} (known: {', '.join(MLPERF_SCENARIOS)})")
    first: dict = {}
    for i, rec in enumerate(records):  # LoadGen logs a sampled response once, under its own seq_id
        if not isinstance(rec, dict):
            raise ComplianceError(f"{path}: record {i} is not a LoadGen accuracy record (a JSON object), got "
                                  f"{type(rec).__name__}")
        seq = rec.get("seq_id")
        if type(seq) is not int or seq < 0:  # without it a repeated response could not be told from a new one
            got = " has no 'seq_id'" if "seq_id" not in rec else \
                f": 'seq_id' must be a non-negative integer, got {json.dumps(seq)[:40]}"
            raise ComplianceError(f"{path}: record {i} (qsl_idx {rec.get('qsl_idx')}){got} (LoadGen gives every "
                                  "logged response its own)")
        if first.setdefault(seq, i) != i:
            raise ComplianceError(f"{path}: record {i} repeats seq_id {seq} of record {first[seq]} (LoadGen logs each "
                                  "response once: the log was edited or concatenated)")
    return records


def _trailing_eos(data: np.ndarray, eos: set[int]) -> int:
    """How many EOS ids the response ends with."""
    trailing = 0
    for t in data[::-1]:
        if int(t) not in eos:
            break
        trailing += 1
    return trailing


def _response_failures(path: Path, i: int, rec: object, eos: set[int], check_first: bool,
                       max_tokens: Optional[int] = None) -> list[tuple[str, str]]:
    """The TEST06 checks on record ``i`` of the log: one ``(check, message)`` per failed check, check
    ``"length"`` (also for more ids than ``max_tokens``, when given), ``"eos"`` or ``"first"``.
    ``ComplianceError`` for a record without ``data`` or an integer ``token_count``, or with undecodable bytes."""
    if not isinstance(rec, dict) or "data" not in rec:
        raise ComplianceError(f"{path}: record {i} has no 'data' field")
    qsl = rec.get("qsl_idx")
    where = f"{path}: record {i} (qsl_idx {qsl})"
    data = _ids(rec["data"], where)
    if "token_count" not in rec:
        raise ComplianceError(f"{where}: no 'token_count' (run LoadGen with use_token_latencies, "
                              f"as mlperf.conf does for {DEFAULT_MODEL_KEY})")
    count = rec["token_count"]
    if type(count) is not int:
        raise ComplianceError(f"{where}: 'token_count' must be an integer, got {count!r}")
    out = []
    if count != len(data):
        out.append(("length", f"qsl_idx {qsl}: token_count {count} != {len(data)} ids"))
    if max_tokens is not None and len(data) > max_tokens:
        out.append(("length", f"qsl_idx {qsl}: {len(data)} ids, more than the run's max_tokens {max_tokens}"))
    trailing = _trailing_eos(data, eos)
    if trailing >= 2:
        out.append(("eos", f"qsl_idx {qsl}: ends with {trailing} EOS ids"))
    if not check_first:
        return out
    if "token_data" not in rec:
        return out + [("first", f"qsl_idx {qsl}: no token_data (first token never reported)")]
    first = _ids(rec["token_data"], where + " token_data")
    if len(first) > len(data) or not np.array_equal(first, data[: len(first)]):
        out.append(("first", f"qsl_idx {qsl}: first-token ids are not a prefix of the response"))
    return out


def verify_test06(accuracy_log: str | Path, scenario: str, eos_token_ids: Sequence[int],
                  vocab: Optional[int] = None, eos_source: str = "EOS token ids",
                  max_tokens: Optional[int] = MAX_NEW_TOKENS) -> Test06Result:
    """Run the three TEST06 checks on a LoadGen ``mlperf_log_accuracy.json``.

    Args:
        accuracy_log: the log of the TEST06 run.
        scenario: ``Offline`` (first-token check skipped), ``Server``, ``Interactive``, ...
        eos_token_ids: the model's EOS ids (Llama 3.1: 128001, 128008, 128009), a list or tuple of ints.
        vocab: vocabulary size the EOS ids must be below (None: only int32 range).
        eos_source: where the EOS ids came from, for messages.
        max_tokens: the run's ``generation.max_tokens``: a response with more ids fails the sample length
            check (default 128, the reference's; None: not checked).

    Raises:
        ComplianceError: the file is missing, not JSON, not a list of LoadGen records, empty, or a
            record has no ``data``/``token_count``, undecodable bytes, no non-negative integer ``seq_id`` or one
            that an earlier record has (naming the record); the
            EOS ids are not a non-empty list of integers in ``[0, vocab)``.
    """
    path = Path(accuracy_log)
    records = _log_records(path, scenario)
    eos = set(eos_ids(eos_token_ids, vocab if vocab is not None else 2**31, eos_source))
    check_first = scenario != "Offline"
    found = [f for i, rec in enumerate(records)
             for f in _response_failures(path, i, rec, eos, check_first, max_tokens)]
    failed = {check for check, _ in found}
    return Test06Result(scenario=scenario, samples=len(records),
                        first_token=str("first" not in failed) if check_first else "Skipped",
                        eos="eos" not in failed, sample_length="length" not in failed,
                        failures=tuple(msg for _, msg in found[:20]))


def verify_run_folder(run_dir: str | Path, out: Optional[str | Path] = None, scenario: Optional[str] = None,
                      eos_token_ids: Optional[Sequence[int]] = None,
                      max_tokens: Optional[int] = None) -> tuple[Test06Result, Optional[Path], tuple]:
    """``python -m sut test06-verify``: the TEST06 checks on a folder's ``mlperf_log_accuracy.json``.

    Scenario, EOS ids, vocabulary size and ``max_tokens`` come from the folder's ``run.json`` (type-checked)
    unless given; without a record, Offline and Llama 3.1's EOS ids, vocabulary and the reference's 128. The result is written
    to ``<out>/TEST06/`` when ``out`` is given, else into the folder itself only if it is a TEST06
    run (``run.json`` says so) or has no ``run.json``: an accuracy or performance run folder never
    gets a ``TEST06/`` folder.

    Returns:
        ``(result, TEST06 folder written or None, EOS ids used)``.

    Raises:
        ComplianceError: ``run_dir`` (or ``out``) is a ``python -m sut.locality`` folder (no MLPerf run), a bad
            ``run.json`` field, bad EOS ids (negative, outside the vocabulary, not a list of integers), or a bad
            accuracy log (naming the record).
        OSError: the result cannot be written (nothing of it is left: :func:`write_test06`).
    """
    if out is not None and not str(out).strip():  # '' would be taken for no --out (the run folder)
        raise ComplianceError(f"--out {str(out)!r}: an empty path; leave --out out to write into the run folder")
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ComplianceError(f"{run_dir} is not a folder: pass the run folder that holds mlperf_log_accuracy.json")
    for flag, folder in (("", run_dir), ("--out ", out)):
        why = locality_folder_why(Path(folder)) if folder is not None else None
        if why:
            raise ComplianceError(f"{flag}{folder} {why}")
    # a FIFO or folder named run.json is a record read_json refuses, never taken for "no record"
    has_record = (run_dir / "run.json").exists() or (run_dir / "run.json").is_symlink()
    rec = check_record(read_json(run_dir / "run.json", "run record"), run_dir / "run.json") if has_record else {}
    vocab = vocab_size(rec)
    if eos_token_ids is not None:
        source = "--eos-token-ids"
    elif (rec.get("model") or {}).get("eos_token_ids") is not None:
        eos_token_ids, source = rec["model"]["eos_token_ids"], f"{run_dir / 'run.json'} model.eos_token_ids"
    else:
        eos_token_ids, source = list(LLAMA31_EOS), "Llama 3.1's default"
    eos = eos_ids(eos_token_ids, vocab, source)
    if max_tokens is None:
        max_tokens = (rec.get("generation") or {}).get("max_tokens") or MAX_NEW_TOKENS
    res = verify_test06(run_dir / "mlperf_log_accuracy.json", scenario or rec.get("scenario") or "Offline", eos, vocab,
                        source, max_tokens)
    is_test06 = (rec.get("run_settings") or {}).get("compliance_test") == "TEST06"
    if out is None and has_record and not is_test06:
        log.warning("%s is not a TEST06 run (run.json has no compliance_test TEST06): TEST06/verify_accuracy.txt is "
                    "not written into it; pass --out DIR to write the result elsewhere", run_dir)
        return res, None, eos
    return res, write_test06(res, run_dir / "mlperf_log_accuracy.json", out or run_dir), eos


def write_test06(result: Test06Result, accuracy_log: str | Path, out_dir: str | Path) -> Path:
    """Write ``<out_dir>/TEST06/verify_accuracy.txt`` and copy the log to ``<out_dir>/TEST06/accuracy/``, as one step.

    The folder is built beside its place (``<out_dir>/.TEST06.partial-*``) and renamed to ``TEST06`` once both files
    are written; an earlier ``TEST06/`` is replaced. On any failure (a full disk, Ctrl-C) the build folder is removed,
    an earlier ``TEST06/`` is left as it was, and so is no verdict without its log; ``out_dir`` and the parents this
    call created are removed again.

    Returns:
        the ``TEST06`` folder.

    Raises:
        OSError: a folder or file cannot be written, or the log cannot be read.
    """
    out = Path(out_dir)
    made = first_missing(out)
    stage = out / f".TEST06.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (stage / "accuracy").mkdir(parents=True)  # mkdir, not mkdtemp: the umask's permissions
        (stage / "verify_accuracy.txt").write_text(result.verify_accuracy_txt())
        shutil.copy2(accuracy_log, stage / "accuracy" / "mlperf_log_accuracy.json")
        _replace_folder(stage, out / "TEST06")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if made is not None:  # every file under it is this call's
            shutil.rmtree(made, ignore_errors=True)
        raise
    return out / "TEST06"


def _replace_folder(new: Path, dest: Path) -> None:
    """Rename ``new`` to ``dest``; an existing ``dest`` is first renamed aside, then removed (put back when the rename
    of ``new`` fails)."""
    if not dest.exists() and not dest.is_symlink():
        os.rename(new, dest)
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def test06_record(rs, model, run_dir: Path, max_tokens: int) -> dict:
    """TEST06 checks on this run's sampled accuracy log (``max_tokens``: the run's, no answer may be longer);
    writes ``<run>/TEST06/``."""
    acc_log = run_dir / "mlperf_log_accuracy.json"
    try:
        res = verify_test06(acc_log, rs.scenario, model.eos_token_ids, max_tokens=max_tokens)
    except ComplianceError as e:
        return {"passed": False, "error": str(e), "verify_accuracy": None}
    write_test06(res, acc_log, run_dir)
    log.info("TEST06 on %d logged responses: %s", res.samples, res.verify_accuracy_txt().replace("\n", "; "))
    return {"passed": res.passed, "samples": res.samples, "eos_token_ids": list(model.eos_token_ids),
            "verify_accuracy": res.verify_accuracy_txt(), "failures": list(res.failures),
            "folder": str(run_dir / "TEST06")}
