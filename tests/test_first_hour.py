"""First-hour messages: a command run outside the project's environment says how to enter it (exit 2, no
traceback)."""

import subprocess
import sys

import pytest
from conftest import REPO

from sut.exits import require_environment


def test_a_missing_module_names_it_and_the_environment_to_activate(capsys):
    with pytest.raises(SystemExit) as e:
        require_environment(("json", "no_such_module_of_this_harness"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_module_of_this_harness not installed" in err and ". .venv/bin/activate" in err
    assert "json" not in err.split(" not installed")[0]
    require_environment(("json", "os"))  # all there: nothing happens


@pytest.mark.parametrize("command", [["-m", "sut", "--help"], ["-m", "sut.flame", "cluster"],
                                     ["-m", "sut.locality", "describe"], ["-m", "accuracy", "--help"]])
def test_every_command_outside_the_environment_exits_2_with_how_to_enter_it(command):
    """``-S``: no site-packages, as with a system Python that lacks the harness's dependencies."""
    res = subprocess.run([sys.executable, "-S", *command], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "not installed for" in res.stderr and "scripts/setup.sh" in res.stderr
    assert "Traceback" not in res.stderr


def test_scoring_a_performance_run_says_so_before_asking_for_data_or_tokenizer(tmp_path, capsys):
    from accuracy.__main__ import main

    (tmp_path / "mlperf_log_accuracy.json").write_text("[]")
    (tmp_path / "run.json").write_text('{"mode": "performance", "run_settings": {"dataset": null}}')
    assert main(["--accuracy-log", str(tmp_path / "mlperf_log_accuracy.json")]) == 2
    err = capsys.readouterr().err
    assert "belongs to a performance run" in err and "--mode accuracy" in err
    assert "tokenizer" not in err and "--dataset" not in err


def test_a_missing_dataset_says_where_official_and_demo_data_come_from(tmp_path):
    from sut.data.dataset import load_dataset
    from sut.errors import DatasetError

    with pytest.raises(DatasetError, match=r"file not found \(the official one is MLCommons' cnn_eval.json.*"
                                           r"python -m sut synthetic --out"):
        load_dataset(tmp_path / "missing.json", 128256, 2048)


def test_a_flame_cluster_without_binaries_exits_2_and_leaves_no_work_folder(tmp_path):
    work = tmp_path / "cluster"
    res = subprocess.run([sys.executable, "-m", "sut.flame", "cluster", "--flame-bin", str(tmp_path / "no-bin"),
                          "--workdir", str(work)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no flame-session-manager and flame-executor-manager" in res.stderr, res.stderr
    assert not work.exists()


def test_ratios_measured_on_a_cpu_carry_the_noise_note():
    from sut.run.child import cpu_noise_note

    cpu = {"devices": [{"kind": "cpu"}]}
    gpu = {"devices": [{"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}]}
    assert cpu_noise_note([gpu, None, {}]) is None
    note = cpu_noise_note([gpu, cpu])
    assert note.startswith("note: measured on a CPU") and "quote ratios measured on one GPU" in note


def test_inputs_that_would_fill_memory_or_overflow_are_refused_before_anything(tmp_path):
    """An integer longer than Python converts, an accuracy log that is a device or FIFO, a query count past LoadGen's
    64-bit fields: bad input (a JSONDecodeError / AccuracyInputError / ValueError), never a traceback or a hang."""
    import os

    from accuracy.errors import AccuracyInputError
    from accuracy.jsontext import JSONNumberTooLongError, parse_json
    from accuracy.loadgen_log import read_accuracy_log
    from sut.settings.run import RunSettings

    with pytest.raises(JSONNumberTooLongError, match="a number too long to read"):
        parse_json("[" + "7" * 5000 + "]")
    with pytest.raises(AccuracyInputError, match="not a regular file"):
        read_accuracy_log("/dev/zero")
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    with pytest.raises(AccuracyInputError, match="not a regular file"):  # never opened: a FIFO would block
        read_accuracy_log(fifo)
    with pytest.raises(ValueError, match=r"min_query_count \(--min-query-count\) must be in"):
        RunSettings(sut="vllm", dataset="d.json", min_query_count=10**20)
