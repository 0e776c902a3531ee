"""``python -m sut run``'s settings: its flags and preset (``--config``) merged into ``RunSettings``,
``EngineSettings``, ``GenerationSettings`` and the chosen backend's options object (``settings_from_args``).

A preset fills the fields from its sections ``[run]``, ``[engine]`` (with per-scenario tables
``[engine.<scenario>]``), ``[generation]`` and ``[options]``; flags given on the command line win over the
preset, and ``--option KEY=VALUE`` over the backend's own flags. Every error is ``BadInput`` (exit 2) naming
the flag, preset field or option at fault. The flags themselves are declared in ``sut.cli`` and
``sut.settings.flags``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

from sut.base import get_sut, sut_names
from sut.engine import EngineSettings, GenerationSettings, settings_from_mapping
from sut.errors import BadInput, InputError
from sut.scenarios import HARNESS_SCENARIOS
from sut.settings.flags import backend_options_from_args, engine_overrides, engine_settings_from_args, json_or_str
from sut.settings.run import RunSettings


def _preset(path: str | None) -> dict:
    if not path:
        return {}
    if Path(path).exists() and not Path(path).is_file():  # a folder, or a FIFO that would block the read
        raise BadInput(f"error: preset {path} is not a regular file")
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise BadInput(f"error: preset not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        bom = " (the file starts with a UTF-8 byte-order mark, which TOML does not allow: save it without)" \
            if _starts_with_bom(path) else ""
        raise BadInput(f"error: {path}: malformed TOML: {e}{bom}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 (a UTF-16 or binary file)
        raise BadInput(f"error: {path}: not UTF-8 text, as TOML must be (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise BadInput(f"error: {path}: malformed TOML: nested deeper than Python's recursion limit") from None
    except OSError as e:
        raise BadInput(f"error: preset {path} cannot be read: {e.strerror or e}") from None
    unknown = set(data) - {"run", "engine", "generation", "options"}
    if unknown:
        raise BadInput(f"error: {path}: unknown section(s) {sorted(unknown)}; use run, engine, generation, options")
    for name, section in data.items():
        if not isinstance(section, dict):
            raise BadInput(f"error: {path}: {name} must be a table ([{name}] with key = value lines), got "
                           f"{type(section).__name__} {section!r}")
    return data


def _starts_with_bom(path) -> bool:
    """True when file ``path`` begins with the UTF-8 byte-order mark (as some Windows editors save)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(3) == b"\xef\xbb\xbf"
    except OSError:
        return False


def _scenario_engine(engine: dict, scenario: str, path: str | None) -> dict:
    """A preset's ``[engine]`` for ``scenario``: its plain keys, then those of its ``[engine.<scenario>]`` table
    on top (e.g. ``[engine.Interactive] max_num_batched_tokens = 2048``; flags override both).

    Every scenario's table is checked, not only this run's (a typo in ``[engine.Interactive]`` stops an Offline
    run too, before anything starts): ``BadInput`` naming the file and table for a table that is not named after
    a scenario or a value ``EngineSettings`` refuses (where the plain keys alone are accepted; their own errors
    are reported with the run's settings)."""
    plain = {k: v for k, v in engine.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in engine.items() if isinstance(v, dict)}
    for name, table in tables.items():
        if name not in HARNESS_SCENARIOS:
            raise BadInput(f"error: {path}: [engine.{name}] is not a scenario; per-scenario engine settings go in "
                           f"{', '.join(f'[engine.{s}]' for s in HARNESS_SCENARIOS)}")
        if "model" in table:  # else an Offline run would never look at the Server run's model
            raise BadInput(f"error: {path}: [engine.{name}] sets model: a preset's scenarios run one model, set in "
                           "[engine] (or by --model)")
        if _engine_error({"model": "m", **plain}) is None:
            err = _engine_error({"model": "m", **plain, **table})
            if err is not None:
                raise BadInput(f"error: {path}: [engine.{name}]: {err.replace('preset [engine] ', f'preset [engine.{name}] ')}")
    return {**plain, **tables.get(scenario, {})}


def _engine_error(values: dict) -> str | None:
    """What ``EngineSettings`` says against ``values`` (None: accepted)."""
    try:
        settings_from_mapping(EngineSettings, values)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _parse_option(s: str):
    if "=" not in s:
        raise BadInput(f"error: --option {s!r}: expected KEY=VALUE")
    k, v = s.split("=", 1)
    if not k.strip():
        raise BadInput(f"error: --option {s!r}: expected KEY=VALUE, the KEY is empty")
    return k, json_or_str(v)


#: The ``[run]`` keys that a flag of the same name (``--max-samples`` for max_samples) overrides.
RUN_FLAG_KEYS = ("sut", "scenario", "mode", "dataset", "output_dir", "user_conf", "model_key", "run_name",
                 "audit_config", "compliance_test", "tokenizer", "max_samples", "min_duration_s", "min_query_count",
                 "target_qps", "stall_timeout_s")


def _run_fields(a: argparse.Namespace, run: dict) -> dict:
    """``run`` (a preset's ``[run]``) overridden by the run flags given; ``preset`` is the ``--config`` file."""
    if "preset" in run:
        raise BadInput(f"error: {a.config}: [run] preset is not a preset key (the preset is the --config file itself)")
    if a.config:
        run["preset"] = str(a.config)
        _check_preset_user_conf(a, run)
    for key in RUN_FLAG_KEYS:
        val = getattr(a, key)
        if val is not None:
            run[key] = val
    if a.quick:
        run["quick"] = True  # RunSettings fills min_duration_s / min_query_count unless given
    if a.no_accuracy_gate:
        run["accuracy_gate"] = False
    if a.enable_trace:
        run["enable_trace"] = True
    if a.no_progress:
        run["progress"] = False
    if getattr(a, "verbose", False) or getattr(a, "run_verbose", False):
        run["engine_console"] = True
    run.setdefault("sut", "vllm")
    if "dataset" not in run:
        raise BadInput("error: --dataset is required (or [run] dataset in the preset)")
    return run


def _check_preset_user_conf(a: argparse.Namespace, run: dict) -> None:
    """The preset's own ``[run] user_conf`` (when no flag overrides it), named with the preset file: ``BadInput`` for
    a user.conf that is not there (a relative path is read from the current folder, as a flag's is)."""
    conf = run.get("user_conf")
    if a.user_conf is None and isinstance(conf, str) and not Path(conf).is_file():
        raise BadInput(f"error: {a.config}: [run] user_conf {conf!r} is not a file (relative paths are read from the "
                       f"current folder, {Path.cwd()}: run from the repository root, or give --user-conf)")


def backend_options_from_cli(a: argparse.Namespace, sut: str, preset: dict):
    """The options object of backend ``sut``: the preset's ``[options]``, then its own flags, then
    ``--option KEY=VALUE`` (later wins), parsed once by the backend's ``check_options``.

    Raises ``BadInput`` for an unknown SUT, a flag of another backend, an unknown key or a bad value.
    """
    try:
        backend = get_sut(sut)
    except KeyError as e:  # a preset's [run] sut is named as such
        where = f"{a.config}: [run] sut: " if getattr(a, "sut", None) is None and getattr(a, "config", None) else ""
        raise BadInput(f"error: {where}{e.args[0]}") from None
    values, foreign = backend_options_from_args(a, sut)
    if foreign:
        fields = sorted(a.backend_flags[flag].field for flag, _ in foreign)
        where = "; ".join(f"{flag} belongs to --sut {' / '.join(owners)}" for flag, owners in foreign)
        raise BadInput(f"error: --sut {sut}: unknown option(s) {', '.join(fields)} ({where})")
    opts = {**preset, **values}
    from_preset = set(preset) - set(values)  # the preset's values no flag replaced
    for s in a.option:
        k, v = _parse_option(s)
        opts[k] = v
        from_preset.discard(k)
    ocls = backend.options_cls()
    has_flags = any(sut in bf.backends for bf in (getattr(a, "backend_flags", None) or {}).values())
    see = f" (see the {sut} SUT options in python -m sut run --help)" if has_flags else ""
    known = {f.name for f in dataclasses.fields(ocls)} if ocls is not None else set()
    if ocls is not None and set(opts) - known:
        raise BadInput(f"error: --sut {sut}: unknown option(s) {', '.join(sorted(set(opts) - known))}"
                       f"{_preset_options_note(a, sut, set(preset) - known)}; known: {', '.join(sorted(known))}{see}")
    try:
        return backend.check_options(opts)
    except InputError as e:
        named = [k for k in sorted(from_preset) if re.search(rf"(?<![\w-]){re.escape(k)}\b", str(e))]
        where = f" (from the [options] table of {a.config}: {', '.join(named)})" if named and a.config else ""
        raise BadInput(f"error: {e}{where}{see}") from None


def _preset_options_note(a: argparse.Namespace, sut: str, unknown: set) -> str:
    """" (from the preset's [options] ...)" when some unknown options come from the preset file, naming the SUT(s)
    that take them (a preset written for another SUT, e.g. flame_b32.toml with --sut vllm); "" otherwise."""
    if not unknown:
        return ""
    owners = []
    for name in sut_names():
        ocls = get_sut(name).options_cls() if name != sut else None
        if ocls is not None and unknown <= {f.name for f in dataclasses.fields(ocls)}:
            owners.append(name)
    whose = f": they are --sut {' / '.join(owners)} options" if owners else ""
    return (f" (from the [options] table of {getattr(a, 'config', None) or 'the preset'}{whose}; the same command "
            f"with a preset written for --sut {sut}, or without --config, builds the same engine from its flags)")


#: Settings class -> the preset table its unknown fields come from (flags are checked by argparse already).
_PRESET_TABLES = {"RunSettings": "run", "GenerationSettings": "generation", "EngineSettings": "engine"}


def _preset_table_of(message: str, pre: dict) -> str | None:
    """The preset table (``run``, ``engine``, ``generation``) holding a key that ``message`` (a settings error)
    names, e.g. "EngineSettings.max_num_seqs must be an integer" -> "engine"; None when no preset key is named."""
    for table in ("engine", "run", "generation"):
        keys = [k for k, v in (pre.get(table) or {}).items() if not isinstance(v, dict)]
        if any(re.search(rf"(?<![\w.-]){re.escape(k)}\b", message.replace(".", " ")) for k in keys):
            return table
    return None


def settings_from_args(a: argparse.Namespace) -> tuple[RunSettings, EngineSettings, GenerationSettings, object]:
    """Merge preset and flags into the three settings objects and the backend's options object.

    Raises ``BadInput`` (exit 2) naming the flag, preset field or option at fault.
    """
    pre = _preset(a.config)
    run = _run_fields(a, dict(pre.get("run", {})))
    gen = dict(pre.get("generation", {}))
    if a.benchmark_ignore_eos:
        gen["ignore_eos"] = True
    engine = _scenario_engine(pre.get("engine", {}), str(run.get("scenario", "Offline")), a.config)
    try:
        es = engine_settings_from_args(a, engine, model_hint=" (or [engine] model in the preset)")
    except BadInput as e:  # name the preset when the key at fault is one of its [engine] keys
        msg = str(e).removeprefix("error: ")
        from_preset = {k: v for k, v in engine.items() if k not in engine_overrides(a)}  # not overridden by a flag
        if a.config and a.config not in msg and _preset_table_of(msg, {"engine": from_preset}):
            raise BadInput(f"error: {a.config} [engine]: {msg}") from None
        raise
    try:
        rs, gs = settings_from_mapping(RunSettings, run), settings_from_mapping(GenerationSettings, gen)
    except (ValueError, TypeError) as e:
        table = next((t for cls, t in _PRESET_TABLES.items() if str(e).startswith(f"unknown {cls} field")), None)
        flagged = {k for k in RUN_FLAG_KEYS if getattr(a, k, None) is not None}  # the flag gave these, not the preset
        given = {"run": {k: v for k, v in (pre.get("run") or {}).items() if k not in flagged},
                 "generation": pre.get("generation")}
        table = table or _preset_table_of(str(e), given)
        where = f"{a.config} [{table}]: " if a.config and table and a.config not in str(e) else ""
        raise BadInput(f"error: {where}{e}") from None
    _check_engine_first(rs.sut, es)
    return rs, es, gs, backend_options_from_cli(a, rs.sut, dict(pre.get("options", {})))


def _check_engine_first(sut: str, es: EngineSettings) -> None:
    """The backend's host-independent engine check (``check_settings``) before its options are checked, which
    contacts the URLs of ``--sut vllm-http``: a setting the backend refuses (e.g. a preset's admission interval over
    HTTP) is named before any server is. ``BadInput``; an unknown SUT is left to the options' check."""
    try:
        backend = get_sut(sut)
    except KeyError:
        return
    try:
        backend.check_settings(es)
    except InputError as e:
        raise BadInput(f"error: {e}") from None
