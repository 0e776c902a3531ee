"""Help texts: the engine flags show their defaults (sut.settings.flags.add_engine_flags), and ``-v`` of the
locality commands that start no engine does not talk of engine logs."""

from __future__ import annotations

import re

import pytest

from sut import cli
from sut.engine import EngineSettings
from sut.locality import __main__ as locality_cli


def _help(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def _flag_help(text: str, flag: str) -> str:
    """The help of ``flag`` in a whitespace-normalised help text (up to the next flag of the group)."""
    m = re.search(re.escape(flag) + r" [A-Z_]+ (.*?)(?= --[a-z]|$)", text) or re.search(
        re.escape(flag) + r" (.*?)(?= --[a-z]|$)", text)
    assert m, f"{flag} not in the help"
    return m.group(1)


DEFAULTS = [("--dtype", "(default auto)"), ("--max-num-seqs", f"(default {EngineSettings.max_num_seqs})"),
            ("--max-num-batched-tokens", "(default unset: vLLM's own)"),
            ("--gpu-memory-utilization", "(default unset: vLLM's own)"), ("--kv-cache-dtype", "(default auto)"),
            ("--load-format", "(default auto)"), ("--cpu-kvcache-gib", "(default 2)"),
            ("--enforce-eager", "(default off)")]


@pytest.mark.parametrize("flag, default", DEFAULTS)
def test_locality_run_help_shows_the_engine_defaults(capsys, flag, default):
    text = _help(locality_cli.build_parser(), ["run", "--help"], capsys)
    assert default in _flag_help(text, flag)
    assert "default 0" in _flag_help(text, "--engine-seed") and "--seed SEED" in text  # --seed: the trace's


def test_sut_run_help_shows_the_engine_defaults(capsys):
    text = _help(cli.build_parser(), ["run", "--help"], capsys)
    for flag, default in DEFAULTS:
        assert default in _flag_help(text, flag), flag
    assert "(default 2668)" in _flag_help(text, "--max-model-len") and "(default 0)" in _flag_help(text, "--seed")


@pytest.mark.parametrize("command", ["report", "describe"])
def test_verbose_of_a_command_without_engines_says_nothing_of_engine_logs(capsys, command):
    argv = [command, "--help"]
    text = _help(locality_cli.build_parser(), argv, capsys)
    verbose = _flag_help(text, "-v, --verbose")
    assert "debug logging" in verbose and "engine-N.log" not in verbose and "vLLM" not in verbose
    run = _flag_help(_help(locality_cli.build_parser(), ["run", "--help"], capsys), "-v, --verbose")
    assert "engine-N.log" in run


def test_demo_help_says_what_it_runs_how_long_where_its_output_goes_and_that_it_is_no_result(capsys):
    """A new user's find: `python -m sut demo --help` had no description, only --output-dir."""
    from sut.run.demo import SAMPLES

    text = _help(cli.build_parser(), ["demo", "--help"], capsys)
    for said in (f"{SAMPLES} samples", "Offline performance run", "accuracy-mode run", "TEST06 run",
                 "About 3-4 min on 2 CPU cores", "OUTPUT_DIR/data/", "OUTPUT_DIR/<date-time>/",
                 "Not an MLPerf result", "(default results/demo)"):
        assert said in text, said
