"""Whether the runs of one packaged scenario describe one system (``sut.submission.scenario.check_scenario``).

:func:`check_same_system` compares every other run of a scenario (accuracy, TEST06) with its performance
run: backend, scenario and model key, the engine that really ran (the engines' read-back records where
both runs have them; else the requested engine settings, models by config hash), generation, model,
dataset and backend options, each without the fields that may differ between two runs of one system
(paths, session ids). A difference is a ``ComplianceError`` naming the run, the field and both values.
:func:`check_same_user_conf` does the same for the LoadGen settings each run read from its user.conf (the tree
holds one user.conf per scenario: the performance run's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from sut.errors import ComplianceError, InputError
from sut.record.read import READ_BACK_SETTINGS, engines_used
from sut.scenarios import loadgen_scenario
from sut.settings.userconf import check_user_conf, value_key


def _same(a: dict, b: dict, role: str, field: str, ignore: Sequence[str] = ()) -> None:
    """``ComplianceError`` unless the ``field`` records of run records ``a`` (performance) and ``b`` (the ``role``
    run) agree on every key but ``ignore``; the message names each differing key with both values."""
    va = {k: v for k, v in (a.get(field) or {}).items() if k not in ignore}
    vb = {k: v for k, v in (b.get(field) or {}).items() if k not in ignore}
    diff = sorted(k for k in set(va) | set(vb) if va.get(k) != vb.get(k))
    if diff:
        raise ComplianceError(f"{role} run differs from the performance run in {field}: "
                              + ", ".join(f"{k} {va.get(k)!r} vs {vb.get(k)!r}" for k in diff))


def _flat_engines(used: dict) -> dict:
    """An ``engines_used`` record with a single engine's ``engine_args`` spread out as ``engine_args.<key>``."""
    out = {k: v for k, v in used.items() if k != "engine_args"}
    if len(used["engine_args"]) == 1:
        out.update({f"engine_args.{k}": v for k, v in used["engine_args"][0].items()})
    else:
        out["engine_args"] = used["engine_args"]
    return out


def _same_engine(perf: dict, rec: dict, role: str) -> None:
    """Compare the engine that really ran (the engines' read-back records) where both runs have one, and the
    requested engine settings that nothing reads back; else the requested settings (models by config hash)."""
    used_p, used_r = engines_used(perf), engines_used(rec)
    if used_p is None or used_r is None:
        _same(perf, rec, role, "engine_settings", ignore=("model",))
        return
    on_cpu = any(d.get("kind") == "cpu" for d, _ in used_p["devices"] + used_r["devices"])
    _same(perf, rec, role, "engine_settings", ignore=READ_BACK_SETTINGS + (() if on_cpu else ("cpu_kvcache_gib",)))
    key = "the engines it ran (read back)"
    _same({key: _flat_engines(used_p)}, {key: _flat_engines(used_r)}, role, key)


def check_same_system(perf: dict, others: Sequence[tuple[dict, str]]) -> None:
    """Every other run of the scenario describes the performance run's system, engine, generation, model, data."""
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


def _user_conf(folder: Path, rec: dict) -> Optional[Path]:
    """The user.conf a run read: the copy in its run folder, else the file its ``run_settings.user_conf`` names;
    None when neither is a file."""
    named = (rec.get("run_settings") or {}).get("user_conf")
    return next((p for p in (folder / "user.conf", Path(named) if named else None) if p and p.is_file()), None)


def user_conf_gone(folder: Path, rec: dict) -> Optional[str]:
    """Why the user.conf a run read (``folder``: its run folder, ``rec``: its ``run.json``) is gone: neither the copy
    in the run folder nor the file ``run_settings.user_conf`` names is a file; None: one of them is."""
    if _user_conf(folder, rec):
        return None
    named = (rec.get("run_settings") or {}).get("user_conf")
    return ("its user.conf was not kept in the run folder and "
            + (f"{named} does not exist any more" if named else "its run.json names none"))


def kept_user_conf(folder: Path, rec: dict, role: str) -> Path:
    """The user.conf a run read: the copy in its run folder, else the file its record names.

    Raises:
        ComplianceError: neither exists any more (:func:`user_conf_gone`; names the run).
    """
    found = _user_conf(folder, rec)
    if found is None:
        raise ComplianceError(f"{role} run {folder}: {user_conf_gone(folder, rec)}")
    return found


def _conf_settings(folder: Path, rec: dict, role: str) -> dict[str, str]:
    """``{setting: value}`` LoadGen took from the run's user.conf for its model key and scenario
    (``sut.settings.userconf.check_user_conf``, as the run itself read it)."""
    path = kept_user_conf(folder, rec, role)
    scenario = loadgen_scenario(rec.get("scenario") or "Offline") or "Offline"
    target_given = (rec.get("run_settings") or {}).get("target_qps") is not None
    try:
        return check_user_conf(path, rec.get("model_key") or "", scenario, target_qps_given=target_given)
    except InputError as e:
        raise ComplianceError(f"{role} run {folder}: its user.conf no longer reads as it did: {e}") from e


def check_same_user_conf(perf: tuple[Path, dict], others: Sequence[tuple[Path, dict, str]]) -> None:
    """Every other run of the scenario read the same LoadGen settings from its user.conf as the performance run.

    Args:
        perf: the performance run's folder and ``run.json`` record.
        others: ``(folder, record, role)`` of the accuracy and TEST06 runs.

    Raises:
        ComplianceError: a run's user.conf is gone, or gives another value (or no value) for a setting; names the
            run, each setting with both values and both files. Command-line overrides (``--target-qps``,
            ``--min-duration-s``) are not user.conf settings and are not compared.
    """
    mine = _conf_settings(*perf, "performance")
    for folder, rec, role in others:
        theirs = _conf_settings(folder, rec, role)
        diff = sorted(k for k in set(mine) | set(theirs) if value_key(mine.get(k)) != value_key(theirs.get(k)))
        if diff:
            raise ComplianceError(
                f"{role} run {folder} read other LoadGen settings from its user.conf than the performance run: "
                + ", ".join(f"{k} {theirs.get(k)!r} vs {mine.get(k)!r}" for k in diff)
                + f" ({kept_user_conf(folder, rec, role)} vs {kept_user_conf(*perf, 'performance')}); the tree "
                "holds one user.conf per scenario, so make the scenario's runs with the same file")
