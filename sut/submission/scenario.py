"""One scenario of a submission tree: check a system's performance, accuracy and TEST06 runs, copy them.

:func:`package` lays finished runs out the way the submission checker (v6.0+) reads them::

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

:func:`lay_out_scenario` does the same but leaves the rehearsal note (``NOT-COMPLIANT.txt``) to
its caller: ``sut.submission.tree`` writes ONE note for the whole tree (:func:`write_not_compliant`).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from accuracy.loadgen_log import locality_folder_why
from accuracy.reference import gen_len_reason
from sut.constants import DEFAULT_MODEL_KEY, EDGE_MODEL_KEY, INTERACTIVE_MODEL_KEY, MAX_NEW_TOKENS
from sut.errors import ComplianceError
from sut.record.read import check_record, invalid_why, read_json, vocab_size
from sut.record.test06 import Test06Result, verify_test06, write_test06
from sut.submission.files import measurements, readme
from sut.submission.logs import check_accuracy_log_complete, check_logs_agree, gate_input_problems
from sut.submission.same_system import check_same_system, check_same_user_conf, kept_user_conf

log = logging.getLogger(__name__)

#: LoadGen model key → benchmark folder name of the submission tree (submission_checker constants.py).
#: The Interactive scenario (model key ``llama3_1-8b-interactive``) is the folder ``Interactive`` of ``llama3.1-8b``.
BENCHMARK_NAMES = {DEFAULT_MODEL_KEY: "llama3.1-8b", INTERACTIVE_MODEL_KEY: "llama3.1-8b",
                   EDGE_MODEL_KEY: "llama3.1-8b-edge"}
#: Benchmarks that need TEST06 (submission_checker constants.py ``models_TEST06``).
NEEDS_TEST06 = ("llama3.1-8b",)
#: Fields ``measurements.json`` must carry (submission_checker constants.py ``SYSTEM_IMP_REQUIRED_FILES``).
MEASUREMENT_FIELDS = ("input_data_types", "retraining", "starting_weights_filename", "weight_data_types",
                      "weight_transformations")
DIVISIONS = ("closed", "open")
#: The rehearsal note's name and first line (one note per tree, see :func:`write_not_compliant`).
NOT_COMPLIANT_TXT = "NOT-COMPLIANT.txt"
NOT_COMPLIANT_HEAD = "These runs are not compliant; this tree is a rehearsal:\n"
PERF_LOGS = ("mlperf_log_summary.txt", "mlperf_log_detail.txt")
ACC_FILES = PERF_LOGS + ("mlperf_log_accuracy.json", "accuracy.txt")
#: The files each role's run folder must hold besides ``run.json`` and its user.conf: the logs the tree copies,
#: and those of a TEST06 run that are checked again (its scenario, its responses).
RUN_FILES = {"performance": PERF_LOGS, "accuracy": ACC_FILES,
             "TEST06": ("mlperf_log_detail.txt", "mlperf_log_accuracy.json")}


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


@dataclass(frozen=True)
class Run:
    """One run folder and its type-checked ``run.json``."""

    folder: Path
    rec: dict


@dataclass(frozen=True)
class ScenarioRuns:
    """The checked runs of one scenario (:func:`check_scenario`).

    Attributes:
        perf, acc: the performance and accuracy runs.
        t06: the TEST06 run, or None (open division, or a benchmark without TEST06).
        t06_result: the TEST06 checks re-run on ``t06``'s log, or None.
        bench: benchmark folder name (``llama3.1-8b``); scenario: ``Offline``, ``Server``, ...
        problems: why the runs are not compliant (empty: compliant), one line each.
    """

    perf: Run
    acc: Run
    t06: Optional[Run]
    t06_result: Optional[Test06Result]
    bench: str
    scenario: str
    problems: tuple[str, ...]


@dataclass(frozen=True)
class LaidOut:
    """A scenario folder written by :func:`lay_out_scenario` and the problems of its runs (empty: compliant)."""

    root: Path
    problems: tuple[str, ...]


# ---------------------------------------------------------------------------------------------- checks
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


def _load_run(folder: str, role: str) -> Run:
    d = Path(folder)
    why = locality_folder_why(d)
    if why:
        raise ComplianceError(f"{role} run {d} {why}")
    rec = check_record(read_json(d / "run.json", f"{role} run:"), d / "run.json")
    if rec.get("status") != "ok":
        raise ComplianceError(f"{role} run {d}: status is {rec.get('status')!r}"
                              + (f" ({rec['error']})" if rec.get("error") else "") + ", not 'ok'")
    return Run(d, rec)


def missing_run_file(folder: Path, role: str) -> Optional[str]:
    """Why run folder ``folder`` lacks a file a ``role`` run (``performance``, ``accuracy``, ``TEST06``) must hold
    (:data:`RUN_FILES`): ``"<name> is missing"`` (also a folder, FIFO or device in its place: never opened),
    ``"<name> is empty"`` or ``"<name> cannot be read (<reason>)"``; None: every one is there."""
    for name in RUN_FILES[role]:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing" + (" (not a regular file)" if path.exists() else "")
        try:
            with open(path, "rb") as f:
                if not f.read(1):
                    return f"{name} is empty"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def _need(d: Path, role: str) -> None:
    """``ComplianceError`` naming the run and the file for :func:`missing_run_file`'s reason."""
    why = missing_run_file(d, role)
    if why:
        raise ComplianceError(f"{role} run {d}: {why}")


def _benchmark(perf: Run) -> str:
    key = perf.rec.get("model_key")
    if key not in BENCHMARK_NAMES:
        raise ComplianceError(f"performance run {perf.folder}: model key {key!r} has no benchmark folder "
                              f"(known: {', '.join(BENCHMARK_NAMES)})")
    return BENCHMARK_NAMES[key]


def _performance_problems(perf: Run, allow_noncompliant: bool) -> list[str]:
    """Refuse a run that is not a plain performance run; an INVALID result is a problem only when rehearsing."""
    rec, settings = perf.rec, perf.rec.get("run_settings", {})
    if rec.get("mode") != "performance":
        raise ComplianceError(f"performance run {perf.folder}: mode is {rec.get('mode')!r}")
    if settings.get("compliance_test") or settings.get("audit_config"):
        raise ComplianceError(f"performance run {perf.folder}: made with an audit config (a compliance test run)")
    if rec.get("validity") == "VALID":
        return []
    if not allow_noncompliant or rec.get("validity") != "INVALID":
        raise ComplianceError(f"performance run {perf.folder}: LoadGen result is {rec.get('validity')!r}, not VALID")
    return [f"performance run: LoadGen result is INVALID ({invalid_why(rec)})"]


def _gate_problems(acc: Run) -> list[str]:
    """The accuracy gate's verdict: its own ``accuracy.json`` (fresh after a re-score with python -m accuracy),
    else the result ``run.json`` records."""
    if acc.rec.get("mode") != "accuracy":
        raise ComplianceError(f"accuracy run {acc.folder}: mode is {acc.rec.get('mode')!r}")
    gate = acc.rec.get("accuracy")
    if (acc.folder / "accuracy.json").is_file():
        gate = read_json(acc.folder / "accuracy.json", "accuracy run: gate result")
        if not _gate_result_ok(gate):
            raise ComplianceError(f"accuracy run {acc.folder}: accuracy.json is not a result the accuracy gate writes: "
                                  "it needs 'passed' (true/false) and a per-metric 'verdict' that agrees with it")
    elif gate and "passed" in gate:
        raise ComplianceError(f"accuracy run {acc.folder}: run.json records a gate result but accuracy.json (the "
                              "gate's scores and verdict) is missing; re-score with python -m accuracy")
    if not gate:
        return ["accuracy run: no accuracy gate result in run.json (run with the gate, or score it with "
                "python -m accuracy)"]
    if not gate.get("passed"):
        why = gate.get("skipped") or _gate_reasons(gate) or gate.get("scores")
        return [f"accuracy run: the accuracy gate did not pass ({why})"]
    return gate_input_problems(gate) if (acc.folder / "accuracy.json").is_file() else []


def _gate_reasons(gate: dict) -> list:
    """The gate's ``reasons``, a ``gen_len`` one in the gate's own words from its verdict (``characters over all
    samples``; files from before that wording say only "(per-sample)", which reads as one sample's length)."""
    g = (gate.get("verdict") or {}).get("gen_len")
    reasons = list(gate.get("reasons") or [])
    if not (isinstance(g, dict) and {"value", "min", "max", "reference"} <= set(g)):
        return reasons
    return [gen_len_reason(g) if str(r).startswith("gen_len ") else r for r in reasons]


def _record_problems(run: Run, role: str) -> list[str]:
    """Refuse LoadGen errors; the reasons ``run.json`` gives for not being compliant."""
    if (run.rec.get("loadgen") or {}).get("errors"):
        raise ComplianceError(f"{role} run {run.folder}: LoadGen logged {run.rec['loadgen']['errors']} error(s) "
                              "(the submission checker rejects them)")
    compliance = run.rec.get("compliance") or {}
    if compliance.get("compliant"):
        return []
    return [f"{role} run: {r}" for r in compliance.get("reasons") or ["run.json does not record it as compliant"]]


def _check_files(perf: Run, acc: Run) -> None:
    """The logs the tree needs are there, the accuracy log reads as LoadGen's and holds every sample once, and the
    detail logs agree with run.json (``sut.submission.logs``)."""
    from accuracy.errors import AccuracyInputError
    from accuracy.loadgen_log import read_accuracy_log

    _need(perf.folder, "performance")
    _need(acc.folder, "accuracy")
    try:
        entries = read_accuracy_log(acc.folder / "mlperf_log_accuracy.json")
    except AccuracyInputError as e:
        raise ComplianceError(f"accuracy run {acc.folder}: {e}") from None
    check_accuracy_log_complete(acc.folder, acc.rec, entries)
    check_logs_agree(perf.folder, perf.rec, "performance")
    check_logs_agree(acc.folder, acc.rec, "accuracy")


def _check_test06(folder: str) -> tuple[Run, Test06Result, list[str]]:
    """Load a TEST06 run and re-check its log (``run.json`` or ``TEST06/`` may be stale or edited)."""
    t06 = _load_run(folder, "TEST06")
    rec, tdir = t06.rec, t06.folder
    if (rec.get("run_settings") or {}).get("compliance_test") != "TEST06":
        raise ComplianceError(f"TEST06 run {tdir}: not made with --compliance-test TEST06")
    _need(tdir, "TEST06")
    check_logs_agree(tdir, rec, "TEST06")
    if (rec.get("loadgen") or {}).get("errors"):
        raise ComplianceError(f"TEST06 run {tdir}: LoadGen logged {rec['loadgen']['errors']} error(s) "
                              "(the submission checker rejects them)")
    eos = (rec.get("model") or {}).get("eos_token_ids") or (rec.get("test06") or {}).get("eos_token_ids")
    if not eos:
        raise ComplianceError(f"TEST06 run {tdir}: run.json has no model eos_token_ids for the EOS check")
    result = verify_test06(tdir / "mlperf_log_accuracy.json", rec.get("scenario") or "Offline", eos,
                           vocab_size(rec), f"TEST06 run {tdir}: run.json eos_token_ids",
                           (rec.get("generation") or {}).get("max_tokens") or MAX_NEW_TOKENS)
    if not result.passed:
        raise ComplianceError(f"TEST06 run {tdir}: verification fails on its mlperf_log_accuracy.json: "
                              + result.verify_accuracy_txt().replace("\n", "; ") + " ".join(result.failures[:3]))
    problems = [f"TEST06 run: {r}" for r in (rec.get("compliance") or {}).get("reasons", [])
                if not r.startswith("audit config")]
    return t06, result, problems


def check_scenario(ps: PackageSettings) -> ScenarioRuns:
    """Load and check the runs of one scenario (nothing is written).

    Raises:
        ComplianceError: a run is missing, failed, in the wrong mode, has LoadGen errors, lacks a
            file, fails TEST06 or differs from the performance run; a closed ``llama3.1-8b``
            scenario has no TEST06 run; the runs are not compliant and not ``allow_noncompliant``.
    """
    perf = _load_run(ps.performance_run, "performance")
    acc = _load_run(ps.accuracy_run, "accuracy")
    bench = _benchmark(perf)
    problems = _performance_problems(perf, ps.allow_noncompliant) + _gate_problems(acc)
    problems += _record_problems(perf, "performance") + _record_problems(acc, "accuracy")
    _check_files(perf, acc)
    t06 = t06_result = None
    if ps.test06_run:
        t06, t06_result, t06_problems = _check_test06(ps.test06_run)
        problems += t06_problems
    elif ps.division == "closed" and bench in NEEDS_TEST06:
        scen = perf.rec.get("scenario") or "Offline"
        raise ComplianceError(f"closed-division {bench} {scen} needs a TEST06 run (--test06 RUN_FOLDER: a run made "
                              f"with python -m sut run --scenario {scen} ... --compliance-test TEST06)")
    check_same_system(perf.rec, [(acc.rec, "accuracy")] + ([(t06.rec, "TEST06")] if t06 else []))
    check_same_user_conf((perf.folder, perf.rec), [(acc.folder, acc.rec, "accuracy")]
                         + ([(t06.folder, t06.rec, "TEST06")] if t06 else []))
    if problems and not ps.allow_noncompliant:
        raise ComplianceError("not compliant (pass --allow-noncompliant only to rehearse the layout):\n  "
                              + "\n  ".join(problems))
    return ScenarioRuns(perf, acc, t06, t06_result, bench, perf.rec.get("scenario") or "Offline", tuple(problems))


# ---------------------------------------------------------------------------------------------- copy
def scenario_root(out: str, division: str, submitter: str, system: str, bench: str, scenario: str) -> Path:
    """``<out>/<division>/<submitter>/results/<system>/<benchmark>/<scenario>``: where one scenario's runs go."""
    return Path(out) / division / submitter / "results" / system / bench / scenario


def _copy_scenario(ps: PackageSettings, runs: ScenarioRuns) -> Path:
    root = scenario_root(ps.out, ps.division, ps.submitter, ps.system, runs.bench, runs.scenario)
    if root.exists():
        raise ComplianceError(f"{root} already exists; give another --out or remove it")
    (root / "performance" / "run_1").mkdir(parents=True)
    for n in PERF_LOGS:
        shutil.copy2(runs.perf.folder / n, root / "performance" / "run_1" / n)
    (root / "accuracy").mkdir()
    for n in ACC_FILES:
        shutil.copy2(runs.acc.folder / n, root / "accuracy" / n)
    if runs.t06 is not None:
        write_test06(runs.t06_result, runs.t06.folder / "mlperf_log_accuracy.json", root)
    shutil.copy2(kept_user_conf(runs.perf.folder, runs.perf.rec, "performance"), root / "user.conf")
    (root / "measurements.json").write_text(json.dumps(measurements(runs.perf.rec), indent=2) + "\n")
    t06_rec = runs.t06.rec if runs.t06 else None
    (root / "README.md").write_text(readme(ps.system, runs.perf.rec, runs.acc.rec, t06_rec, runs.bench, runs.scenario))
    log.info("scenario laid out: %s", root.relative_to(ps.out))  # ps.out may be the build folder beside --out
    return root


def lay_out_scenario(ps: PackageSettings) -> LaidOut:
    """Check the runs of one scenario and copy them into the layout; no ``NOT-COMPLIANT.txt`` is written.

    Raises:
        ComplianceError: as :func:`check_scenario`; the scenario folder already exists; the
            performance run's user.conf is gone.
    """
    runs = check_scenario(ps)
    return LaidOut(_copy_scenario(ps, runs), runs.problems)


def write_not_compliant(folder: Path, problems: Sequence[str], final_folder: Optional[Path] = None) -> Path:
    """Write the rehearsal note ``<folder>/NOT-COMPLIANT.txt``: one ``- reason`` line per problem. The warning names
    it in ``final_folder`` where the tree is built elsewhere and moved there afterwards."""
    path = Path(folder) / NOT_COMPLIANT_TXT
    path.write_text(NOT_COMPLIANT_HEAD + "".join(f"- {p}\n" for p in problems))
    log.warning("laid out NON-COMPLIANT runs (rehearsal): %d reason(s), each in %s", len(problems),
                Path(final_folder) / NOT_COMPLIANT_TXT if final_folder is not None else path)
    return path


def package(ps: PackageSettings) -> Path:
    """Copy the runs into the submission layout and return the scenario folder; runs that are not
    compliant (``allow_noncompliant``) get ``NOT-COMPLIANT.txt`` in that folder.

    Raises:
        ComplianceError: a run is missing, failed, not compliant (unless ``allow_noncompliant``),
            in the wrong mode, did not pass its check, or differs from the performance run in
            engine/generation/model/dataset settings; the scenario folder already exists.
    """
    done = lay_out_scenario(ps)
    if done.problems:
        write_not_compliant(done.root, done.problems)
    return done.root
