"""Check a LoadGen ``user.conf`` before LoadGen reads it: every line must apply to this run.

LoadGen (mlcommons-loadgen 6.0.17, ``loadgen/test_settings_internal.cc``,
``TestSettings::FromConfig``) reads a user.conf line by line (lines end at ``\\n``) and splits each
line at whitespace. A token ``#`` standing alone before the value ends the line; otherwise the
first token is the key, the second must be ``=`` and the third is the value, which must parse as
a whole as an integer (C ``strtoul``, base 0) or a double (``strtod``), else ``FromConfig``
fails. Keys are ``model.scenario.setting``, and LoadGen then looks every setting it knows up
for the run's model key and scenario, by exact, case-sensitive string match, in the order
``model.scenario``, ``*.scenario``, ``model.*``, ``*.*`` (the last line of one key wins).

Anything else is stored and never read, without a word: a line for another model key
(``llama3_1-8b`` lines in a ``--model-key llama3_1-8b-edge`` run), a misspelt model key
(``llama3.1-8b``) or scenario (``offline``), an unknown setting, a setting of another scenario
(``Server``'s ``target_latency`` in an Offline run), a setting LoadGen reads only from its own
mlperf.conf (the RNG seeds), ``key=value`` without spaces, a line shadowed by a more specific
or later one, or an integer setting written as ``1.5e5`` (read as 1). :func:`check_user_conf`
refuses every such line with :class:`~sut.errors.InputError` naming the file and the line, before
anything starts, with one exception: a well-formed line for another model key of this benchmark
(:data:`sut.constants.MODEL_KEYS`) or another LoadGen scenario is allowed, because one user.conf
commonly holds every run of a system (Offline and Server lines), and so is a line shadowed in this run that
another run of :data:`sut.scenarios.LOADGEN_RUNS` takes its setting from (``*.Server.target_qps`` after a
``llama3_1-8b.Server`` line serves the Interactive run); both are logged, and a file in which
no line at all applies to the run (the shipped ``llama3_1-8b`` files with ``--model-key
llama3_1-8b-interactive``) is refused. It also refuses ``mode`` (the harness sets LoadGen's mode from ``--mode``).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sut.constants import MODEL_KEYS
from sut.errors import InputError
from sut.scenarios import LOADGEN_RUNS

log = logging.getLogger(__name__)

#: Settings LoadGen looks up under the run's own scenario (or ``*``); value type ``int`` or ``float``.
SCENARIO_SETTINGS = {
    "mode": int, "use_token_latencies": int, "infer_token_latencies": int, "token_latency_scaling_factor": int,
    "performance_issue_unique": int, "performance_issue_same": int, "performance_issue_same_index": int,
    "sample_concatenate_permutation": int, "min_duration": int, "max_duration": int, "min_query_count": int,
    "max_query_count": int, "performance_sample_count_override": int, "accuracy_sample_count_override": int,
    "print_timestamps": int, "accuracy_log_rng_seed": int, "accuracy_log_sampling_target": int,
}
#: Settings LoadGen looks up under one fixed scenario only, whatever the run's scenario is.
FIXED_SCENARIO_SETTINGS = {
    "SingleStream": {"target_latency_percentile": float, "target_latency": float},
    "MultiStream": {"target_latency_percentile": float, "samples_per_query": int, "target_latency": float},
    "Server": {"target_latency_percentile": float, "target_latency": int, "target_qps": float, "ttft_latency": int,
               "tpot_latency": int, "coalesce_queries": int, "max_async_queries": int},
    "Offline": {"target_qps": float},
}
#: Settings LoadGen reads only from its embedded mlperf.conf (``conf_type == 0``); a user.conf line is ignored.
MLPERF_CONF_ONLY = ("qsl_rng_seed", "sample_index_rng_seed", "schedule_rng_seed", "accuracy_log_probability",
                    "test05", "test05_qsl_rng_seed", "test05_sample_index_rng_seed", "test05_schedule_rng_seed")
#: Settings the harness sets itself after ``FromConfig``, so that a user.conf value never takes effect.
SET_BY_HARNESS = {"mode": "the harness sets LoadGen's mode from --mode (performance or accuracy)"}

_WS = re.compile(r"[ \t\n\v\f\r]+")  # C isspace in the "C" locale, what `iss >> s` splits at
_INT = re.compile(r"(0|[1-9][0-9]*|0[xX][0-9a-fA-F]+)")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|0[xX][0-9a-fA-F]+")
_PRIORITY = ("{m}.{s}", "*.{s}", "{m}.*", "*.*")  # LoadGen's lookup order


@dataclass(frozen=True)
class ConfLine:
    """One ``key = value`` line that LoadGen stores.

    Attributes:
        number: 1-based line number in the file.
        key: the full key, e.g. ``llama3_1-8b.Offline.target_qps``.
        value: the value token LoadGen keeps (the last one on the line).
        text: the line as written (stripped), for messages.
    """

    number: int
    key: str
    value: str
    text: str


def _loadgen_number(tok: str) -> bool:
    """Whether LoadGen's parser accepts ``tok`` as a value (approximately strtoul/strtod consuming it whole)."""
    if _INT.fullmatch(tok.lstrip("+-")) or _FLOAT.fullmatch(tok):
        return True
    return tok.lstrip("+-").lower() in ("inf", "infinity", "nan")


def parse_lines(path: Path, raw: bytes) -> list[ConfLine]:
    """The ``key = value`` lines of a user.conf as LoadGen tokenizes it.

    Raises ``InputError`` naming the file and line for a line LoadGen would reject (FromConfig
    fails: no ``=``, a value that is not a number, a comment after the value) or silently drop
    (a key without ``= value``, e.g. ``key=value`` written without spaces), or for several values
    on one line (LoadGen keeps only the last).
    """
    out = []
    for number, bline in enumerate(raw.split(b"\n"), start=1):
        text = bline.decode("utf-8", errors="replace").strip(" \t\n\v\f\r")
        toks = [t for t in _WS.split(text) if t]
        if not toks or toks[0] == "#":
            continue
        where = f"{path}, line {number} ({text!r})"
        commented = toks[0].startswith("#")
        if len(toks) >= 2 and toks[1] == "#" and not commented:
            raise InputError(f"{where}: LoadGen ignores this line silently: a key without '= value'")
        if len(toks) >= 2 and toks[1] != "=":
            hint = ("; LoadGen treats '#' as a comment only when a space follows it ('# ...')" if commented
                    else "; write 'model.scenario.setting = value' with spaces around '='")
            raise InputError(f"{where}: LoadGen rejects this line: expected 'key = value'{hint}")
        if commented:  # '#key' alone or '#key = number': stored under a key nobody reads, as meant
            if len(toks) >= 3 and not _loadgen_number(toks[2]):
                raise InputError(f"{where}: LoadGen rejects this line (it reads '{toks[0]}' as a key, not a "
                                 "comment); put a space after '#'")
            continue
        if len(toks) < 3:
            raise InputError(f"{where}: LoadGen ignores this line silently: it needs 'model.scenario.setting = value'"
                             " with spaces around '='")
        if any(t.startswith("#") for t in toks[2:]):
            raise InputError(f"{where}: LoadGen rejects a comment after the value; put the comment on its own line")
        bad = [t for t in toks[2:] if not _loadgen_number(t)]
        if bad:
            raise InputError(f"{where}: LoadGen rejects this line: value {bad[0]!r} is not a number")
        if len(toks) > 3:
            raise InputError(f"{where}: one value per line (LoadGen would silently keep only the last, {toks[-1]!r})")
        out.append(ConfLine(number, toks[0], toks[2], text))
    return out


def _line_problem(line: ConfLine, model_key: str, scenario: str) -> str | None:
    """Why ``line`` cannot apply to a run of ``model_key``/``scenario``, or None if LoadGen uses it."""
    parts = line.key.rsplit(".", 2)
    if len(parts) != 3 or not all(parts):
        return "the key must have the form model.scenario.setting (LoadGen never looks this key up)"
    model, scen, setting = parts
    if model not in (*MODEL_KEYS, "*"):
        return (f"model key {model!r} is not a LoadGen model key of this benchmark ({', '.join(MODEL_KEYS)} or '*'), "
                f"so LoadGen never uses the line; write {model_key}.{scen}.{setting} (model keys use '_' and are "
                "case-sensitive; --model-key picks the run's)")
    known_scenarios = ("*", *FIXED_SCENARIO_SETTINGS)
    if scen not in known_scenarios:
        close = [s for s in known_scenarios if s.lower() == scen.lower()]
        return (f"scenario {scen!r} is not a LoadGen scenario" + (f" (they are case-sensitive: {close[0]!r})" if close
                                                                   else f" ({', '.join(known_scenarios)})"))
    if model not in (model_key, "*") or scen not in (scenario, "*"):
        known = {*SCENARIO_SETTINGS, *MLPERF_CONF_ONLY}
        known |= {k for sc, keys in FIXED_SCENARIO_SETTINGS.items() if scen in (sc, "*") for k in keys}
        if setting not in known:
            close = difflib.get_close_matches(setting, sorted(known), n=1)
            return f"LoadGen has no setting {setting!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        return OTHER_RUN
    if setting in MLPERF_CONF_ONLY:
        return f"LoadGen reads {setting} only from its embedded mlperf.conf, never from a user.conf"
    if setting in SET_BY_HARNESS:
        return SET_BY_HARNESS[setting]
    if setting in SCENARIO_SETTINGS or setting in FIXED_SCENARIO_SETTINGS.get(scenario, {}):
        return None
    users = [s for s, keys in FIXED_SCENARIO_SETTINGS.items() if setting in keys]
    if users:
        return f"LoadGen reads {setting} for {' and '.join(users)} only; it has no effect in the {scenario} scenario"
    known = sorted({*SCENARIO_SETTINGS, *FIXED_SCENARIO_SETTINGS.get(scenario, {})} - set(SET_BY_HARNESS))
    close = difflib.get_close_matches(setting, known, n=1)
    return (f"LoadGen has no setting {setting!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; {scenario} settings: {', '.join(known)}")


#: _line_problem's answer for a well-formed line of another model key or scenario of this benchmark: one
#: user.conf may hold the lines of every run of a system (Offline and Server, or the interactive key).
OTHER_RUN = "for another run"


def _setting_type(setting: str, scenario: str) -> type:
    return SCENARIO_SETTINGS.get(setting) or FIXED_SCENARIO_SETTINGS[scenario][setting]


def _read_conf(path: Path) -> bytes:
    """The bytes of a user.conf; ``InputError`` if unreadable, with a byte-order mark or with NUL bytes."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"user.conf {path} cannot be read: {e.strerror or e}") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise InputError(f"{path}: starts with a UTF-8 byte-order mark, which LoadGen reads as part of the first "
                         "key; save the file without BOM")
    if b"\x00" in raw:
        raise InputError(f"{path}: holds NUL bytes (UTF-16?); LoadGen reads a user.conf as plain ASCII text")
    return raw


#: A float value as the harness accepts it: decimal digits, an optional fraction and exponent.
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _check_value(path: Path, line: ConfLine, setting: str, scenario: str) -> None:
    """An integer setting needs plain digits (C strtoull), a float setting a finite number."""
    kind = _setting_type(setting, scenario)
    if kind is int and not _INT.fullmatch(line.value):
        raise InputError(f"{path}, line {line.number} ({line.text!r}): {setting} is a whole number; LoadGen "
                         f"reads {line.value!r} with C strtoull (a fraction or exponent is cut, a sign wraps, a "
                         "leading 0 is octal); write digits only")
    if kind is float and line.value.lstrip("+-").lower() in ("inf", "infinity", "nan"):
        raise InputError(f"{path}, line {line.number} ({line.text!r}): {setting} must be a finite number")
    if kind is float and not _DECIMAL.fullmatch(line.value):
        raise InputError(f"{path}, line {line.number} ({line.text!r}): {setting} must be a decimal number; LoadGen "
                         f"reads {line.value!r} with C strtod (hexadecimal, or a number followed by other text)")
    if setting == "target_qps" and float(line.value) <= 0:
        raise InputError(f"{path}, line {line.number} ({line.text!r}): target_qps must be a positive number")


def _sort_lines(path: Path, lines: list[ConfLine], model_key: str,
                scenario: str) -> tuple[list[tuple[str, ConfLine]], list[ConfLine]]:
    """``(applying, others)``: ``(setting, line)`` of every line LoadGen reads for this run, and the
    well-formed lines of another run; ``InputError`` for any other line or a bad value."""
    applying: list[tuple[str, ConfLine]] = []
    others = []
    for line in lines:
        problem = _line_problem(line, model_key, scenario)
        if problem == OTHER_RUN:
            others.append(line)
            continue
        if problem:
            raise InputError(f"{path}, line {line.number} ({line.text!r}): {problem}")
        setting = line.key.rsplit(".", 2)[2]
        _check_value(path, line, setting, scenario)
        applying.append((setting, line))
    return applying, others


def _rank(line: ConfLine) -> int:
    """The line's place in LoadGen's lookup order (``_PRIORITY``: 0 = most specific)."""
    model, scen, _ = line.key.rsplit(".", 2)
    return _PRIORITY.index(f"{'{m}' if model != '*' else '*'}.{'{s}' if scen != '*' else '*'}")


def _winners(applying: list[tuple[str, ConfLine]]) -> dict[str, ConfLine]:
    """``{setting: line LoadGen uses}`` among lines that all apply to one run (the most specific key, then the last
    line)."""
    chosen: dict[str, tuple[int, ConfLine]] = {}
    for setting, line in applying:
        rank = _rank(line)
        if setting not in chosen or rank <= chosen[setting][0]:
            chosen[setting] = (rank, line)
    return {s: ln for s, (_, ln) in chosen.items()}


def _used_by_another_run(line: ConfLine, lines: list[ConfLine]) -> str | None:
    """``model.scenario`` of another run of this benchmark (``LOADGEN_RUNS``) for which LoadGen takes ``line``'s
    setting from ``line``, or None: one user.conf may hold every run's lines, so a ``*`` line shadowed in this run
    can be the one another run uses."""
    model, scen, setting = line.key.rsplit(".", 2)
    for mk, sc in LOADGEN_RUNS:
        if model not in (mk, "*") or scen not in (sc, "*"):
            continue
        same = [(setting, ln) for ln in lines if len(parts := ln.key.rsplit(".", 2)) == 3
                and parts[2] == setting and parts[0] in (mk, "*") and parts[1] in (sc, "*")]
        if _winners(same).get(setting) is line:
            return f"{mk}.{sc}"
    return None


def _chosen(path: Path, applying: list[tuple[str, ConfLine]], lines: list[ConfLine]) -> dict[str, ConfLine]:
    """``{setting: line LoadGen uses}`` (the most specific key, then the last line; ``_PRIORITY``);
    ``InputError`` for a line another one overrides that no other run of the benchmark uses either (``lines``: all
    of the file's lines)."""
    chosen = _winners(applying)
    for setting, line in applying:
        used = chosen[setting]
        if used is line:
            continue
        other = _used_by_another_run(line, lines)
        if other is None:
            raise InputError(f"{path}, line {line.number} ({line.text!r}): ignored by LoadGen, which takes {setting} "
                             f"from line {used.number} ({used.text!r}: the more specific key, or the later line of "
                             "the same key); remove one of them")
        log.info("%s, line %d (%r): this run takes %s from line %d; the line is for %s runs", path, line.number,
                 line.text, setting, used.number, other)
    return chosen


def check_user_conf(path: str | os.PathLike, model_key: str, scenario: str,
                    target_qps_given: bool = False) -> dict[str, str]:
    """Refuse a user.conf with any line that LoadGen would ignore or misread for this run.

    Args:
        path: the user.conf file.
        model_key: the LoadGen model key of the run (``llama3_1-8b``, ...).
        scenario: the run's LoadGen scenario (``Offline``).
        target_qps_given: ``--target-qps`` is set for this run (a dev run, e.g. a python -m sut find-qps
            try): a file none of whose lines apply is then accepted when every line is a
            ``target_qps`` line of another run, or when it has no line at all (the target comes from the
            command line, every other setting from mlperf.conf); any other setting keyed for another run is
            still refused. Without it, a file with no setting (empty, comments only) is refused.

    Returns:
        ``{setting: value}`` of the lines LoadGen will use, e.g. ``{"target_qps": "34"}``.

    Raises:
        InputError: naming the file and the line: unreadable file, a byte-order mark or NUL bytes,
            a line LoadGen rejects or ignores (see the module docstring), an integer setting
            whose value is not a plain whole number, a non-finite value, or a line overridden
            by another line of the file.
    """
    path = Path(path)
    lines = parse_lines(path, _read_conf(path))
    applying, others = _sort_lines(path, lines, model_key, scenario)
    chosen = _chosen(path, applying, lines)
    values = {s: ln.value for s, ln in chosen.items()}
    if "token_latency_scaling_factor" in values and _int_value(values.get("infer_token_latencies", "0")) != 1:
        line = chosen["token_latency_scaling_factor"]
        raise InputError(f"{path}, line {line.number} ({line.text!r}): LoadGen reads token_latency_scaling_factor "
                         "only when infer_token_latencies = 1")
    only_targets = all(ln.key.rsplit(".", 1)[1] == "target_qps" for ln in others)
    if others and not applying and not (target_qps_given and only_targets):
        keys = sorted({ln.key.rsplit(".", 1)[0] for ln in others})
        raise InputError(f"{path}: no line applies to this run ({model_key}.{scenario}): its lines are keyed "
                         f"{', '.join(keys)}, so LoadGen would run with its defaults; add {model_key}.{scenario}.* "
                         "lines (or '*' keys), or pick the matching --model-key / --scenario")
    if not others and not applying and not target_qps_given:
        raise InputError(f"{path}: no setting in it (empty, or comments only), so LoadGen would run with its defaults "
                         f"(target_qps 1); add a {model_key}.{scenario}.target_qps line (or pass --target-qps for a dev "
                         "run)")
    if others:  # one line for all: a file with every scenario's lines is the usual case, not a problem
        each = ", ".join(f"line {ln.number} ({ln.key.rsplit('.', 1)[0]})" for ln in others)
        verb, them = ("is for another run", "it") if len(others) == 1 else ("are for other runs", "them")
        log.info("%s: %s %s, not %s.%s; LoadGen ignores %s here", path, each, verb, model_key, scenario, them)
    return values


def _int_value(tok: str) -> int:
    return int(tok, 16) if tok.lower().startswith("0x") else int(tok)


def value_key(text: str | None) -> float | str | None:
    """A user.conf value as LoadGen reads it, for comparing two files' settings: ``3``, ``3.0``, ``+3`` and
    ``0x3`` are one number (a float); text that is no number is returned as it is; None stays None."""
    if text is None:
        return None
    tok = text.lstrip("+")
    if _INT.fullmatch(tok):
        return float(_int_value(tok))
    try:
        return float(text)
    except ValueError:
        return text


#: LoadGen's TestMode values (loadgen/test_settings.h: SubmissionRun 0, AccuracyOnly 1, PerformanceOnly 2,
#: FindPeakPerformance 3): the ``mode`` an audit config may set.
_TEST_MODES = ("0", "1", "2", "3")


def check_audit_config(path: str | os.PathLike) -> None:
    """Refuse an audit config (``--audit-config``; LoadGen reads it as it reads a user.conf) with a line LoadGen
    would reject or drop (:func:`parse_lines`), no setting at all, or a ``mode`` outside LoadGen's TestMode values.
    ``InputError`` naming the file and the line."""
    path = Path(path)
    lines = parse_lines(path, _read_conf(path))
    if not lines:
        raise InputError(f"audit config {path}: no setting in it (empty, or comments only)")
    for ln in lines:
        if ln.key.rsplit(".", 1)[-1] == "mode" and ln.value not in _TEST_MODES:
            raise InputError(f"{path}, line {ln.number} ({ln.text!r}): mode must be one of LoadGen's test modes "
                             f"{', '.join(_TEST_MODES)} (2: performance, 1: accuracy), got {ln.value!r}")
