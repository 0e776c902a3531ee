"""MLPerf conformance for Llama 3.1 8B: the TEST06 check and the submission folder layout.

TEST06 (mlcommons/inference ``compliance/TEST06``; the only compliance test of ``llama3.1-8b``,
none for ``llama3.1-8b-edge``; research notes §5) is a short performance run with LoadGen's audit
config ``loadgen_configs/TEST06/audit.config`` (mode 2 = PerformanceOnly, about 100 responses
sampled into ``mlperf_log_accuracy.json``, ``min_query_count 100``, ``min_duration 0``, equal-issue
off). Its verification reads that log and checks, for every logged response:

1. first token (not in Offline, where it prints ``Skipped``): the ``token_data`` ids are a prefix
   of ``data``;
2. EOS: the response ends with at most one EOS id (two or more trailing EOS ids fail);
3. sample length: the number of int32 ids in ``data`` equals ``token_count``.

``write_test06`` writes ``<out>/TEST06/verify_accuracy.txt`` with the same lines the reference
``run_verification.py`` writes (the submission checker greps them) and copies the log to
``<out>/TEST06/accuracy/``. This check uses every EOS id of the model (Llama 3.1: 128001, 128008,
128009) where the reference takes one ``--eos_token_id``, and it also looks at the first id of a
response; it is therefore never looser than the reference. Running the reference script on the
same folder is still what a submitter should do before submitting (README).

``package`` lays out finished runs the way the submission checker (v6.0+) reads them::

    <out>/<division>/<submitter>/results/<system>/<benchmark>/Offline/
        performance/run_1/{mlperf_log_summary.txt, mlperf_log_detail.txt}
        accuracy/{mlperf_log_summary.txt, mlperf_log_detail.txt, mlperf_log_accuracy.json, accuracy.txt}
        TEST06/{verify_accuracy.txt, accuracy/mlperf_log_accuracy.json}
        user.conf, measurements.json, README.md

(``tools/submission/submission_checker/constants.py``: ``PERFORMANCE_LOG_PATH``,
``ACCURACY_RESULT_PATH``, ``TEST06_ACC_PATH``, ``MEASUREMENTS_PATH``, ``REQUIRED_MEASURE_FILES``,
``SYSTEM_IMP_REQUIRED_FILES``.) It refuses runs that failed, are not compliant, did not pass the
accuracy gate or TEST06, or were made with different engine, generation, model or dataset
settings, naming the run and the field. It does not write ``systems/<system>.json``, the
``hash=`` line of ``accuracy.txt`` or the truncated accuracy log: the official
``truncate_accuracy_log.py`` and the submission checker do that on the whole tree.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from accuracy.loadgen_log import hex_bytes
from sut.constants import LLAMA31_EOS
from sut.records import (MLPERF_SCENARIOS, READ_BACK_SETTINGS, ComplianceError, check_record, engines_used, eos_ids,
                         read_json, vocab_size)
from sut.submission_files import measurements, readme

__all__ = ["COMPLIANCE_TESTS", "MLPERF_SCENARIOS", "TEST06_AUDIT_CONFIG", "ComplianceError", "PackageSettings",
           "Test06Result", "check_record", "package", "read_json", "verify_run_folder", "verify_test06", "write_test06"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
#: The TEST06 audit config shipped with the harness (values: mlcommons/inference compliance/TEST06/audit.config).
TEST06_AUDIT_CONFIG = REPO / "loadgen_configs" / "TEST06" / "audit.config"
#: Compliance tests the harness can run (mlcommons/inference compliance/README.md: llama3.1-8b → TEST06).
COMPLIANCE_TESTS = ("TEST06",)
#: LoadGen model key → benchmark folder name of the submission tree (submission_checker constants.py).
#: The Interactive scenario (model key ``llama3_1-8b-interactive``) is the folder ``Interactive`` of ``llama3.1-8b``.
BENCHMARK_NAMES = {"llama3_1-8b": "llama3.1-8b", "llama3_1-8b-interactive": "llama3.1-8b",
                   "llama3_1-8b-edge": "llama3.1-8b-edge"}
#: Benchmarks that need TEST06 (submission_checker constants.py ``models_TEST06``).
NEEDS_TEST06 = ("llama3.1-8b",)
#: Fields ``measurements.json`` must carry (submission_checker constants.py ``SYSTEM_IMP_REQUIRED_FILES``).
MEASUREMENT_FIELDS = ("input_data_types", "retraining", "starting_weights_filename", "weight_data_types",
                      "weight_transformations")
DIVISIONS = ("closed", "open")

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
        sample_length: ``token_count`` equals the int32 id count of every response.
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


def verify_test06(accuracy_log: str | Path, scenario: str, eos_token_ids: Sequence[int],
                  vocab: Optional[int] = None, eos_source: str = "EOS token ids") -> Test06Result:
    """Run the three TEST06 checks on a LoadGen ``mlperf_log_accuracy.json``.

    Args:
        accuracy_log: the log of the TEST06 run.
        scenario: ``Offline`` (first-token check skipped), ``Server``, ``Interactive``, ...
        eos_token_ids: the model's EOS ids (Llama 3.1: 128001, 128008, 128009), a list or tuple of ints.
        vocab: vocabulary size the EOS ids must be below (None: only int32 range).
        eos_source: where the EOS ids came from, for messages.

    Raises:
        ComplianceError: the file is missing, not JSON, not a list of LoadGen records, empty, or a
            record has no ``data``/``token_count`` or undecodable bytes (naming the record); the
            EOS ids are not a non-empty list of integers in ``[0, vocab)``.
    """
    path = Path(accuracy_log)
    records = read_json(path, "accuracy log")
    if not isinstance(records, list):
        raise ComplianceError(f"{path}: expected a JSON list of LoadGen accuracy records")
    if not records:
        raise ComplianceError(f"{path}: no responses were logged; a TEST06 run logs about 100 "
                              "(was the run made with loadgen_configs/TEST06/audit.config?)")
    if scenario not in MLPERF_SCENARIOS:
        raise ComplianceError(f"unknown scenario {scenario!r} (known: {', '.join(MLPERF_SCENARIOS)})")
    eos = set(eos_ids(eos_token_ids, vocab if vocab is not None else 2**31, eos_source))
    check_first = scenario != "Offline"
    first_ok = eos_ok = len_ok = True
    failures: list[str] = []

    def fail(msg: str) -> None:
        if len(failures) < 20:
            failures.append(msg)

    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "data" not in rec:
            raise ComplianceError(f"{path}: record {i} has no 'data' field")
        where = f"{path}: record {i} (qsl_idx {rec.get('qsl_idx')})"
        data = _ids(rec["data"], where)
        if "token_count" not in rec:
            raise ComplianceError(f"{where}: no 'token_count' (run LoadGen with use_token_latencies, "
                                  "as mlperf.conf does for llama3_1-8b)")
        count = rec["token_count"]
        if type(count) is not int:
            raise ComplianceError(f"{where}: 'token_count' must be an integer, got {count!r}")
        if count != len(data):
            len_ok = False
            fail(f"qsl_idx {rec.get('qsl_idx')}: token_count {rec['token_count']} != {len(data)} ids")
        trailing = 0
        for t in data[::-1]:
            if int(t) not in eos:
                break
            trailing += 1
        if trailing >= 2:
            eos_ok = False
            fail(f"qsl_idx {rec.get('qsl_idx')}: ends with {trailing} EOS ids")
        if check_first:
            if "token_data" not in rec:
                first_ok = False
                fail(f"qsl_idx {rec.get('qsl_idx')}: no token_data (first token never reported)")
                continue
            first = _ids(rec["token_data"], where + " token_data")
            if len(first) > len(data) or not np.array_equal(first, data[: len(first)]):
                first_ok = False
                fail(f"qsl_idx {rec.get('qsl_idx')}: first-token ids are not a prefix of the response")
    return Test06Result(scenario=scenario, samples=len(records),
                        first_token=str(first_ok) if check_first else "Skipped",
                        eos=eos_ok, sample_length=len_ok, failures=tuple(failures))


def verify_run_folder(run_dir: str | Path, out: Optional[str | Path] = None, scenario: Optional[str] = None,
                      eos_token_ids: Optional[Sequence[int]] = None) -> tuple[Test06Result, Optional[Path], tuple]:
    """``python -m sut test06-verify``: the TEST06 checks on a folder's ``mlperf_log_accuracy.json``.

    Scenario, EOS ids and vocabulary size come from the folder's ``run.json`` (type-checked) unless
    given; without a record, Offline and Llama 3.1's EOS ids and vocabulary. The result is written
    to ``<out>/TEST06/`` when ``out`` is given, else into the folder itself only if it is a TEST06
    run (``run.json`` says so) or has no ``run.json``: an accuracy or performance run folder never
    gets a ``TEST06/`` folder.

    Returns:
        ``(result, TEST06 folder written or None, EOS ids used)``.

    Raises:
        ComplianceError: a bad ``run.json`` field, bad EOS ids (negative, outside the vocabulary,
            not a list of integers), or a bad accuracy log (naming the record).
        OSError: the result cannot be written.
    """
    run_dir = Path(run_dir)
    has_record = (run_dir / "run.json").is_file()
    rec = check_record(read_json(run_dir / "run.json", "run record"), run_dir / "run.json") if has_record else {}
    vocab = vocab_size(rec)
    if eos_token_ids is not None:
        source = "--eos-token-ids"
    elif (rec.get("model") or {}).get("eos_token_ids") is not None:
        eos_token_ids, source = rec["model"]["eos_token_ids"], f"{run_dir / 'run.json'} model.eos_token_ids"
    else:
        eos_token_ids, source = list(LLAMA31_EOS), "Llama 3.1's default"
    eos = eos_ids(eos_token_ids, vocab, source)
    res = verify_test06(run_dir / "mlperf_log_accuracy.json", scenario or rec.get("scenario") or "Offline", eos, vocab,
                        source)
    is_test06 = (rec.get("run_settings") or {}).get("compliance_test") == "TEST06"
    if out is None and has_record and not is_test06:
        log.warning("%s is not a TEST06 run (run.json has no compliance_test TEST06): TEST06/verify_accuracy.txt is "
                    "not written into it; pass --out DIR to write the result elsewhere", run_dir)
        return res, None, eos
    return res, write_test06(res, run_dir / "mlperf_log_accuracy.json", out or run_dir), eos


def write_test06(result: Test06Result, accuracy_log: str | Path, out_dir: str | Path) -> Path:
    """Write ``<out_dir>/TEST06/verify_accuracy.txt`` and copy the log to ``<out_dir>/TEST06/accuracy/``.

    Returns the ``TEST06`` folder.
    """
    d = Path(out_dir) / "TEST06"
    (d / "accuracy").mkdir(parents=True, exist_ok=True)
    (d / "verify_accuracy.txt").write_text(result.verify_accuracy_txt())
    shutil.copy2(accuracy_log, d / "accuracy" / "mlperf_log_accuracy.json")
    return d


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class PackageSettings:
    """A request to lay out finished runs as a submission tree.

    Attributes:
        out: root folder of the tree (created; an existing scenario folder is refused).
        system: system name, e.g. ``1xH200_vllm`` (the ``systems/<system>.json`` you write yourself).
        submitter: organisation name.
        performance_run: run folder of the 600 s+ performance run (``run.json`` inside).
        accuracy_run: run folder of the accuracy run (gate passed).
        test06_run: run folder of the TEST06 run (``--compliance-test TEST06``); required for
            ``llama3.1-8b``.
        division: ``closed`` or ``open`` (open needs no TEST06).
        allow_noncompliant: lay out runs marked not compliant, or an accuracy run whose gate failed
            (dummy weights), anyway — to rehearse the layout with dev runs; the tree then holds
            ``NOT-COMPLIANT.txt`` listing every reason; an INVALID performance result too (a short
            Server/Interactive dev run cannot pass LoadGen's early stopping). Failed runs,
            LoadGen errors, a failed TEST06 and mismatched settings are refused regardless.
    """

    out: str
    system: str
    submitter: str
    performance_run: str
    accuracy_run: str
    test06_run: Optional[str] = None
    division: str = "closed"
    allow_noncompliant: bool = False

    def __post_init__(self):
        if self.division not in DIVISIONS:
            raise ValueError(f"division must be one of {DIVISIONS}, got {self.division!r}")
        for name in ("system", "submitter"):
            v = getattr(self, name)
            if not v or "/" in v or v.startswith("."):
                raise ValueError(f"{name} must be a plain folder name, got {v!r}")


def _gate_result_ok(gate: object) -> bool:
    """A gate result as ``accuracy/gate.py`` writes it: a bool ``passed`` and a per-metric ``verdict``
    ({"ok": bool, ...}); ``passed`` true needs a non-empty verdict with every metric ok."""
    if not isinstance(gate, dict):
        return False
    verdict = gate.get("verdict")
    if not isinstance(gate.get("passed"), bool) or not isinstance(verdict, dict):
        return False
    if not all(isinstance(v, dict) and isinstance(v.get("ok"), bool) for v in verdict.values()):
        return False
    return not gate["passed"] or (bool(verdict) and all(v["ok"] for v in verdict.values()))


def _invalid_why(perf: dict) -> str:
    """Which of LoadGen's checks an INVALID run failed, from its record."""
    lg = perf.get("loadgen") or {}
    failed = [name for key, name in (("result_min_duration_met", "min duration"), ("result_min_queries_met", "min queries"),
                                     ("result_perf_constraints_met", "latency constraints"),
                                     ("early_stopping_met", "early stopping")) if lg.get(key) is False]
    return ", ".join(failed) or "see its mlperf_log_summary.txt"


def _load_run(folder: str, role: str) -> tuple[Path, dict]:
    d = Path(folder)
    rec = check_record(read_json(d / "run.json", f"{role} run:"), d / "run.json")
    if rec.get("status") != "ok":
        raise ComplianceError(f"{role} run {d}: status is {rec.get('status')!r}"
                              + (f" ({rec['error']})" if rec.get("error") else "") + ", not 'ok'")
    return d, rec


def _need(d: Path, names: Sequence[str], role: str) -> None:
    for n in names:
        if not (d / n).is_file() or (d / n).stat().st_size == 0:
            raise ComplianceError(f"{role} run {d}: {n} is missing or empty")


def _same(a: dict, b: dict, role: str, field: str, ignore: Sequence[str] = ()) -> None:
    va = {k: v for k, v in (a.get(field) or {}).items() if k not in ignore}
    vb = {k: v for k, v in (b.get(field) or {}).items() if k not in ignore}
    diff = sorted(k for k in set(va) | set(vb) if va.get(k) != vb.get(k))
    if diff:
        raise ComplianceError(f"{role} run differs from the performance run in {field}: "
                              + ", ".join(f"{k} {va.get(k)!r} vs {vb.get(k)!r}" for k in diff))


def _same_engine(perf: dict, rec: dict, role: str) -> None:
    """Compare the engine that really ran (the engines' read-back records) where both runs have one, and the
    requested engine settings that nothing reads back; else the requested settings (models by config hash)."""
    used_p, used_r = engines_used(perf), engines_used(rec)
    if used_p is None or used_r is None:
        _same(perf, rec, role, "engine_settings", ignore=("model",))
        return
    on_cpu = any(d.get("kind") == "cpu" for d, _ in used_p["devices"] + used_r["devices"])
    _same(perf, rec, role, "engine_settings", ignore=READ_BACK_SETTINGS + (() if on_cpu else ("cpu_kvcache_gib",)))

    def flat(used: dict) -> dict:
        out = {k: v for k, v in used.items() if k != "engine_args"}
        if len(used["engine_args"]) == 1:
            out.update({f"engine_args.{k}": v for k, v in used["engine_args"][0].items()})
        else:
            out["engine_args"] = used["engine_args"]
        return out

    key = "the engines it ran (read back)"
    _same({key: flat(used_p)}, {key: flat(used_r)}, role, key)


def package(ps: PackageSettings) -> Path:
    """Copy the runs into the submission layout and return the scenario folder.

    Raises:
        ComplianceError: a run is missing, failed, not compliant (unless ``allow_noncompliant``),
            in the wrong mode, did not pass its check, or differs from the performance run in
            engine/generation/model/dataset settings; the scenario folder already exists.
    """
    problems: list[str] = []
    pdir, perf = _load_run(ps.performance_run, "performance")
    adir, acc = _load_run(ps.accuracy_run, "accuracy")
    key = perf.get("model_key")
    if key not in BENCHMARK_NAMES:
        raise ComplianceError(f"performance run {pdir}: model key {key!r} has no benchmark folder "
                              f"(known: {', '.join(BENCHMARK_NAMES)})")
    bench = BENCHMARK_NAMES[key]
    scenario = perf.get("scenario") or "Offline"

    # Stage 1: each run is what its role needs.
    if perf.get("mode") != "performance":
        raise ComplianceError(f"performance run {pdir}: mode is {perf.get('mode')!r}")
    if perf.get("run_settings", {}).get("compliance_test") or perf.get("run_settings", {}).get("audit_config"):
        raise ComplianceError(f"performance run {pdir}: made with an audit config (a compliance test run)")
    if perf.get("validity") != "VALID":
        if not ps.allow_noncompliant or perf.get("validity") != "INVALID":
            raise ComplianceError(f"performance run {pdir}: LoadGen result is {perf.get('validity')!r}, not VALID")
        problems.append(f"performance run: LoadGen result is INVALID ({_invalid_why(perf)})")
    if acc.get("mode") != "accuracy":
        raise ComplianceError(f"accuracy run {adir}: mode is {acc.get('mode')!r}")
    gate = acc.get("accuracy")
    if (adir / "accuracy.json").is_file():  # the gate's own file: also fresh after a re-score with python -m accuracy
        gate = read_json(adir / "accuracy.json", "accuracy run: gate result")
        if not _gate_result_ok(gate):
            raise ComplianceError(f"accuracy run {adir}: accuracy.json is not a result the accuracy gate writes: it "
                                  "needs 'passed' (true/false) and a per-metric 'verdict' that agrees with it")
    elif gate and "passed" in gate:
        raise ComplianceError(f"accuracy run {adir}: run.json records a gate result but accuracy.json (the gate's "
                              "scores and verdict) is missing; re-score with python -m accuracy")
    if not gate:
        problems.append("accuracy run: no accuracy gate result in run.json (run with the gate, or score it with "
                        "python -m accuracy)")
    elif not gate.get("passed"):
        why = gate.get("skipped") or gate.get("reasons") or gate.get("scores")
        problems.append(f"accuracy run: the accuracy gate did not pass ({why})")
    for d, rec, role in ((pdir, perf, "performance"), (adir, acc, "accuracy")):
        if (rec.get("loadgen") or {}).get("errors"):
            raise ComplianceError(f"{role} run {d}: LoadGen logged {rec['loadgen']['errors']} error(s) "
                                  "(the submission checker rejects them)")
        if not (rec.get("compliance") or {}).get("compliant"):
            problems += [f"{role} run: {r}" for r in (rec.get("compliance") or {}).get("reasons") or
                         ["run.json does not record it as compliant"]]
    _need(pdir, ("mlperf_log_summary.txt", "mlperf_log_detail.txt"), "performance")
    _need(adir, ("mlperf_log_summary.txt", "mlperf_log_detail.txt", "mlperf_log_accuracy.json", "accuracy.txt"),
          "accuracy")
    from accuracy.errors import AccuracyInputError
    from accuracy.loadgen_log import read_accuracy_log

    try:
        read_accuracy_log(adir / "mlperf_log_accuracy.json")
    except AccuracyInputError as e:
        raise ComplianceError(f"accuracy run {adir}: {e}") from None

    tdir = t06 = t06_result = None
    if ps.test06_run:
        tdir, t06 = _load_run(ps.test06_run, "TEST06")
        if (t06.get("run_settings") or {}).get("compliance_test") != "TEST06":
            raise ComplianceError(f"TEST06 run {tdir}: not made with --compliance-test TEST06")
        if (t06.get("loadgen") or {}).get("errors"):
            raise ComplianceError(f"TEST06 run {tdir}: LoadGen logged {t06['loadgen']['errors']} error(s) "
                                  "(the submission checker rejects them)")
        # Re-check the log itself: run.json or TEST06/ may be stale or edited.
        eos = (t06.get("model") or {}).get("eos_token_ids") or (t06.get("test06") or {}).get("eos_token_ids")
        if not eos:
            raise ComplianceError(f"TEST06 run {tdir}: run.json has no model eos_token_ids for the EOS check")
        t06_result = verify_test06(tdir / "mlperf_log_accuracy.json", t06.get("scenario") or "Offline", eos,
                                   vocab_size(t06), f"TEST06 run {tdir}: run.json eos_token_ids")
        if not t06_result.passed:
            raise ComplianceError(f"TEST06 run {tdir}: verification fails on its mlperf_log_accuracy.json: "
                                  + t06_result.verify_accuracy_txt().replace("\n", "; ")
                                  + " ".join(t06_result.failures[:3]))
        problems += [f"TEST06 run: {r}" for r in (t06.get("compliance") or {}).get("reasons", [])
                     if not r.startswith("audit config")]
    elif ps.division == "closed" and bench in NEEDS_TEST06:
        raise ComplianceError(f"closed-division {bench} needs a TEST06 run (--test06 RUN_FOLDER; make it with "
                              "python -m sut run ... --compliance-test TEST06)")

    # Stage 2: all runs describe the same system.
    others = [(acc, "accuracy")] + ([(t06, "TEST06")] if t06 else [])
    for rec, role in others:
        for f in ("sut", "scenario", "model_key"):
            if rec.get(f) != perf.get(f):
                raise ComplianceError(f"{role} run differs from the performance run in {f}: "
                                      f"{rec.get(f)!r} vs {perf.get(f)!r}")
        _same_engine(perf, rec, role)
        _same(perf, rec, role, "generation")
        _same(perf, rec, role, "model", ignore=("path",))
        _same(perf, rec, role, "dataset", ignore=("path", "prompt_tokens"))
        _same(perf, rec, role, "options", ignore=("app_workdir", "session_id"))

    if problems and not ps.allow_noncompliant:
        raise ComplianceError("not compliant (pass --allow-noncompliant only to rehearse the layout):\n  "
                              + "\n  ".join(problems))

    # Stage 3: copy.
    root = Path(ps.out) / ps.division / ps.submitter / "results" / ps.system / bench / scenario
    if root.exists():
        raise ComplianceError(f"{root} already exists; give another --out or remove it")
    (root / "performance" / "run_1").mkdir(parents=True)
    for n in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
        shutil.copy2(pdir / n, root / "performance" / "run_1" / n)
    (root / "accuracy").mkdir()
    for n in ("mlperf_log_summary.txt", "mlperf_log_detail.txt", "mlperf_log_accuracy.json", "accuracy.txt"):
        shutil.copy2(adir / n, root / "accuracy" / n)
    if tdir is not None:
        write_test06(t06_result, tdir / "mlperf_log_accuracy.json", root)
    user_conf = pdir / "user.conf"
    if not user_conf.is_file():
        user_conf = Path((perf.get("run_settings") or {}).get("user_conf") or "")
        if not user_conf.is_file():
            raise ComplianceError(f"performance run {pdir}: its user.conf was not kept in the run folder and "
                                  f"{user_conf} does not exist any more")
    shutil.copy2(user_conf, root / "user.conf")
    (root / "measurements.json").write_text(json.dumps(measurements(perf), indent=2) + "\n")
    (root / "README.md").write_text(readme(ps.system, perf, acc, t06, bench, scenario))
    if problems:
        (root / "NOT-COMPLIANT.txt").write_text("These runs are not compliant; this tree is a rehearsal:\n"
                                                + "".join(f"- {p}\n" for p in problems))
        log.warning("laid out NON-COMPLIANT runs (rehearsal): %s", "; ".join(problems))
    log.info("submission layout written: %s", root)
    return root
