"""``python -m sut package``: the runs of one system, every scenario, as one submission tree.

A closed datacenter Llama 3.1 8B submission needs **Offline plus Server or Interactive** (submission
checker ``loader.py`` ``check_scenarios``: "missing ['(one of) Interactive or Server']"), the code
under ``<division>/<submitter>/src/`` and ``<division>/<submitter>/systems/<system>.json`` (v6.0+).
:func:`package_tree` groups the given run folders by the scenario their ``run.json`` records, lays
each scenario out with :func:`sut.submission.scenario.lay_out_scenario` (which checks that the runs of
one scenario describe the same engine, generation, model and dataset), checks that all scenarios ran
on the same system (device kind, name and count, model config hash, dataset hash, generation
settings), and writes::

    <out>/<division>/<submitter>/
        results/<system>/llama3.1-8b/{Offline,Server,Interactive}/...   (sut.package_scenario)
        src/README.md                    harness commit, how to get the code, the exact commands
        systems/<system>.json            filled from run.json and --system-json; a field neither tells
                                         reads FILL-IN (refused unless --allow-noncompliant)
        NOT-COMPLIANT.txt                only a rehearsal (--allow-noncompliant): every reason, of
                                         every scenario and of the tree, in this one file

Checker version: LoadGen 6.0.17 embeds the **v6.1** mlperf.conf RNG seeds, so a tree made with it
passes the v6.1 submission checker (``--version v6.1``) and fails v6.0's seed check
(:data:`CHECKER_VERSION`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from accuracy.boundedread import FOLDER, GREW, NOT_REGULAR, TOO_LARGE, BoundedReadError, read_regular
from accuracy.jsontext import parse_json
from accuracy.loadgen_log import NOT_MLPERF, locality_folder_why, not_mlperf
from sut.constants import REPO
from sut.data.paths import first_missing
from sut.errors import ComplianceError
from sut.record.read import check_record, engines_used, read_json
from sut.submission.files import flag_values, portable_command
from sut.submission.same_system import user_conf_gone
from sut.submission.scenario import (
    BENCHMARK_NAMES,
    DIVISIONS,
    PackageSettings,
    check_scenario,
    lay_out_scenario,
    missing_run_file,
    scenario_root,
    write_not_compliant,
)

log = logging.getLogger(__name__)

#: The submission checker version a tree made with mlcommons-loadgen 6.0.17 targets.
CHECKER_VERSION = "v6.1"
CHECKER_NOTE = ("The tree targets the v6.1 submission checker (mlcommons/inference tools/submission/"
                "submission_checker, --version v6.1): mlcommons-loadgen 6.0.17 embeds the v6.1 mlperf.conf RNG seeds, "
                "so the tree passes v6.1's seed check and fails v6.0's.")
#: Marker of a ``systems/<system>.json`` field that neither ``run.json`` nor ``--system-json`` tells. The v6.1
#: checker passes it in every field but ``status`` (it checks presence, non-empty values, ``status``, ``system_type``,
#: the division's network mode, division and submitter), so :func:`package_tree` refuses it itself.
FILL_IN = "FILL-IN"
#: ``status`` values the submission checker takes (``constants.py`` ``VALID_AVAILABILITIES``).
VALID_STATUSES = ("available", "preview", "rdi")
#: Required fields of ``systems/<system>.json`` (submission checker ``constants.py``
#: ``SYSTEM_DESC_REQUIRED_FIELDS``, v6.0 and v6.1).
SYSTEM_FIELDS = (
    "division", "submitter", "status", "system_name", "number_of_nodes", "host_processor_model_name",
    "host_processors_per_node", "host_processor_core_count", "host_memory_capacity", "host_storage_capacity",
    "host_storage_type", "accelerators_per_node", "accelerator_model_name", "accelerator_memory_capacity",
    "framework", "operating_system", "system_type", "other_software_stack", "host_processor_frequency",
    "host_processor_caches", "host_memory_configuration", "host_processor_interconnect", "host_networking",
    "host_networking_topology", "accelerator_frequency", "accelerator_host_interconnect", "accelerator_interconnect",
    "accelerator_interconnect_topology", "accelerator_memory_configuration", "accelerator_on-chip_memories",
    "cooling", "hw_notes", "sw_notes", "host_network_card_count", "system_type_detail",
)
#: Fields the checker reads beyond :data:`SYSTEM_FIELDS`: a power submission's
#: (``SYSTEM_DESC_REQUIRED_FIELDS_POWER``) and a network-mode one's (``SYSTEM_DESC_REQUIRED_FIELDS_NETWORK_MODE``),
#: v6.1 ``constants.py``. A ``--system-json`` field close to one of these or :data:`SYSTEM_FIELDS` but not one
#: of them is taken for a misspelling and refused (:func:`read_system_desc`); any other field is kept, with a warning.
SYSTEM_FIELDS_OPTIONAL = (
    "power_management", "filesystem", "boot_firmware_version", "management_firmware_version", "other_hardware",
    "number_of_type_nics_installed", "nics_enabled_firmware", "nics_enabled_os", "nics_enabled_connected",
    "network_speed_mbit", "power_supply_quantity_and_rating_watts", "power_supply_details", "disk_drives",
    "disk_controllers", "system_power_only", "is_network", "network_type", "network_media", "network_rate",
    "nic_loadgen", "number_nic_loadgen", "net_software_stack_loadgen", "network_protocol", "number_connections",
    "nic_sut", "number_nic_sut", "net_software_stack_sut", "network_topology",
)


@dataclass(frozen=True)
class TreeSettings:
    """A request to lay out every scenario of one system.

    Attributes:
        out, system, submitter, division, allow_noncompliant: as in ``PackageSettings``.
        system_desc: a JSON file (``--system-json``) of ``systems/<system>.json`` fields that ``run.json``
            cannot tell (``status``, memory, storage, cooling, ...); its values replace the template's.
        performance_runs / accuracy_runs / test06_runs: run folders, any order; each run's
            ``run.json`` says its scenario. Every scenario needs one performance and one accuracy
            run (and, closed division, one TEST06 run).
    """

    out: str
    system: str
    submitter: str
    performance_runs: tuple = ()
    accuracy_runs: tuple = ()
    test06_runs: tuple = ()
    division: str = "closed"
    allow_noncompliant: bool = False
    system_desc: Optional[str] = None
    repo: str = field(default=str(REPO), repr=False)

    def __post_init__(self):
        if self.division not in DIVISIONS:
            raise ValueError(f"division must be one of {DIVISIONS}, got {self.division!r}")
        if not self.performance_runs or not self.accuracy_runs:
            raise ValueError("give at least one performance run and one accuracy run")

    def check_run_folders(self) -> None:
        """Raise ``ValueError`` naming the flag and the path for a run folder argument that does not exist, is
        not a folder, holds no readable ``run.json`` (or one with a field of the wrong type: naming the field), is
        given twice, is a run of another kind than its flag asks for, or lacks a log the tree needs or the user.conf
        it read (naming the file) (bad input: ``python -m sut package`` exits 2 before it writes anything)."""
        seen: dict[Path, str] = {}
        for flag, folders in (("--performance", self.performance_runs), ("--accuracy", self.accuracy_runs),
                              ("--test06", self.test06_runs)):
            for f in folders:
                why = _not_a_run_folder(Path(f), flag)
                if why:
                    raise ValueError(f"{flag} {f}: {why}")
                key = Path(f).resolve()
                if key in seen:
                    raise ValueError(f"{flag} {f}: given twice (also {seen[key]})")
                seen[key] = f"{flag} {f}"


#: The role of the runs each run folder flag of ``python -m sut package`` takes (``RUN_FILES``' keys).
_ROLES = {"--performance": "performance", "--accuracy": "accuracy", "--test06": "TEST06"}


def _not_a_run_folder(d: Path, flag: str) -> Optional[str]:
    """Why ``d`` is no ``python -m sut run`` folder of the kind ``flag`` takes, its ``run.json`` a field of the wrong
    type included (``check_record``'s message, naming the file and the field), or one that lacks a file the tree needs
    (``missing_run_file``: a LoadGen log missing, empty or unreadable) or the user.conf it read; None: it may be one.
    The files are checked only for a run whose status is ``ok``: a failed or interrupted run often has no LoadGen logs,
    and is refused later naming its status and cause (exit 1), not a log it never wrote."""
    if not d.exists():
        return "does not exist"
    if not d.is_dir():
        return "is not a folder"
    why = locality_folder_why(d)  # also with a run.json put there by hand
    if why:
        return why
    if not (d / "run.json").is_file():
        return "is not a run folder (no run.json)"
    try:
        rec = parse_json((d / "run.json").read_text())
    except (OSError, ValueError) as e:
        return f"its run.json cannot be read as JSON ({e})"
    if not_mlperf(rec):
        return f"holds a synthetic-locality record as run.json: {NOT_MLPERF}"
    try:
        check_record(rec, d / "run.json")
    except ComplianceError as e:
        return str(e)
    why = _role_mismatch(rec, flag)
    if why or rec.get("status") != "ok":
        return why
    return missing_run_file(d, _ROLES[flag]) or user_conf_gone(d, rec)


def _role_mismatch(rec: dict, flag: str) -> Optional[str]:
    """Why a run (``rec``, its run.json) is not what ``flag`` takes: --performance a performance run without an audit
    config, --accuracy an accuracy run, --test06 a TEST06 run (None: it is, or the fields are for check_record)."""
    mode, rs = rec.get("mode"), rec.get("run_settings") if isinstance(rec.get("run_settings"), dict) else {}
    test = rs.get("compliance_test")
    kind = f"a {test} run" if test else f"{'an' if mode == 'accuracy' else 'a'} {mode} run" if isinstance(mode, str) \
        else None
    if kind is None:
        return None
    if flag == "--test06":
        return None if test == "TEST06" else f"is {kind}, not a TEST06 run (--compliance-test TEST06)"
    want = flag.lstrip("-")
    return None if mode == want and not test else f"is {kind}, not {'an' if want == 'accuracy' else 'a'} {want} run"


def _by_scenario(folders, role: str) -> dict[str, tuple[str, dict]]:
    out: dict[str, tuple[str, dict]] = {}
    for f in folders:
        rec = check_record(read_json(Path(f) / "run.json", f"{role} run:"), Path(f) / "run.json")
        scen = rec.get("scenario") or "Offline"
        if scen in out:
            raise ComplianceError(f"two {role} runs of the {scen} scenario: {out[scen][0]} and {f}")
        out[scen] = (str(f), rec)
    return out


def _system_facts(rec: dict) -> dict:
    used = engines_used(rec) or {}
    return {"devices": used.get("devices"), "model": (rec.get("model") or {}).get("config_sha256"),
            "dataset": (rec.get("dataset") or {}).get("sha256"), "generation": rec.get("generation"),
            "benchmark": BENCHMARK_NAMES.get(rec.get("model_key"))}


def _check_out_is_free(ts, perf: dict) -> None:
    """``ValueError`` (bad input: exit 2, nothing written) when ``--out`` already holds the folder of one of these
    scenarios (``perf``: ``{scenario: (folder, record)}``) for this system, e.g. from an earlier ``package`` into the
    same ``--out``."""
    taken = [str(d) for scen, (_, rec) in perf.items()
             if (d := scenario_root(ts.out, ts.division, ts.submitter, ts.system,
                                    str(BENCHMARK_NAMES.get(rec.get("model_key"))), scen)).exists()]
    if taken:
        raise ValueError(f"--out {ts.out} already holds {', '.join(taken)} (an earlier package?); give another "
                         "--out or remove it")


def _check_roles(perf: dict, acc: dict, t06: dict) -> None:
    """Every scenario has its performance and its accuracy run (``{scenario: (folder, record)}`` each)."""
    for scen in sorted(set(acc) | set(t06)):
        if scen not in perf:
            raise ComplianceError(f"{scen}: an accuracy or TEST06 run but no performance run")
    for scen in perf:
        if scen not in acc:
            raise ComplianceError(f"{scen}: a performance run but no accuracy run")


def _check_one_system(perf: dict) -> dict:
    """The system facts of the first performance run; ``ComplianceError`` if another scenario's differ."""
    first_scen = next(iter(perf))
    ref = _system_facts(perf[first_scen][1])
    for scen, (folder, rec) in perf.items():
        facts = _system_facts(rec)
        diff = sorted(k for k in ref if facts[k] != ref[k])
        if diff:
            raise ComplianceError(f"{scen} run {folder} ran on another system than the {first_scen} run: differs in "
                                  + ", ".join(diff))
    return ref


def _tree_problems(ts: TreeSettings, scenarios: set, benchmark: Optional[str]) -> list[str]:
    """Why the tree is not a complete closed datacenter submission (empty: it is, or it need not be)."""
    problems = []
    if ts.division != "closed" or (benchmark and benchmark.endswith("-edge")):
        return problems
    if "Offline" not in scenarios:
        problems.append("a closed datacenter submission needs an Offline result")
    if not {"Server", "Interactive"} & scenarios:
        problems.append("a closed datacenter submission needs a Server or an Interactive result (the checker "
                        "says: missing ['(one of) Interactive or Server'])")
    return problems


def _scenario_settings(ts: TreeSettings, scen: str, perf: dict, acc: dict, t06: dict,
                       allow_noncompliant: bool) -> PackageSettings:
    return PackageSettings(out=ts.out, system=ts.system, submitter=ts.submitter, performance_run=perf[scen][0],
                           accuracy_run=acc[scen][0], test06_run=t06[scen][0] if scen in t06 else None,
                           division=ts.division, allow_noncompliant=allow_noncompliant)


def _scenario_problems(ts: TreeSettings, perf: dict, acc: dict, t06: dict) -> list[str]:
    """Every scenario's reasons as a rehearsal lists them, each prefixed with its scenario; nothing is written
    (a run that no rehearsal could lay out either raises ``ComplianceError`` at once)."""
    return [f"{scen}: {p}" for scen in perf
            for p in check_scenario(_scenario_settings(ts, scen, perf, acc, t06, True)).problems]


def _lay_out_scenarios(ts: TreeSettings, perf: dict, acc: dict, t06: dict) -> list[str]:
    """Every scenario's folder; the problems of their runs, each prefixed with its scenario. Scenario folders
    written before a failure are removed again."""
    written: list[Path] = []
    problems: list[str] = []
    try:
        for scen in perf:
            done = lay_out_scenario(_scenario_settings(ts, scen, perf, acc, t06, ts.allow_noncompliant))
            written.append(done.root)
            problems += [f"{scen}: {p}" for p in done.problems]
    except BaseException:
        for d in written:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return problems


def package_tree(ts: TreeSettings, build_in: Optional[str] = None) -> Path:
    """Lay the runs out as one tree and return ``<out>/<division>/<submitter>``. A rehearsal
    (``allow_noncompliant``) gets one ``NOT-COMPLIANT.txt`` there, listing the tree's problems and every
    scenario's (``<scenario>: <role> run: <reason>``); scenario folders get none.

    Args:
        build_in: write the tree under this folder instead of ``ts.out`` (checks such as "``--out`` already
            holds this scenario" still look at ``ts.out``; :func:`package_new_tree` moves it there).

    Raises:
        ComplianceError: a run is unusable (see ``sut.submission.scenario.check_scenario``), two runs claim
            one role in one scenario, a scenario lacks its performance or accuracy run, scenarios
            ran on different systems, or (unless ``allow_noncompliant``) a closed datacenter tree
            lacks Offline or both Server and Interactive. Scenario folders written before a
            failure are removed again.
    """
    perf = _by_scenario(ts.performance_runs, "performance")
    acc = _by_scenario(ts.accuracy_runs, "accuracy")
    t06 = _by_scenario(ts.test06_runs, "TEST06")
    _check_roles(perf, acc, t06)
    ref = _check_one_system(perf)
    _check_out_is_free(ts, perf)
    system = system_json(ts, next(iter(perf.values()))[1], read_system_desc(ts))
    problems = _tree_problems(ts, set(perf), ref["benchmark"]) + system_desc_problems(ts.system, system)
    if not ts.allow_noncompliant:
        problems += _scenario_problems(ts, perf, acc, t06)  # every reason at once, not one scenario's at a time
        if problems:
            raise ComplianceError("not a compliant submission (pass --allow-noncompliant only to rehearse the "
                                  "layout):\n  " + "\n  ".join(problems))
    build = dataclasses.replace(ts, out=build_in) if build_in is not None else ts
    root = Path(build.out) / ts.division / ts.submitter
    problems += _lay_out_scenarios(build, perf, acc, t06)
    runs = [(scen, role, group[scen][1]) for scen in perf
            for role, group in (("performance", perf), ("accuracy", acc), ("TEST06", t06)) if scen in group]
    write_src(root / "src", runs, Path(ts.repo))
    systems = root / "systems"
    systems.mkdir(parents=True, exist_ok=True)
    (systems / f"{ts.system}.json").write_text(json.dumps(system, indent=2, allow_nan=False) + "\n")
    final = Path(ts.out) / ts.division / ts.submitter
    if problems:
        write_not_compliant(root, problems, final)
    log.info("submission tree written: %s (scenarios %s); %s", final, ", ".join(perf), CHECKER_NOTE)
    return final


#: Prefix of the folder beside ``--out`` that :func:`package_new_tree` builds the tree in (``.<out name>`` + this).
STAGING_SUFFIX = ".package-partial-"


def package_new_tree(ts: TreeSettings) -> Path:
    """:func:`package_tree` for ``python -m sut package``: nothing partial is ever left at ``--out``.

    The run folder arguments are checked first (``ValueError``, :meth:`TreeSettings.check_run_folders`);
    the tree is then built in a new folder beside ``--out`` (``<parent>/.<out name>.package-partial-XXXX``,
    same file system) and moved into place only once it is complete: renamed to ``--out`` when that does
    not exist (or is an empty folder), else merged into it entry by entry (each a rename); a symbolic link
    ``--out`` stands for the folder it points to (built beside that, moved into it). Ctrl-C or SIGTERM
    (``KeyboardInterrupt``) or any failure before that removes the build folder and the parents of
    ``--out`` this call created; a stop signal during the move (milliseconds) is held until the move is
    done, then raised (exit 130, the tree complete).

    Raises:
        ValueError: a bad run folder argument or ``--system-json`` file, ``--out`` is empty, an existing file or a
            loop of symbolic links.
        OSError: the build folder cannot be created (an unwritable parent of ``--out``).
        ComplianceError, KeyboardInterrupt: as :func:`package_tree`; a stop signal.
    """
    if not str(ts.out).strip():  # Path("") is the current folder: the tree would land in it
        raise ValueError(f"--out {ts.out!r}: an empty path; name the submission tree's root folder")
    ts.check_run_folders()
    read_system_desc(ts)  # a bad --system-json: exit 2 before anything is written
    given = Path(ts.out).absolute()
    try:  # a link is no folder to rename onto, and its target may be on another file system
        out = given.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a loop of links (Python < 3.13)
        raise ValueError(f"--out {ts.out}: cannot follow its symbolic links ({e})") from None
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {ts.out} is a file, not a folder")
    made = first_missing(out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_SUFFIX}", dir=out.parent))
        os.chmod(stage, _folder_mode(out))  # mkdtemp's 0700 would replace an empty --out's own permissions
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    try:
        package_tree(ts, build_in=str(stage))
        with _stop_signals_held() as held:
            _move_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if made is not None:  # every file under it is this call's
            shutil.rmtree(made, ignore_errors=True)
        raise
    shutil.rmtree(stage, ignore_errors=True)  # what a merge left: folders whose entries moved
    root = given / ts.division / ts.submitter
    if held:
        log.warning("%s arrived while the finished tree was moved into place: the tree is complete (%s)",
                    held[0], root)
        raise KeyboardInterrupt(held[0])
    return root


@contextmanager
def _stop_signals_held():
    """Within the block, SIGINT and SIGTERM are only noted (``yield``-ed list of their names: ``"SIGINT, Ctrl-C"``,
    ``"SIGTERM"``); the previous handlers come back after it. Outside the main thread it holds nothing."""
    held: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def note(signum, _frame):
        held.append("SIGINT, Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    before = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield held
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _folder_mode(out: Path) -> int:
    """The permission bits the tree's top folder gets: those of ``out`` when it is a folder already (an empty one is
    replaced by the build folder), else what ``mkdir`` would give under the process's umask."""
    if out.is_dir():
        return stat.S_IMODE(out.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _move_into_place(stage: Path, out: Path) -> None:
    """Move the tree built in ``stage`` to ``out``: one rename when ``out`` is absent or an empty folder; else
    each entry of ``stage`` whose path ``out`` lacks is renamed there, folders both hold are merged the same way
    and a file both hold is replaced (``src/README.md`` of an earlier package into the same ``--out``)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(stage, out)  # a directory onto an empty directory: replaced
        return
    for entry in stage.iterdir():
        dest = out / entry.name
        if entry.is_dir() and dest.is_dir():
            _move_into_place(entry, dest)
        else:
            os.replace(entry, dest)


def _git(repo: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


#: A git URL with a scheme (``https://``, ``ssh://``, ``git://``; ``file://`` is a local path) or the scp-like
#: ``[user@]host:path`` form (no ``/`` before the colon, a host longer than one letter: not ``C:\...``).
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SCP_LIKE = re.compile(r"(?:[^@/:]+@)?[^@/:]{2,}:")


def is_reachable_remote(url: str) -> bool:
    """Whether ``url`` (``git remote``) names a place reviewers can fetch from: a URL with a scheme other
    than ``file://``, or ``host:path``; False for a filesystem path (``/work/main``, ``../harness``)."""
    if _URL_SCHEME.match(url):
        return not url.lower().startswith("file:")
    return bool(_SCP_LIKE.match(url))


def repository_line(repo: Path) -> str:
    """The ``repository:`` value of ``src/README.md``: the git remote ``origin`` when it is a URL
    (:func:`is_reachable_remote`), else a ``FILL-IN: ...`` note, with a warning, so that a local clone's path
    (``/work/main``) is not published as where to get the code."""
    remote = _git(repo, "config", "--get", "remote.origin.url")
    if remote and is_reachable_remote(remote):
        return remote
    why = (f"the git remote origin is {remote}, a local path, not a URL" if remote
           else "the checkout has no git remote origin")
    log.warning("src/README.md: 'repository' is %s (%s): replace it with the URL where reviewers can get this "
                "commit before submitting", FILL_IN, why)
    return f"{FILL_IN}: URL where reviewers can get this commit ({why})"


def write_src(src: Path, runs: list, repo: Path) -> Path:
    """``src/README.md``: the harness commit (and whether the working tree had changes), how to get
    the code, and the exact command of every run (paths made relative to the repository root)."""
    from sut.record.provenance import harness_commit

    made = harness_commit(repo, repo / "sut" / "record" / "COMMIT")  # also a tree unpacked from git archive
    commit, dirty = made["harness_commit"], made["harness_uncommitted_changes"]
    src.mkdir(parents=True, exist_ok=True)
    lines = ["# Harness source", "",
             "MLPerf Inference Llama 3.1 8B on vLLM: `python -m sut run` (this repository's harness).", "",
             f"- commit: `{commit or FILL_IN + ': not a git checkout'}`"
             + (" (the working tree had uncommitted changes when this tree was made)" if dirty else ""),
             f"- repository: {repository_line(repo)}",
             f"- {CHECKER_NOTE}", "",
             "## Commands", "", "Run them from the repository root (paths inside it are relative to it).", ""]
    cmds = [portable_command(rec["command"], repo)[0] if rec.get("command") else "(not recorded)" for _, _, rec in runs]
    for (scen, role, _), cmd in zip(runs, cmds):
        lines += [f"{scen} {role}:", "", "```", cmd, "```", ""]
    extra = untracked_inputs(cmds, repo)
    if extra:
        lines += ["## Files the commands read that are not in the commit", "",
                  *[f"- `{x}`" for x in extra], "",
                  "A user.conf among them is in each scenario's `measurements/.../user.conf` (the copy the run read); "
                  "publish the others with the code.", ""]
    (src / "README.md").write_text("\n".join(lines))
    return src


def untracked_inputs(commands: list[str], repo: Path) -> list[str]:
    """Values of ``--config`` / ``--user-conf`` / ``--audit-config`` / ``--tokenizer`` in ``commands`` (made
    relative by ``portable_command``) that are files inside ``repo`` git does not track (e.g. ``my.user.conf``)."""
    import shlex

    found = []
    for cmd in commands:
        try:
            toks = shlex.split(cmd)
        except ValueError:
            continue
        for flag, _, value in flag_values(toks):
            if flag in ("--config", "--user-conf", "--audit-config", "--tokenizer") and not value.startswith("/") \
                    and (repo / value).exists() and value not in found:
                found.append(value)
    listed = _git(repo, "ls-files", "--", *found) if found else None
    if listed is None:  # nothing to look up, or not a git checkout
        return []
    tracked = listed.splitlines()  # a folder (a tokenizer) is tracked when files under it are
    return [x for x in found if not any(t == x or t.startswith(x.rstrip("/") + "/") for t in tracked)]


#: Largest ``--system-json`` read: a few dozen short fields; anything larger (``/dev/zero``) is refused unread.
MAX_SYSTEM_DESC_BYTES = 1 << 20


def _system_desc_text(path: Path, where: str) -> str:
    """The text of ``--system-json`` ``path``, a regular file of at most :data:`MAX_SYSTEM_DESC_BYTES` (checked on its
    ``stat`` first: a FIFO would block the read, ``/dev/zero`` fill memory); ``ValueError`` naming ``where``."""
    try:
        return read_regular(path, MAX_SYSTEM_DESC_BYTES).decode("utf-8")
    except BoundedReadError as e:
        if e.problem == FOLDER:
            raise ValueError(f"{where}: is a folder, not a JSON file") from None
        if e.problem in (NOT_REGULAR, TOO_LARGE, GREW):
            raise ValueError(f"{where}: not a regular file of at most {MAX_SYSTEM_DESC_BYTES:,} bytes (a FIFO, "
                             "device or larger file is never read)") from None
        raise ValueError(f"{where}: cannot be read: {e}") from None


def read_system_desc(ts: TreeSettings) -> dict:
    """The fields of ``ts.system_desc`` (``--system-json``; ``{}`` when none is given).

    Raises:
        ValueError: the file cannot be read, is not a UTF-8 JSON object of plain values (string, finite number,
            boolean, null: ``NaN``, ``Infinity`` and a number too large for a float are refused), gives a ``status``
            the checker refuses, or ``division``, ``submitter`` or
            ``system_name`` other than the command's.
    """
    if ts.system_desc is None:
        return {}
    where = f"--system-json {ts.system_desc}"
    try:
        desc = parse_json(_system_desc_text(Path(ts.system_desc), where))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON: {e}") from None
    if not isinstance(desc, dict):
        raise ValueError(f"{where}: must be a JSON object of systems/<system>.json fields, got {type(desc).__name__}")
    for k, v in desc.items():
        if isinstance(v, (dict, list)):
            raise ValueError(f"{where}: field {k!r} must be a plain value (text, number, true/false), got "
                             f"{type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):  # Python's json reads NaN, Infinity and 1e999 (inf)
            raise ValueError(f"{where}: field {k!r} must be a finite number, got {v!r} (not valid JSON in the "
                             "submission: write the value as text, e.g. \"512 GB\")")
    if "status" in desc and not (isinstance(desc["status"], str) and desc["status"].lower() in VALID_STATUSES):
        raise ValueError(f"{where}: field 'status' is {desc['status']!r}, the checker takes "
                         f"{' | '.join(VALID_STATUSES)}")
    for k, want in (("division", ts.division), ("submitter", ts.submitter), ("system_name", ts.system)):
        if k in desc and desc[k] != want:
            raise ValueError(f"{where}: field {k!r} is {desc[k]!r}, the command's is {want!r}")
    _check_field_names(where, desc)
    return desc


def _check_field_names(where: str, desc: dict) -> None:
    """Refuse a field of ``desc`` that looks like a misspelt checker field (difflib ratio >= 0.85 to one of
    :data:`SYSTEM_FIELDS` or :data:`SYSTEM_FIELDS_OPTIONAL`): kept, it would leave the real field to the template
    and add one the checker never reads. Other unknown fields are logged and kept (submitters add their own).

    Raises:
        ValueError: naming the field and the field it is probably meant to be.
    """
    known = SYSTEM_FIELDS + SYSTEM_FIELDS_OPTIONAL
    for k in desc:
        if k in known:
            continue
        close = difflib.get_close_matches(k, known, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{where}: field {k!r} is not one the checker reads; did you mean {close[0]!r}?")
        log.warning("%s: field %r is not one the v6.1 checker reads; kept as given", where, k)


def system_desc_problems(system: str, desc: dict) -> list[str]:
    """Why ``desc`` (``systems/<system>.json``) cannot go into a submission: one line per field that holds a
    ``FILL-IN`` placeholder (any case) and for a ``status`` the checker refuses (not one of
    :data:`VALID_STATUSES`)."""
    where = f"systems/{system}.json"
    out = [f"{where}: field {k!r} is still {FILL_IN} (--system-json FILE gives it)"
           for k, v in desc.items() if isinstance(v, str) and FILL_IN.lower() in v.lower()]
    status = desc.get("status")
    if isinstance(status, str) and FILL_IN.lower() not in status.lower() and status.lower() not in VALID_STATUSES:
        out.append(f"{where}: field 'status' is {status!r}, the checker takes {' | '.join(VALID_STATUSES)}")
    return out


def system_json(ts: TreeSettings, rec: dict, given: Optional[dict] = None) -> dict:
    """``systems/<system>.json``: every required field; what ``run.json`` (``rec``, passed by ``check_record``:
    ``host_info`` an object, ``devices`` a list of objects or nulls) tells is filled in, then the ``given`` fields
    (``--system-json``) replace theirs; the rest is ``FILL-IN: ...`` (:func:`system_desc_problems` lists them)."""
    devices = [d or {} for d in rec.get("devices") or [e.get("device") for e in rec.get("engines") or []]]
    gpus = {d.get("uuid") or d.get("slot") for d in devices if d.get("kind") == "cuda"}
    names = sorted({d.get("name") for d in devices if d.get("kind") == "cuda" and d.get("name")})
    v = rec.get("versions") or {}
    host = rec.get("host_info") or {}
    out = {k: f"{FILL_IN}: {k}" for k in SYSTEM_FIELDS}
    out.update({
        "division": ts.division, "submitter": ts.submitter, "system_name": ts.system, "number_of_nodes": 1,
        "status": f"{FILL_IN}: available | preview | rdi", "system_type": "datacenter",
        "accelerators_per_node": len(gpus), "accelerator_model_name": ", ".join(names) or "N/A",
        "framework": f"vLLM {v.get('vllm')}, PyTorch {v.get('torch')}, mlcommons-loadgen {v.get('mlcommons-loadgen')}",
        "other_software_stack": f"Python {v.get('python')}"
        + (f", NVIDIA driver {host['gpu_driver']}" if host.get("gpu_driver") else "")
        + (f", CUDA {v['cuda']}" if v.get("cuda") else ""),
        "sw_notes": f"harness: python -m sut run --sut {rec.get('sut')}",
    })
    if host.get("os"):
        out["operating_system"] = host["os"]
    if host.get("cpu"):
        out["host_processor_model_name"] = host["cpu"]
    if host.get("cpu_count"):  # logical CPUs the run could use (a container's share): a hint, not the fact asked
        out["host_processor_core_count"] = (f"{FILL_IN}: host_processor_core_count (physical cores per processor; "
                                            f"the run saw {host['cpu_count']} logical CPUs)")
    if not gpus:
        for k in ("accelerator_memory_capacity", "accelerator_frequency", "accelerator_host_interconnect",
                  "accelerator_interconnect", "accelerator_interconnect_topology",
                  "accelerator_memory_configuration", "accelerator_on-chip_memories"):
            out[k] = "N/A"
    out.update(given or {})
    return out
