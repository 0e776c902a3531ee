"""Bad input exits 2 before anything starts: engine settings vLLM would refuse,
JSON nested deeper than Python's recursion limit, a preset section that is not a table, and a
``python -m sut package`` run folder that does not exist. No test here starts an engine."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, TINY_MODEL, sut_env

from sut.errors import BadInput
from sut.settings.from_args import settings_from_args

DEEP = "[" * 100000 + "]" * 100000  # valid JSON, nested deeper than Python's recursion limit
GOOD_RECORD = {"instruction": "x", "input": "y", "tok_input": [128000, 5, 6, 7], "output": "z"}


@pytest.fixture
def deep(tmp_path) -> Path:
    p = tmp_path / "deep.json"
    p.write_text(DEEP)
    return p


@pytest.fixture
def dataset(tmp_path) -> Path:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps([GOOD_RECORD]))
    return p


# ------------------------------------------------------------------------------------ engine settings
@pytest.mark.parametrize("field, value, rule", [
    ("dtype", "float33", "one of auto, half, float16, bfloat16, float, float32"),
    ("cpu_kvcache_gib", -1, ">= 1"), ("cpu_kvcache_gib", 0, ">= 1"), ("engines_per_device", 0, ">= 1"),
    ("max_num_seqs", 0, ">= 1"), ("max_num_batched_tokens", 0, ">= 1"),
    ("gpu_memory_utilization", 0.0, "in (0, 1]"), ("gpu_memory_utilization", 1.2, "in (0, 1]"),
    ("max_model_len", 0, "> 128"), ("max_model_len", -5, "> 128"), ("seed", -1, "in [0, 4294967295]"),
    ("seed", 2**32, "in [0, 4294967295]"),
    ("long_prefill_token_threshold", -1, "in [0, max_model_len 2668]"),
    ("long_prefill_token_threshold", 2669, "in [0, max_model_len 2668]"), ("device", "tpu", "auto, cuda or cpu"),
    ("admit_every_steps", 0, ">= 1"),
    ("load_format", "dumy", "one of the installed vLLM's names"), ("kv_cache_dtype", "fp9", "one of the installed"),
    ("quantization", "bogus", "one of the installed vLLM's names"),
    ("kv_cache_dtype", "", "a non-empty string"), ("load_format", " ", "a non-empty string"),
    ("quantization", "", "a non-empty string"), ("model", "", "a non-empty string"),
])
def test_engine_settings_refuse_what_vllm_refuses_naming_field_and_flag(field, value, rule):
    from sut.engine import EngineSettings

    kw = {"model": "m", field: value}
    with pytest.raises(ValueError) as e:
        EngineSettings(**kw)
    msg = str(e.value)
    assert f"engine setting {field} must be {rule}" in msg and f"--{field.replace('_', '-')}" in msg, msg
    assert f"[engine] {field}" in msg and repr(value) in msg


def test_engine_settings_accept_every_vllm_dtype_and_the_range_ends():
    from sut.engine import EngineSettings
    from sut.engine.settings import VLLM_DTYPES

    for dtype in VLLM_DTYPES:
        assert EngineSettings(model="m", dtype=dtype).dtype == dtype
    assert EngineSettings(model="m", dtype="BFloat16").dtype == "BFloat16"  # vLLM lower-cases it
    es = EngineSettings(model="m", gpu_memory_utilization=1, cpu_kvcache_gib=1, max_model_len=129, seed=0,
                        long_prefill_token_threshold=0, quantization="fp8", kv_cache_dtype="fp8")
    assert es.vllm_kwargs()["gpu_memory_utilization"] == 1


def _vllm_literal(module: str, name: str) -> tuple:
    """The strings of ``name = Literal[...]`` in the installed vLLM's ``module`` (read, not imported: 10 s+)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed (scripts/setup.sh installs it)"
    path = Path(spec.submodule_search_locations[0], *module.split(".")).with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return tuple(ast.literal_eval(e) for e in node.value.slice.elts)
    pytest.fail(f"{name} not found in {path}")


def test_dtype_choices_are_the_installed_vllms():
    from sut.engine.settings import VLLM_DTYPES

    assert set(VLLM_DTYPES) == set(_vllm_literal("config.model", "ModelDType"))


@pytest.mark.parametrize("extra, preset", [(["--dtype", "float33"], ""), (["--cpu-kvcache-gib", "-1"], ""),
                                           (["--admit-every-steps", "0"], "[engine]\nadmit_every_steps = 2\n"),
                                           ([], "[engine]\ncpu_kvcache_gib = -1\n"),
                                           ([], "[engine]\ngpu_memory_utilization = 1.5\n")])
def test_run_settings_refuse_a_bad_engine_flag_or_preset_value(tmp_path, dataset, extra, preset):
    from sut.cli import build_parser, settings_from_args
    from sut.errors import BadInput

    argv = ["run", "--model", str(TINY_MODEL), "--device", "cpu", "--dataset", str(dataset), *extra]
    if preset:
        (tmp_path / "p.toml").write_text(preset)
        argv += ["--config", str(tmp_path / "p.toml")]
    with pytest.raises(BadInput) as e:
        settings_from_args(build_parser().parse_args(argv))
    assert e.value.code == 2 and "engine setting" in e.value.message
    # the source named is the one that gave the value: the flag alone, or the preset file and its table
    if extra:
        assert f"(flag {extra[0]})" in e.value.message and "preset" not in e.value.message, e.value.message
    else:
        msg = e.value.message
        assert f"{tmp_path / 'p.toml'} [engine]:" in msg and "flag --" not in msg, msg


def test_a_flame_preset_with_sut_vllm_names_the_preset_table_and_the_sut_its_options_belong_to(tmp_path, dataset):
    # a new user's first try: the README's Flame command again with --sut vllm, to compare the two SUTs
    from sut.cli import build_parser, settings_from_args
    from sut.errors import BadInput

    argv = ["run", "--config", str(REPO / "loadgen_configs/flame_b32.toml"), "--sut", "vllm", "--model",
            str(TINY_MODEL), "--device", "cpu", "--dataset", str(dataset)]
    with pytest.raises(BadInput) as e:
        settings_from_args(build_parser().parse_args(argv))
    assert e.value.code == 2 and "--sut vllm: unknown option(s) batch_size, " in e.value.message
    assert "from the [options] table of " in e.value.message and "flame_b32.toml: they are --sut flame options" \
        in e.value.message and "without --config" in e.value.message
    (tmp_path / "p.toml").write_text("[options]\nbogus = 1\n")  # owned by no SUT: the file named, no owner
    with pytest.raises(BadInput) as e:
        settings_from_args(build_parser().parse_args([*argv[:1], "--config", str(tmp_path / "p.toml"), *argv[3:]]))
    assert f"[options] table of {tmp_path / 'p.toml'};" in e.value.message and "they are" not in e.value.message


def test_a_bad_value_in_a_presets_options_table_names_the_file_and_key_unless_a_flag_gave_it(tmp_path, dataset):
    from sut.cli import build_parser, settings_from_args
    from sut.errors import BadInput

    preset = tmp_path / "p.toml"
    preset.write_text('[run]\nsut = "flame"\n[options]\nbatch_size = 0\nbatch_window_ms = 5\n')
    base = ["run", "--config", str(preset), "--model", str(TINY_MODEL), "--device", "cpu", "--dataset", str(dataset)]
    with pytest.raises(BadInput) as e:
        settings_from_args(build_parser().parse_args(base))
    msg = e.value.message
    assert e.value.code == 2 and f"(from the [options] table of {preset}: batch_size)" in msg, msg
    for flag in (["--batch-size", "0"], ["--option", "batch_size=0"]):  # the flag gave the bad value: no file named
        with pytest.raises(BadInput) as e:
            settings_from_args(build_parser().parse_args([*base, *flag]))
        assert "batch_size" in e.value.message and "[options] table" not in e.value.message, e.value.message


def test_locality_refuses_a_bad_engine_flag_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--device", "cpu",
                        "--doc-tokens", "512", "--cpu-kvcache-gib", "0", "--output-dir", str(tmp_path / "out")],
                       cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "engine setting cpu_kvcache_gib must be >= 1" in r.stderr, r.stderr[-800:]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_run_with_a_bad_dtype_exits_2_before_an_engine_or_run_folder(tmp_path, dataset):
    out = tmp_path / "out"
    args = [*TINY_ENGINE_ARGS, "--device", "cpu"]
    args[args.index("--dtype") + 1] = "float33"
    proc = subprocess.Popen([sys.executable, "-m", "sut", "run", *args, "--user-conf", str(CPU_CONF), "--quick",
                             "--dataset", str(dataset), "--output-dir", str(out)], cwd=REPO, env=sut_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the harness's clean stop
        proc.communicate(timeout=180)
        pytest.fail("--dtype float33 was not refused within 30 s (an engine was started)")
    assert proc.returncode == 2 and "got 'float33' (flag --dtype" in err, err[-800:]
    assert not out.exists()


@pytest.mark.parametrize("flags, preset, expect", [
    (["--load-format", "dumy"], "", "got 'dumy' (flag --load-format)"),
    # the tiny model folder holds config.json only: vLLM would fail after start with "Cannot find any model weights"
    (["--load-format", "auto"], "", "no model weights (*.safetensors or *.bin) for load_format 'auto': give a folder "
                                    "with weights, or --load-format dummy"),
    ([], '[engine]\nkv_cache_dtype = "fp9"\n', "[engine]: engine setting kv_cache_dtype must be one of"),
    # a 200-token prompt in a 4,096-token context fits 128 new tokens, not 4,000
    ([], "[generation]\nmax_tokens = 4000\n", "record 0, field 'tok_input': prompt has 200 tokens, more than 96"),
    ([], "[generation]\neos_token_ids = [2, 999999]\n", "eos_token_ids [999999] are outside the model's vocabulary"),
    # vLLM's default step budget for vllm.LLM on CPU is 4,096 tokens: it refuses 5,000 sequences only once started
    (["--max-num-seqs", "5000"], "", "max_num_seqs 5000 with max_num_batched_tokens unset: vLLM's default per-step "
                                     "budget here is 4,096 tokens (vllm.LLM on cpu)"),
])
def test_a_value_vllm_or_the_context_refuses_exits_2_before_an_engine_or_run_folder(tmp_path, flags, preset, expect):
    """What vLLM would refuse only after the engine started (its own names for load_format, kv_cache_dtype and
    quantization), and a prompt without room for the run's max_tokens, are bad input: exit 2, no run folder."""
    data = tmp_path / "ds.json"
    data.write_text(json.dumps([{**GOOD_RECORD, "tok_input": [128000] + list(range(5, 204))}]))
    out, argv = tmp_path / "out", [*TINY_ENGINE_ARGS, "--device", "cpu", *flags]
    if preset:
        (tmp_path / "p.toml").write_text(preset)
        argv += ["--config", str(tmp_path / "p.toml")]
    r = subprocess.run([sys.executable, "-m", "sut", "run", *argv, "--user-conf", str(CPU_CONF), "--quick",
                        "--dataset", str(data), "--output-dir", str(out)], cwd=REPO, env=sut_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and expect in r.stderr and r.stderr.startswith("error: "), r.stderr[-800:]
    assert not out.exists()


# ------------------------------------------------------------------------------------ deeply nested JSON
def test_parse_json_turns_too_deep_nesting_into_a_decode_error():
    from accuracy.jsontext import JSONTooDeepError, parse_json

    with pytest.raises(json.JSONDecodeError, match="nested deeper than Python's recursion limit") as e:
        parse_json(DEEP)
    assert isinstance(e.value, JSONTooDeepError) and isinstance(e.value, ValueError)
    with pytest.raises(json.JSONDecodeError, match="nested deeper"):
        parse_json(DEEP.encode())
    assert parse_json("[[1]]") == [[1]]


def _readers():
    """(reader, the bad-input error it must raise) for every reader of an input JSON file."""
    from accuracy.dataset import DatasetFileError, read_dataset_json
    from accuracy.errors import AccuracyInputError
    from accuracy.loadgen_log import read_accuracy_log
    from accuracy.reference import load_reference_file
    from sut.data.dataset import load_dataset
    from sut.errors import ComplianceError, DatasetError
    from sut.locality.news import load_corpus
    from sut.record.read import read_json

    return [(read_dataset_json, DatasetFileError), (read_accuracy_log, AccuracyInputError),
            (load_reference_file, AccuracyInputError), (lambda p: read_json(p, "run record"), ComplianceError),
            (lambda p: load_dataset(p, 128256, 4096), DatasetError),
            (lambda p: load_corpus(str(p), None, 128000), DatasetError)]


@pytest.mark.parametrize("index", range(6))
def test_every_input_reader_refuses_too_deep_json_as_bad_input(deep, index):
    reader, error = _readers()[index]
    with pytest.raises(error, match="nested deeper than Python's recursion limit") as e:
        reader(deep)
    assert str(deep) in str(e.value)


def test_model_folder_with_too_deep_config_is_an_engine_error(tmp_path):
    from sut.engine import read_model_info
    from sut.errors import EngineError

    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(EngineError, match="nested deeper"):
        read_model_info(tmp_path)


@pytest.mark.parametrize("command", ["accuracy", "test06-verify"])
def test_commands_reading_too_deep_json_exit_2_without_traceback(tmp_path, deep, dataset, command, synthetic_small):
    if command == "accuracy":  # (the synthetic tokenizer: one that exists in a fresh clone)
        argv = ["-m", "accuracy", "--accuracy-log", str(deep), "--dataset", str(dataset), "--tokenizer",
                str(synthetic_small[1]), "--output-dir", str(tmp_path / "acc")]
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "mlperf_log_accuracy.json").write_text(DEEP)
        argv = ["-m", "sut", "test06-verify", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, *argv], cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=90)
    assert r.returncode == 2 and "nested deeper" in r.stderr, r.stderr[-800:]
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("text, section", [("run = 5\n", "run"), ('engine = "x"\n', "engine"),
                                           ("generation = [1]\n", "generation"), ("options = true\n", "options")])
def test_a_preset_section_that_is_not_a_table_is_bad_input(tmp_path, text, section):
    from sut.errors import BadInput
    from sut.settings.from_args import _preset

    p = tmp_path / "p.toml"
    p.write_text(text)
    with pytest.raises(BadInput, match=f"{p}: {section} must be a table"):
        _preset(str(p))


@pytest.mark.parametrize("text", ["a = " + "[" * 100000 + "]" * 100000 + "\n", None, b"\xff\xfe[\x00",
                                  "[engine]\nmodel = 'm'\n".encode("utf-16")])
def test_a_preset_too_deep_or_unreadable_is_bad_input(tmp_path, text):
    from sut.errors import BadInput
    from sut.settings.from_args import _preset

    p = tmp_path / "p.toml"
    if text is None:
        p.mkdir()  # a folder: open() raises IsADirectoryError
    elif isinstance(text, bytes):  # found by a fault test: tomllib's UnicodeDecodeError was a traceback, exit 1
        p.write_bytes(text)
    else:
        p.write_text(text)
    with pytest.raises(BadInput, match=re.escape(str(p))) as e:
        _preset(str(p))
    assert not isinstance(text, bytes) or "not UTF-8" in e.value.message


def test_a_preset_saved_with_a_byte_order_mark_is_refused_saying_so(tmp_path):
    from sut.errors import BadInput
    from sut.settings.from_args import _preset

    p = tmp_path / "p.toml"
    p.write_bytes(b"\xef\xbb\xbf[run]\nsut = 'vllm'\n")
    with pytest.raises(BadInput, match="malformed TOML: .*starts with a UTF-8 byte-order mark"):
        _preset(str(p))
    p.write_bytes(b"[run]\nsut = \n")  # malformed without a mark: no word of one
    with pytest.raises(BadInput) as e:
        _preset(str(p))
    assert "byte-order" not in e.value.message


# ------------------------------------------------------------------------------------ package
def _package(tmp_path, perf, acc) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sut", "package", "--out", str(tmp_path / "sub" / "tree"),
                           "--system", "1xCPU", "--submitter", "ORG", "--performance", str(perf), "--accuracy", str(acc),
                           "--allow-noncompliant"], cwd=REPO, env=sut_env(), capture_output=True, text=True,
                          timeout=90)


@pytest.mark.parametrize("kind, why", [("missing", "does not exist"), ("file", "is not a folder"),
                                       ("empty", "is not a run folder (no run.json)")])
def test_package_refuses_a_path_that_is_not_a_run_folder_and_writes_nothing(tmp_path, kind, why):
    bad = tmp_path / "bad"
    if kind == "file":
        bad.write_text("x")
    elif kind == "empty":
        bad.mkdir()
    r = _package(tmp_path, bad, bad)
    assert r.returncode == 2 and f"--performance {bad}: {why}" in r.stderr, r.stderr[-600:]
    assert not (tmp_path / "sub").exists()


def _write_run_files(d):
    """The files besides run.json a run folder argument of ``package`` must hold (any role), each a line of text."""
    from sut.submission.scenario import RUN_FILES

    for name in {n for names in RUN_FILES.values() for n in names} | {"user.conf"}:
        (d / name).write_text("x\n")


def test_package_that_fails_after_its_checks_leaves_no_out_folder(tmp_path):
    run, acc = tmp_path / "run", tmp_path / "acc"
    for d in (run, acc):
        d.mkdir()
        (d / "run.json").write_text("{}")  # a run folder whose run.json lacks every field: the packaging fails
        _write_run_files(d)  # else exit 2 before the packaging
    r = _package(tmp_path, run, acc)
    assert r.returncode == 1 and "cannot package" in r.stderr, r.stderr[-600:]
    assert not (tmp_path / "sub").exists()


def test_check_run_folders_names_the_flag(tmp_path):
    from sut.submission.tree import TreeSettings

    for name in ("ok", "ok2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text("{}")
        _write_run_files(tmp_path / name)
    ts = TreeSettings(out=str(tmp_path / "o"), system="s", submitter="o", performance_runs=(str(tmp_path / "ok"),),
                      accuracy_runs=(str(tmp_path / "ok2"),), test06_runs=(str(tmp_path / "nope"),))
    with pytest.raises(ValueError, match=f"--test06 {tmp_path / 'nope'}: does not exist"):
        ts.check_run_folders()


@pytest.mark.parametrize("flag, record, why", [
    ("--performance", '{"mode": "perf', "its run.json cannot be read as JSON"),
    ("--performance", {"mode": "accuracy"}, "is an accuracy run, not a performance run"),
    ("--performance", {"mode": "performance", "run_settings": {"compliance_test": "TEST06"}},
     "is a TEST06 run, not a performance run"),
    ("--accuracy", {"mode": "performance"}, "is a performance run, not an accuracy run"),
    ("--test06", {"mode": "performance", "run_settings": {}}, "is a performance run, not a TEST06 run"),
    ("--performance", None, "given twice (also --performance "),
])
def test_package_refuses_a_run_given_for_the_wrong_flag_or_twice_with_exit_2(tmp_path, flag, record, why):
    """These were exit 1 after the checks began, not bad input (exit 2) before anything."""
    runs = {}
    for f, rec in (("--performance", {"mode": "performance"}), ("--accuracy", {"mode": "accuracy"}),
                   ("--test06", {"mode": "performance", "run_settings": {"compliance_test": "TEST06"}})):
        d = tmp_path / f.strip("-")
        d.mkdir()
        (d / "run.json").write_text(json.dumps(rec))
        _write_run_files(d)
        runs[f] = d
    args = [a for f, d in runs.items() for a in (f, str(d))]
    if record is None:  # the same folder twice, spelt otherwise (one flag takes several folders)
        args.insert(2, str(runs["--performance"]) + "/")
    else:
        (runs[flag] / "run.json").write_text(record if isinstance(record, str) else json.dumps(record))
    r = subprocess.run([sys.executable, "-m", "sut", "package", "--out", str(tmp_path / "sub"), "--system", "s",
                        "--submitter", "o", *args], cwd=REPO, env=sut_env(), capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 2 and f"{flag} {runs[flag]}{'/' if record is None else ''}: {why}" in r.stderr, \
        r.stderr[-800:]
    assert not (tmp_path / "sub").exists()


def test_an_unknown_preset_key_names_the_preset_and_its_table(tmp_path):
    from sut import cli

    preset = tmp_path / "p.toml"
    preset.write_text('[run]\ndataset = "x.json"\nbogus = 1\n')
    with pytest.raises(BadInput, match=re.escape(f"error: {preset} [run]: unknown RunSettings field(s): bogus")):
        settings_from_args(cli.build_parser().parse_args(["run", "--config", str(preset), "--model", "m"]))
    preset.write_text('[run]\ndataset = "x.json"\n[engine]\nmax_num_seq = 8\n')  # a typo gets a suggestion
    with pytest.raises(BadInput, match=re.escape(f"error: {preset} [engine]: unknown EngineSettings field(s): "
                                                 "max_num_seq (did you mean 'max_num_seqs' for 'max_num_seq'?)")):
        settings_from_args(cli.build_parser().parse_args(["run", "--config", str(preset), "--model", "m"]))


@pytest.mark.parametrize("run, flags, message", [
    ('sut = "vlm"', [], "error: {p}: [run] sut: unknown SUT 'vlm'; known: "),  # other tests may register test SUTs
    ('user_conf = "nowhere.user.conf"', [], "error: {p}: [run] user_conf 'nowhere.user.conf' is not a file (relative "
                                            "paths are read from the current folder, "),
    ('sut = "vlm"', ["--sut", "vllm"], None),  # the flag wins: the preset's value is not used, not refused
    ('user_conf = "nowhere.user.conf"', ["--user-conf", "loadgen_configs/cpu_tiny.user.conf"], None),
])
def test_a_presets_sut_or_user_conf_is_refused_naming_the_preset_and_field(tmp_path, monkeypatch, run, flags, message):
    from sut import cli

    monkeypatch.chdir(REPO)
    preset = tmp_path / "p.toml"
    preset.write_text(f'[run]\ndataset = "x.json"\n{run}\n')
    argv = ["run", "--config", str(preset), "--model", "m", *flags]
    if message is None:
        settings_from_args(cli.build_parser().parse_args(argv))
        return
    with pytest.raises(BadInput) as e:
        settings_from_args(cli.build_parser().parse_args(argv))
    assert e.value.message.startswith(message.format(p=preset)), e.value.message
    assert "vlm" not in run or all(f" {n}" in e.value.message for n in ("flame,", "vllm,", "vllm-http"))


@pytest.mark.parametrize("table, flags, message", [
    ('[engine]\nmax_num_seqs = "abc"\n', [], "{p} [engine]: EngineSettings.max_num_seqs must be an integer"),
    ("[generation]\nmax_tokens = 0\n", [], "{p} [generation]: max_tokens must be a positive integer"),
    ("[engine.Server]\nmax_num_seqs = 0\n", [], "{p}: [engine.Server]: engine setting max_num_seqs must be >= 1 (an "
                                                "integer), got 0 (flag --max-num-seqs, preset [engine.Server] max_num_seqs)"),
    ("[engine]\nmax_num_seqs = 8\n", ["--max-num-seqs", "0"], "error: engine setting max_num_seqs must be >= 1"),
    ("[run]\nmax_samples = 5\n", ["--max-samples", "0"], "error: max_samples (--max-samples) must be >= 1"),
    ("[run]\ntarget_qps = 3\n", ["--target-qps", "0"], "error: target_qps (--target-qps) must be"),
    ("[engine]\nmax_num_seqs = 64\nmax_num_batched_tokens = 32\n", [],
     "engine setting max_num_batched_tokens must be >= max_num_seqs (64)"),
])
def test_a_bad_preset_value_names_the_preset_file_and_table(tmp_path, table, flags, message):
    """Type errors of a preset named neither file nor table; a per-scenario table's hint named
    [engine]. A value given by flag is not blamed on the preset."""
    from sut import cli

    preset = tmp_path / "p.toml"
    preset.write_text(table)
    argv = ["run", "--config", str(preset), "--model", "m", "--dataset", "x.json", *flags]
    with pytest.raises(BadInput) as e:
        settings_from_args(cli.build_parser().parse_args(argv))
    assert message.format(p=preset) in e.value.message and e.value.code == 2, e.value.message
    assert flags == [] or str(preset) not in e.value.message


def test_max_model_len_past_the_models_positions_is_bad_input_before_a_run_folder(tmp_path, dataset):
    """vLLM refused it only at engine start (exit 1, a failed run folder). Rope-scaled configs
    other than Llama 3's are left to vLLM (it scales their limit)."""
    import json

    from sut.engine.settings import _max_model_len_limit

    r = subprocess.run([sys.executable, "-m", "sut", "run", "--config", str(REPO / "loadgen_configs/cpu_tiny.toml"),
                        "--dataset", str(dataset), "--quick", "--max-model-len", "99999", "--output-dir",
                        str(tmp_path / "out")], cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_model_len 99999 (--max-model-len or the preset" in r.stderr, r.stderr[-800:]
    assert "max_position_embeddings 8192" in r.stderr and not (tmp_path / "out").exists()
    cfg = REPO.parent / "shared" / "gpu" / "llama31_8b_dummy" / "config.json"  # the H200 runs' 8B config
    llama31 = json.loads(cfg.read_text()) if cfg.is_file() else \
        {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert _max_model_len_limit(llama31) == 131072
    assert _max_model_len_limit({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4}}) == 0
    assert _max_model_len_limit({}) == 0


def test_a_server_url_given_twice_is_refused():
    from sut.core.transports.http_options import url_list

    with pytest.raises(ValueError, match="'http://127.0.0.1:18761' is given twice"):
        url_list("http://127.0.0.1:18761,http://127.0.0.1:18761/v1")
    assert url_list("http://a:1,http://b:1") == ("http://a:1", "http://b:1")


@pytest.mark.parametrize("sub", ["run", "report"])
@pytest.mark.parametrize("name", ["a/b", "../escape", "  ", ".."])
def test_locality_refuses_a_run_name_that_is_not_a_plain_folder_name(tmp_path, capsys, sub, name):
    """As ``sut run``'s: a run name with '/' or '..' would put the run folder outside --output-dir."""
    import sut.locality.__main__ as loc_main

    with pytest.raises(SystemExit) as e:
        loc_main.main([sub, "--run-name", name, "--output-dir", str(tmp_path / "out"), str(tmp_path)])
    assert e.value.code == 2 and "--run-name must be a plain folder name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["--config", "--user-conf"])
def test_a_preset_or_user_conf_that_is_a_fifo_is_refused_not_read(tmp_path, dataset, which):
    """A FIFO would block the read forever (nothing writes to it); a folder is no file either."""
    import os

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    argv = ["run", *TINY_ENGINE_ARGS, "--device", "cpu", "--quick", "--dataset", str(dataset), "--output-dir", str(out)]
    argv += [which, str(fifo)] + (["--user-conf", str(CPU_CONF)] if which == "--config" else [])
    r = subprocess.run([sys.executable, "-m", "sut", *argv], cwd=REPO, env=sut_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and f"{fifo} is not a regular file" in r.stderr and not out.exists(), r.stderr[-600:]


@pytest.mark.parametrize("argv, expect", [
    (["synthetic", "--out", "{t}/x.json", "--samples", "0"], "--samples: must be a positive integer"),
    (["synthetic", "--out", "{t}/x.json", "--seed", "-1"], "--seed: must be an integer from 0 to 2**32 - 1"),
    (["synthetic", "--out", "{t}", "--samples", "3"], "--out {t} is a folder, not a file"),
    (["synthetic", "--out", "{t}/x.json", "--samples", "99999999999999"], "--samples: must be at most 133,680"),
    (["synthetic", "--out", "/dev/null", "--samples", "3"], "--out /dev/null is not a regular file"),
    (["synthetic", "--out", "{t}/x.json", "--samples", "3", "--tokenizer-out", "{t}/f"],
     "--tokenizer-out {t}/f is a file"),
    (["synthetic", "--out", "{t}/x.json", "--samples", "3", "--tokenizer-out", ""],
     "--tokenizer-out '': an empty path"),  # it wrote no tokenizer, silently
    (["retokenize", "--source", "{t}/none.json", "--tokenizer", "{t}", "--out", "{t}/x.json"],
     "--source {t}/none.json"),
    (["retokenize", "--source", "{t}/f", "--tokenizer", "{t}/none", "--out", "{t}/x.json"], "--tokenizer {t}/none: no"),
    (["retokenize", "--source", "{t}/f", "--tokenizer", "{t}", "--out", "{t}/x.json", "--max-samples", "0"],
     "--max-samples: must be a positive integer"),
    (["retokenize", "--source", "{t}/f", "--tokenizer", "{t}", "--out", "{t}/f"], "--out {t}/f is the --source file"),
    (["retokenize", "--source", "{t}", "--tokenizer", "{t}", "--out", "{t}/x.json"],
     "--source {t}: not a regular file (a folder, FIFO or device)"),
    (["retokenize", "--source", "/dev/null", "--tokenizer", "{t}", "--out", "{t}/x.json"],
     "--source /dev/null: not a regular file"),
    (["demo", "--output-dir", "{t}/f"], "--output-dir {t}/f is a file, not a folder"),
    (["demo", "--output-dir", ""], "--output-dir '': an empty path; name a folder"),
    (["synthetic", "--out", "", "--samples", "3"], "--out '': an empty path; name a file"),
    (["convert-smollm2", "--out", ""], "--out '': an empty path; name a folder"),
    (["convert-smollm2", "--out", "{t}/f"], "--out {t}/f is a file, not a folder"),
    (["convert-smollm2", "--out", "{t}/f/sub"], "{t}/f is a file, not a folder, so {t}/f/sub cannot be made"),
])
def test_the_data_commands_refuse_bad_arguments_with_one_error_line(tmp_path, capsys, argv, expect):
    """synthetic, retokenize and demo: exit 2 with one error line naming the flag, nothing written."""
    from sut import cli

    (tmp_path / "f").write_text("{}")
    argv = [x.format(t=tmp_path) for x in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and expect.format(t=tmp_path) in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("text, expect", [("garbage\n", "line 1 ('garbage'): LoadGen ignores this line"),
                                          ("*.*.mode = 9\n", "mode must be one of LoadGen's test modes"),
                                          ("# nothing\n", "no setting in it")])
def test_an_audit_config_loadgen_would_misread_exits_2_before_an_engine_or_run_folder(tmp_path, dataset, text,
                                                                                      expect):
    """LoadGen reads --audit-config as it reads a user.conf: a line it drops or rejects, or a mode it has not,
    would make a run that is not the compliance test it claims to be."""
    (tmp_path / "audit.config").write_text(text)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "sut", "run", *TINY_ENGINE_ARGS, "--device", "cpu", "--quick",
                        "--user-conf", str(CPU_CONF), "--audit-config", str(tmp_path / "audit.config"),
                        "--dataset", str(dataset), "--output-dir", str(out)], cwd=REPO, env=sut_env(),
                       capture_output=True, text=True, timeout=60)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and expect in errors[0], r.stderr[-600:]
    assert not out.exists()


def test_vllm_names_are_read_from_its_source_and_skipped_when_not_found(tmp_path, monkeypatch):
    """The lists come from vLLM's module-level Literals; another layout (no file, no Literal) checks nothing."""
    from sut.engine import EngineSettings, vllm_names

    loader = tmp_path / "model_executor" / "model_loader"
    loader.mkdir(parents=True)
    (loader / "__init__.py").write_text('from typing import Literal\nLoadFormats = Literal["auto", "dummy"]\n')
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "cache.py").write_text("CacheDType = str\n")  # not a Literal: not checked
    monkeypatch.setattr(vllm_names, "_vllm_root", lambda: tmp_path)
    vllm_names.choices.cache_clear()
    try:
        assert vllm_names.choices("load_format") == ("auto", "dummy")
        assert vllm_names.choices("kv_cache_dtype") is None and vllm_names.choices("quantization") is None
        with pytest.raises(ValueError, match=r"names \(auto, dummy\), got 'safetensors'"):
            EngineSettings(model="m", load_format="safetensors")
        assert EngineSettings(model="m", kv_cache_dtype="anything", quantization="else").quantization == "else"
    finally:
        vllm_names.choices.cache_clear()


@pytest.mark.parametrize("flag", ["--output-dir", "--dataset", "--user-conf"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(flag):
    from sut import cli

    argv = ["run", "--model", str(TINY_MODEL), "--dataset", "x.json", flag, ""]
    with pytest.raises(BadInput) as e:
        settings_from_args(cli.build_parser().parse_args(argv))
    assert e.value.code == 2 and f"({flag}) must be a path, got an empty string" in e.value.message


@pytest.mark.parametrize("argv, prog, message", [
    (["-m", "sut.locality", "run", "--trace-preset", "arrival"], "python -m sut.locality run",
     "argument --trace-preset: invalid choice: 'arrival'"),
    (["-m", "sut", "bogus"], "python -m sut", "argument cmd: invalid choice: 'bogus'"),
    (["-m", "sut.flame", "cluster", "--bogus"], "python -m sut.flame cluster", "required: --workdir"),
    (["-m", "sut.locality", "run", "--bogus"], "python -m sut.locality run", "unrecognized arguments: --bogus"),
    (["-m", "sut.locality"], "python -m sut.locality", "required: cmd (one of: run, describe, report)"),
])
def test_a_bad_command_line_gets_two_lines_not_the_whole_usage(argv, prog, message):
    """argparse's refusal prints the whole usage first (~57 lines for the locality run); the entry points print the
    error and a pointer to --help, exit 2."""
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stderr
    assert lines[0].startswith(f"{prog}: error: ") and message in lines[0]
    assert lines[1] == f"({prog} --help lists every option)" and "usage:" not in p.stderr


@pytest.mark.parametrize("kind, expect", [("missing", "audit config not found: {p}"),
                                          ("fifo", "audit config {p} is not a regular file")])
def test_an_audit_config_that_is_missing_or_no_regular_file_is_named_so(tmp_path, dataset, kind, expect):
    path = tmp_path / "audit.config"
    if kind == "fifo":
        os.mkfifo(path)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "sut", "run", *TINY_ENGINE_ARGS, "--device", "cpu", "--quick",
                        "--user-conf", str(CPU_CONF), "--audit-config", str(path), "--dataset", str(dataset),
                        "--output-dir", str(out)], cwd=REPO, env=sut_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and expect.format(p=path) in r.stderr, r.stderr[-600:]
    assert not out.exists()
