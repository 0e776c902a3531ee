"""Backend options parsed once: flags from the options dataclasses' metadata, a flag of another
backend refused by name, the parsed object reaching the backend and run.json, and the one exit-code map
(``sut.exits``) of every entry point.

Two test backends are registered here (importing this module registers them): ``cli-recording`` (a
``TransportSUT`` over the fake transport whose options dataclass declares flags; it records the options
object it gets) and ``cli-plain`` (no options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env
from transport_doubles import FakeOptions, FakeTransport

from accuracy.errors import AccuracyInputError
from sut import cli, errors, exits
from sut.base import SystemUnderTest, register_sut
from sut.core.loadgen_sut import TransportSUT
from sut.core.transport import register_transport
from sut.errors import BadInput, InputError, RunFailed
from sut.settings.flags import add_backend_flags, backend_options_from_args, option_flags
from sut.settings.from_args import settings_from_args
from sut.settings.parser import backend_options_classes

#: What the recording backend saw (in this process): options given to check_options as a mapping, the
#: object SUTContext.options held, the object the transport got.
PARSED: list = []
SUT_GOT: list = []
TRANSPORT_GOT: list = []


@dataclass(frozen=True)
class RecordingOptions(FakeOptions):
    label: str = field(default="none", metadata={"flag": "--rec-label", "help": "a label (mark: not compliant)"})
    rec_chunk: int = field(default=7, metadata={"flag": "--rec-chunk", "help": "a number"})
    rec_switch: bool = field(default=False, metadata={"flag": "--rec-switch", "help": "a switch"})
    rec_note: Optional[str] = field(default=None, metadata={"flag": "--rec-note", "help": "an optional text"})
    no_flag: int = 3  # no metadata: only --option no_flag=...


@register_transport("cli-recording")
class RecordingTransport(FakeTransport):
    options_cls = RecordingOptions

    def __init__(self, spec):
        TRANSPORT_GOT.append(spec.options)
        super().__init__(spec)


@register_sut("cli-recording")
class RecordingSUT(TransportSUT):
    transport_name = "cli-recording"

    @classmethod
    def check_options(cls, options):
        if not isinstance(options, RecordingOptions):
            PARSED.append(dict(options or {}))
        return super().check_options(options)

    @classmethod
    def noncompliance_reasons(cls, options) -> list[str]:
        return ["recording backend labelled mark"] if options.label == "mark" else []

    def __init__(self, ctx, transport=None):
        SUT_GOT.append(ctx.options)
        super().__init__(ctx, transport)


@register_sut("cli-plain")
class PlainSUT(SystemUnderTest):
    """A backend without options (never started here)."""

    def start(self):
        raise AssertionError("not started in these tests")

    def issue_queries(self, samples):
        raise AssertionError

    def stop(self):
        pass


def _parse(*args: str) -> argparse.Namespace:
    a = cli.build_parser().parse_args(["run", "--dataset", "x.json", "--model", str(TINY_MODEL), *args])
    a.argv = []
    return a


# ----------------------------------------------------------------------------- flags from metadata
def test_backend_flags_come_from_the_options_dataclass_metadata():
    flags = {flag: (name, kw) for flag, name, kw in option_flags(RecordingOptions)}
    assert set(flags) == {"--rec-label", "--rec-chunk", "--rec-switch", "--rec-note"}  # no_flag has none
    assert flags["--rec-chunk"][1]["type"] is int and flags["--rec-note"][1]["type"] is str
    assert flags["--rec-switch"][1]["action"] is argparse.BooleanOptionalAction
    assert "a number (default 7) (= --option rec_chunk=...)" == flags["--rec-chunk"][1]["help"]

    p = argparse.ArgumentParser()
    table = add_backend_flags(p, {"cli-recording": RecordingOptions, "cli-plain": None})
    help_text = p.format_help()
    assert "cli-recording SUT options:" in help_text and "cli-plain SUT options" not in help_text
    a = p.parse_args(["--rec-chunk", "5", "--no-rec-switch", "--rec-note", "hi"])
    assert backend_options_from_args(a, "cli-recording") == ({"rec_chunk": 5, "rec_switch": False, "rec_note": "hi"}, [])
    assert backend_options_from_args(a, "cli-plain")[1] == [(f, ("cli-recording",)) for f in
                                                            ("--rec-chunk", "--rec-switch", "--rec-note")]
    assert table["--rec-label"].field == "label"


def test_a_flag_two_backends_declare_is_added_once_and_a_conflicting_one_is_refused():
    @dataclass(frozen=True)
    class Same:
        rec_chunk: int = field(default=1, metadata={"flag": "--rec-chunk", "help": "n"})

    @dataclass(frozen=True)
    class Clash:
        rec_chunk: str = field(default="1", metadata={"flag": "--rec-chunk", "help": "n"})

    p = argparse.ArgumentParser()
    table = add_backend_flags(p, {"cli-recording": RecordingOptions, "other": Same})
    assert table["--rec-chunk"].backends == ("cli-recording", "other")
    assert "(also --sut other)" in " ".join(p.format_help().split())
    assert backend_options_from_args(p.parse_args(["--rec-chunk", "2"]), "other") == ({"rec_chunk": 2}, [])
    with pytest.raises(ValueError, match="--rec-chunk: --sut other"):
        add_backend_flags(argparse.ArgumentParser(), {"cli-recording": RecordingOptions, "other": Clash})


def test_run_help_has_one_group_per_backend_with_its_flags(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    classes = backend_options_classes()
    assert classes["cli-recording"] is RecordingOptions and classes["cli-plain"] is None
    for name, ocls in classes.items():
        flags = option_flags(ocls) if ocls is not None else []
        assert (f"{name} SUT options:" in text) == bool(flags), name
        for flag, _, _ in flags:
            assert flag in text, (name, flag)


def test_flame_flags_come_from_the_flame_options_dataclass():
    """--batch-size and friends are declared by the flame SUT's options dataclass (its fields' metadata)."""
    import flamepy  # noqa: F401 (a required dependency: missing, the test fails)
    classes = backend_options_classes()
    flags = {flag: name for flag, name, _ in option_flags(classes["flame"])}
    assert {"--batch-size", "--batch-window-ms", "--flame-endpoint"} <= set(flags)
    opts = settings_from_args(_parse("--sut", "flame", "--batch-size", "64"))[3]
    assert isinstance(opts, classes["flame"]) and opts.batch_size == 64


# ----------------------------------------------------------------------------- parsed once, refused by name
def test_flags_preset_and_option_make_one_typed_object(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[run]\nsut = "cli-recording"\n[options]\nrec_chunk = 1\nlabel = "preset"\n')
    PARSED.clear()
    a = _parse("--config", str(preset), "--rec-chunk", "5", "--rec-switch", "--option", "label=given",
               "--option", "no_flag=9", "--option", 'rec_note="12"')
    opts = settings_from_args(a)[3]
    assert isinstance(opts, RecordingOptions)
    assert (opts.rec_chunk, opts.rec_switch, opts.label, opts.no_flag, opts.rec_note) == (5, True, "given", 9, "12")
    assert PARSED == [{"rec_chunk": 5, "label": "given", "rec_switch": True, "no_flag": 9, "rec_note": "12"}]


@pytest.mark.parametrize("args, message", [
    (["--sut", "cli-plain", "--rec-label", "x"],
     "error: --sut cli-plain: unknown option(s) label (--rec-label belongs to --sut cli-recording)"),
    (["--sut", "cli-plain", "--option", "a=1"], "--sut cli-plain: unknown option(s) a; it takes none"),
    (["--sut", "cli-recording", "--option", "bogus=1"], "--sut cli-recording: unknown option(s) bogus; known:"),
    (["--sut", "cli-recording", "--option", "rec_chunk=five"], "RecordingOptions.rec_chunk must be an integer"),
    (["--sut", "cli-recording", "--option", "label=5"], "RecordingOptions.label must be a string, got 5"),
    (["--sut", "nope"], "error: unknown SUT 'nope'"),
    (["--sut", "cli-recording", "--option", "=5"], "error: --option '=5': expected KEY=VALUE, the KEY is empty"),
])
def test_bad_backend_options_exit_2_naming_them(tmp_path, capsys, args, message):
    rc = cli.main(["run", "--dataset", "x.json", "--model", str(TINY_MODEL), "--output-dir", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_flag_value_of_the_wrong_type_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--sut", "cli-recording", "--rec-chunk", "five")
    assert e.value.code == 2 and "--rec-chunk: invalid int value: 'five'" in capsys.readouterr().err


_RUN = """
import json, sys
sys.path[:0] = [sys.argv[1]]
import test_cli_options as t
from sut import cli
rc = cli.main(sys.argv[2:])
print("RESULT " + json.dumps({"rc": rc, "parsed": t.PARSED, "sut_got": [type(o).__name__ for o in t.SUT_GOT],
                              "same_object": len(t.SUT_GOT) == 1 and t.TRANSPORT_GOT == t.SUT_GOT,
                              "got": [vars(o) for o in t.SUT_GOT]}))
"""


def test_the_parsed_object_reaches_the_backend_and_run_json(tmp_path, synthetic_small):
    """One LoadGen run over the fake transport: options parsed once, the same object in SUTContext and the
    transport spec, run.json options = its fields, the backend's and allow_prefix_caching's reasons recorded."""
    data, _ = synthetic_small
    out = subprocess.run([sys.executable, "-c", _RUN, str(REPO / "tests"), "run", "--sut", "cli-recording",
                          "--dataset", str(data), "--model", str(TINY_MODEL), "--user-conf", str(CPU_CONF), "--quick",
                          "--max-samples", "16", "--no-progress", "--output-dir", str(tmp_path),
                          "--rec-label", "mark", "--rec-chunk", "11", "--option", "out_len=3",
                          "--option", "allow_prefix_caching=true"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=180)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["rc"] == 0, out.stderr[-3000:]
    want = {"label": "mark", "rec_chunk": 11, "out_len": 3, "allow_prefix_caching": True}
    assert res["parsed"] == [want]  # parsed once, from the flags and --option
    assert res["sut_got"] == ["RecordingOptions"] and res["same_object"]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["ledger"]["completed"] == rec["ledger"]["issued"] > 0
    assert rec["options"] == dataclasses.asdict(RecordingOptions(**want)) == res["got"][0]
    reasons = "; ".join(rec["compliance"]["reasons"])
    assert "recording backend labelled mark" in reasons and "option allow_prefix_caching=true" in reasons
    assert run.name.endswith("-NOT-COMPLIANT")


# ----------------------------------------------------------------------------- one exit-code map
@pytest.mark.parametrize("exc, code", [
    (InputError("bad"), 2), (RunFailed("failed"), 1), (KeyboardInterrupt("SIGTERM"), 130),
    (BadInput("error: bad"), 2), (errors.TransportError("gone"), 1), (errors.ServerInputError("no server"), 2),
    (errors.EngineError("died"), 1), (errors.DatasetError("f.json", "bad"), 2), (errors.ScenarioError("key"), 2),
    (errors.ComplianceError("log"), 2), (AccuracyInputError("no tokenizer"), 2), (ValueError("a bug"), None),
])
def test_exit_code_map(exc, code):
    """Each error class carries its exit code (``sut.errors``); the most specific class along the MRO wins."""
    assert exits.exit_code(exc) == code


def test_exit_code_map_covers_the_project_errors():
    from accuracy.errors import AccuracyInputError
    from sut.errors import ComplianceError, DatasetError, EngineError, ScenarioError, TransportError

    assert [exits.exit_code(e) for e in (DatasetError("f.json", "bad"), ScenarioError("x"), ComplianceError("x"),
                                         AccuracyInputError("x"), TransportError("x"), EngineError("x"))] == \
        [2, 2, 2, 2, 1, 1]
    assert exits.exit_code(ValueError("a bug")) is None


def _raiser(exc):
    def f(*_a, **_k):
        raise exc
    return f


_CASES = [(InputError("input.json is bad"), 2), (RunFailed("engine 0 died"), 1), (KeyboardInterrupt(), 130)]


@pytest.mark.parametrize("exc, code", _CASES)
def test_python_m_sut_maps_exceptions(monkeypatch, tmp_path, caplog, capsys, exc, code):
    monkeypatch.setattr(cli, "cmd_synthetic", _raiser(exc))
    assert cli.main(["synthetic", "--out", str(tmp_path / "x.json")]) == code
    if code == 2:  # bad input: one "error:" line on stderr, as argparse's and BadInput's, not a log record
        assert capsys.readouterr().err == f"error: {exc}\n" and str(exc) not in caplog.text
    else:
        assert (str(exc) or "interrupted (SIGINT, Ctrl-C)") in caplog.text


@pytest.mark.parametrize("exc, code", _CASES)
def test_python_m_accuracy_maps_exceptions(monkeypatch, tmp_path, caplog, exc, code):
    import accuracy.__main__ as acc_main
    import accuracy.gate

    monkeypatch.setattr(accuracy.gate, "evaluate", _raiser(exc))
    (tmp_path / "log.json").write_text("[]")
    assert acc_main.main(["--accuracy-log", str(tmp_path / "log.json"), "--dataset", str(tmp_path / "d.json")]) == code


@pytest.mark.parametrize("exc, code", _CASES)
def test_python_m_sut_flame_maps_exceptions(monkeypatch, exc, code):
    import sut.flame.__main__ as flame_main
    from sut.flame import app

    monkeypatch.setattr(app, "render", _raiser(exc))
    assert flame_main.main(["render-app"]) == code


@pytest.mark.parametrize("exc, code", _CASES)
def test_python_m_sut_locality_maps_exceptions(monkeypatch, exc, code):
    import sut.locality.__main__ as loc_main

    monkeypatch.setattr(loc_main, "make_trace", _raiser(exc))
    assert loc_main.main(["describe", "--documents", "2"]) == code


def test_unmapped_exceptions_keep_their_traceback():
    with pytest.raises(ZeroDivisionError):
        exits.run_main(lambda: 1 / 0)


def test_a_flame_flag_with_the_standalone_sut_is_refused_naming_its_backend(tmp_path, capsys):
    import flamepy  # noqa: F401 (a required dependency: missing, the test fails)
    rc = cli.main(["run", "--dataset", "x.json", "--model", str(TINY_MODEL), "--output-dir", str(tmp_path),
                   "--sut", "vllm", "--batch-size", "64"])
    assert rc == 2 and "--batch-size belongs to --sut flame" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_python_m_accuracy_input_errors_that_are_oserrors_stay_bad_input(monkeypatch, tmp_path, capsys):
    """A missing tokenizer (TokenizerNotFoundError: an AccuracyInputError and a FileNotFoundError) is bad input,
    not "cannot write the results"."""
    import accuracy.__main__ as acc_main
    import accuracy.gate
    from accuracy.errors import TokenizerNotFoundError

    monkeypatch.setattr(accuracy.gate, "evaluate", _raiser(TokenizerNotFoundError("no tokenizer given")))
    (tmp_path / "log.json").write_text("[]")
    assert acc_main.main(["--accuracy-log", str(tmp_path / "log.json"), "--dataset", str(tmp_path / "d.json")]) == 2
    assert capsys.readouterr().err == "error: accuracy gate: bad input: no tokenizer given\n"


# ------------------------------------------------------------------------------------ per-scenario engine tables
def test_the_shipped_h200_fp8_preset_runs_interactive_with_the_prefill_chunk_its_target_was_confirmed_on():
    """h200_fp8.user.conf's Interactive 43.5 q/s was VALID over 600 s with 1,536 batched tokens a step (docs/benchmarks.md,
    2026-12-03); Offline and Server keep the preset's 8,192 and 512 sequence slots."""
    preset = str(REPO / "loadgen_configs" / "h200_fp8.toml")
    es = {sc: settings_from_args(_parse("--config", preset, "--scenario", sc))[1]
          for sc in ("Offline", "Server", "Interactive")}
    assert [(es[sc].max_num_seqs, es[sc].max_num_batched_tokens) for sc in ("Offline", "Server", "Interactive")] == \
        [(512, 8192), (512, 8192), (512, 1536)]


def test_the_h100_preset_names_its_card_and_runs_interactive_with_1536_batched_tokens_and_server_admitting_every_2nd_step():
    preset = str(REPO / "loadgen_configs" / "h100_fp8.toml")
    rs, es, _, _ = settings_from_args(_parse("--config", preset, "--scenario", "Interactive"))
    assert (rs.tuned_on, es.max_num_batched_tokens, es.max_num_seqs, es.quantization) == ("H100 80GB HBM3", 1536, 512, "fp8")
    assert rs.user_conf == "loadgen_configs/h100_fp8.user.conf"
    assert [settings_from_args(_parse("--config", preset, "--scenario", sc))[1].admit_every_steps
            for sc in ("Offline", "Server", "Interactive")] == [1, 2, 1]
    _, es, _, _ = settings_from_args(_parse("--config", preset, "--scenario", "Server", "--admit-every-steps", "1"))
    assert es.admit_every_steps == 1  # the flag wins over the preset's Server table


def test_a_presets_engine_table_for_the_runs_scenario_overrides_the_shared_engine_keys(tmp_path, capsys):
    preset = tmp_path / "p.toml"
    preset.write_text(f'[engine]\nmodel = "{TINY_MODEL}"\nmax_num_seqs = 8\nmax_num_batched_tokens = 512\n'
                      '[engine.Interactive]\nmax_num_batched_tokens = 128\n[engine.Server]\nmax_num_seqs = 16\n')
    es = {sc: settings_from_args(_parse("--config", str(preset), "--scenario", sc))[1]
          for sc in ("Offline", "Server", "Interactive")}
    assert (es["Offline"].max_num_seqs, es["Offline"].max_num_batched_tokens) == (8, 512)
    assert (es["Server"].max_num_seqs, es["Server"].max_num_batched_tokens) == (16, 512)
    assert (es["Interactive"].max_num_seqs, es["Interactive"].max_num_batched_tokens) == (8, 128)
    flag = settings_from_args(_parse("--config", str(preset), "--scenario", "Interactive",
                                         "--max-num-batched-tokens", "256"))[1]
    assert flag.max_num_batched_tokens == 256  # a flag beats both
    for table, message in (("[engine.server]\nmax_num_seqs = 16",
                            "[engine.server] is not a scenario; per-scenario engine settings go in [engine.Offline]"),
                           ("[engine.Server]\nmax_num_seqs = 0", "[engine.Server]: engine setting max_num_seqs must be"),
                           ('[engine.Server]\nmax_num_seqs = "8"', "[engine.Server]: EngineSettings.max_num_seqs must "
                                                                   "be an integer"),
                           ("[engine.Interactive]\nbatch_size = 8", "[engine.Interactive]: unknown EngineSettings"),
                           ('[engine.Server]\nmodel = "/no/such/model"', "[engine.Server] sets model: a preset's "
                                                                         "scenarios run one model, set in [engine]")):
        preset.write_text(f'[engine]\nmodel = "{TINY_MODEL}"\n{table}\n')
        rc = cli.main(["run", "--config", str(preset), "--dataset", "x.json", "--output-dir", str(tmp_path / "o")])
        assert rc == 2 and f"error: {preset}: {message}" in capsys.readouterr().err  # in an Offline run too
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["cluster", "--workdir", "{tmp}/c", "--port", "70000"], "--port 70000: expected 0 (two free ports) or a port in"),
    (["cluster", "--workdir", "{tmp}/c", "--port", "-5"], "--port -5: expected 0"),
    (["cluster", "--workdir", "{tmp}/c", "--resreq", "garbage"], "--resreq 'garbage': invalid resource requirement"),
    (["cluster", "--workdir", "{tmp}/c", "--resreq", "cpu=-1"], "--resreq 'cpu=-1': 'cpu=-1': a value must be a "
     "whole number of plain digits"),
    (["cluster", "--workdir", "{tmp}/c", "--resreq", "cpu=1,mem=1_0g"], "'mem=1_0g': a value must be a whole number"),
    (["cluster", "--workdir", "/proc/nope/c", "--flame-bin", "{bins}"], "--workdir /proc/nope/c: cannot create it"),
    (["cluster", "--workdir", "{tmp}/c", "--flame-bin", "{tmp}"], "no flame-session-manager and flame-executor-manager"),
    (["cluster", "--workdir", "", "--flame-bin", "{bins}"], "--workdir '': expected a folder, got an empty path"),
    (["cluster", "--workdir", "{tmp}/c", "--flame-bin", " "], "--flame-bin ' ': expected a folder, got an empty"),
    (["register", "--endpoint", "127.0.0.1:39241"], "malformed Flame endpoint '127.0.0.1:39241'"),
    (["register", "--endpoint", "http://127.0.0.1:1"], "no Flame session manager answers at http://127.0.0.1:1"),
    (["register", "--endpoint", "http://[::1"], "malformed Flame endpoint 'http://[::1'"),
    (["close", "s1", "--wait-s", "nan"], "--wait-s nan: expected seconds in 0..86400"),
    (["close", "s1", "--wait-s", "-5"], "--wait-s -5.0: expected seconds in 0..86400"),
    (["register", "--python", "rel/python"], "--python (SUT_PYTHON) must be an absolute path, got 'rel/python'"),
    (["render-app", "--workdir", "rel"], "--workdir (SUT_WORKDIR) must be an absolute path"),
    (["register", "--name", ""], "--name '': Flame takes 1-253 characters of ASCII letters"),
    (["register", "--name", "a b/c"], "--name 'a b/c': Flame takes"),
    (["register", "--name", "a..b"], "without '..'"),
    (["render-app", "--name", ".a"], "not starting with '.' or '-'"),
    (["register", "--name", "x" * 254], "--name '" + "x" * 80 + "'...: Flame takes"),
])
def test_sut_flame_commands_exit_2_on_bad_input_without_a_traceback(tmp_path, capsys, argv, message):
    import sut.flame.__main__ as flame_main
    from sut.flame.cluster_config import FEM, FSM

    bins = tmp_path / "bins"  # stand-ins that are never run: the binaries are checked before the work folder
    bins.mkdir()
    for name in (FSM, FEM):
        (bins / name).write_text("#!/bin/sh\nexit 1\n")
        (bins / name).chmod(0o755)
    assert flame_main.main([a.replace("{tmp}", str(tmp_path)).replace("{bins}", str(bins)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("taken", [0, 1], ids=["frontend", "backend"])
def test_sut_flame_cluster_with_a_taken_port_exits_2_before_starting_anything(tmp_path, capsys, taken):
    import socket

    import sut.flame.__main__ as flame_main
    from sut.flame.cluster import pick_ports

    port = pick_ports()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port + taken))
        s.listen()
        rc = flame_main.main(["cluster", "--workdir", str(tmp_path / "c"), "--port", str(port),
                              "--flame-bin", str(tmp_path / "no-binaries-needed")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--port {port}: port {port + taken} in use" in err and "Traceback" not in err, err


def test_a_repeated_server_url_adds_replicas_instead_of_replacing_the_first():
    """`--server-url A --server-url B` ran one replica, B: the flag is now a list flag, as its comma form is."""
    from sut.cli import build_parser

    a = build_parser().parse_args(["run", "--sut", "vllm-http", "--server-url", "http://a:1", "--server-url",
                                   "http://b:2,http://c:3", "--model", "m", "--dataset", "d"])
    assert a.opt__server_url == "http://a:1,http://b:2,http://c:3"
    from sut.core.transports.http_options import url_list

    assert url_list(a.opt__server_url) == ("http://a:1", "http://b:2", "http://c:3")
    one = build_parser().parse_args(["run", "--sut", "vllm-http", "--server-url", "http://a:1", "--model", "m",
                                     "--dataset", "d"])
    assert one.opt__server_url == "http://a:1"
