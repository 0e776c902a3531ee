"""``python -m accuracy`` on a log of a ``--max-samples`` run: the failing coverage check says how
to score it (``--max-samples N``), from the run's ``run.json`` or from the log's shape."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from accuracy.__main__ import main as cli_main
from accuracy.loadgen_log import make_log_entry
from accuracy.report import run_max_samples, suggested_max_samples

WORDS = ["the", "cat", "sat", "on", "mat", "."]
EOS = 2
N = 5
pytestmark = pytest.mark.usefixtures("punkt_ready")




@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer folder, 5-record dataset) whose references are all 'the cat sat on the mat .'."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": EOS}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<bos>", "<eos>")])
    d = tmp_path_factory.mktemp("hint")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>").save_pretrained(str(d / "tok"))
    (d / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    word = {v: k for k, v in vocab.items()}
    recs = [{"instruction": {"llama": "{input}"}, "input": word[3], "tok_input": [1, 3], "output": "the cat sat on the mat ."}
            for i in range(N)]  # input: the text tok_input decodes to (the gate checks it)
    (d / "cnn_eval.json").write_text(json.dumps(recs))
    return d / "tok", d / "cnn_eval.json"


def _run_folder(tmp_path: Path, qsl: list[int], run_max: int | None = None) -> Path:
    ids = [3, 4, 5, 6, 3, 7, 8, EOS]  # "the cat sat on the mat ." + EOS
    (tmp_path / "mlperf_log_accuracy.json").write_text(json.dumps([make_log_entry(i, ids) for i in qsl]))
    if run_max is not None:
        (tmp_path / "run.json").write_text(json.dumps({"run_settings": {"max_samples": run_max}}))
    return tmp_path / "mlperf_log_accuracy.json"


def _gate(caplog, log: Path, inputs, *extra: str) -> tuple[int, str]:
    tok, data = inputs
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="accuracy"):
        rc = cli_main(["--accuracy-log", str(log), "--dataset", str(data), "--tokenizer", str(tok), *extra])
    return rc, "\n".join(r.getMessage() for r in caplog.records)


def test_hint_from_the_logs_shape(tmp_path, inputs, caplog):
    """A log with exactly the first 3 of 5 samples: the failure names --max-samples 3 and the command."""
    log = _run_folder(tmp_path, [0, 1, 2])
    rc, text = _gate(caplog, log, inputs)
    assert rc == 1 and "2 sample(s) missing from the log" in text
    assert "hint: the log holds exactly the dataset's first 3 samples" in text
    assert f"python -m accuracy --accuracy-log {log} --dataset" in text and text.rstrip().endswith("--max-samples 3")
    rc, text = _gate(caplog, log, inputs, "--max-samples", "3", "--output-dir", str(tmp_path / "again"))
    assert "missing" not in text and "hint:" not in text


def test_a_rescore_into_the_run_folder_with_another_max_samples_is_refused_before_writing(tmp_path, inputs, caplog,
                                                                                       capsys):
    """The run's own accuracy.json (what package takes) is never replaced by a verdict on other samples."""
    log = _run_folder(tmp_path, [0, 1, 2, 3], run_max=4)
    for extra, given in ((["--max-samples=2"], "2"), ([], "None")):
        rc, _ = _gate(caplog, log, inputs, *extra)
        text = capsys.readouterr().err
        assert rc == 2, text
        assert f"{tmp_path}/run.json run_settings.max_samples is 4, this command's --max-samples {given}" in text
        assert "Score it as the run did:" in text and "--max-samples 4" in text and "--output-dir DIR" in text
        assert not (tmp_path / "accuracy.json").exists()
    rc, text = _gate(caplog, log, inputs, "--max-samples", "4")
    assert rc in (0, 1) and (tmp_path / "accuracy.json").is_file() and "log checks: ok" in text


def test_a_rescore_into_the_run_folder_with_another_dataset_is_refused(tmp_path, inputs, caplog, capsys):
    tok, data = inputs
    log = _run_folder(tmp_path, [0, 1, 2, 3, 4])
    rec = {"run_settings": {"max_samples": None}, "dataset": {"path": "/elsewhere/cnn_eval.json", "sha256": "ab" * 32}}
    (tmp_path / "run.json").write_text(json.dumps(rec))
    rc, _ = _gate(caplog, log, inputs)
    text = capsys.readouterr().err
    assert rc == 2 and f"--dataset {data} is not the file the run used" in text and "/elsewhere/cnn_eval.json" in text
    assert not (tmp_path / "accuracy.json").exists()
    rc, text = _gate(caplog, log, inputs, "--output-dir", str(tmp_path / "elsewhere"))  # scored there
    assert rc in (0, 1) and (tmp_path / "elsewhere" / "accuracy.json").is_file() and "log checks: ok" in text


def test_hint_from_run_json_replaces_a_wrong_value(tmp_path, inputs, caplog):
    log = _run_folder(tmp_path, [0, 1, 2, 3], run_max=4)
    rc, text = _gate(caplog, log, inputs, "--max-samples=2", "--output-dir", str(tmp_path / "out"))
    assert rc == 1 and "qsl_idx outside the dataset" in text
    assert "hint: the run's run.json says it used --max-samples 4" in text
    assert "--max-samples=2" not in text.split("hint:")[1] and text.rstrip().endswith("--max-samples 4")


def test_no_hint_when_a_sample_in_the_middle_is_missing(tmp_path, inputs, caplog):
    rc, text = _gate(caplog, _run_folder(tmp_path, [0, 1, 3, 4]), inputs)
    assert rc == 1 and "1 sample(s) missing" in text and "hint:" not in text


@pytest.mark.parametrize("checks,given,recorded,expected", [
    ({"missing": [], "unknown_qsl_idx": [], "expected_samples": 5}, None, 3, None),   # nothing wrong
    ({"missing": [3, 4], "expected_samples": 5}, None, None, 3),                      # tail missing
    ({"missing": [3, 4], "expected_samples": 5}, None, 2, 2),                         # run.json wins
    ({"missing": [1, 3, 4], "expected_samples": 5}, None, None, None),                # a hole: no guess
    ({"missing": [0, 1, 2, 3, 4], "expected_samples": 5}, None, None, None),          # empty coverage
    ({"missing": [], "unknown_qsl_idx": [7], "expected_samples": 5}, 5, 8, 8),
    ({"missing": [4], "expected_samples": 5}, 5, 5, None),                            # already given
])
def test_suggested_max_samples(checks, given, recorded, expected):
    assert suggested_max_samples(checks, given, recorded) == expected


def test_run_max_samples_reads_only_a_positive_int(tmp_path):
    log = tmp_path / "mlperf_log_accuracy.json"
    assert run_max_samples(log) is None
    for value, expected in ((64, 64), (None, None), ("64", None), (0, None), (True, None)):
        (tmp_path / "run.json").write_text(json.dumps({"run_settings": {"max_samples": value}}))
        assert run_max_samples(log) == expected
    (tmp_path / "run.json").write_text("{not json")
    assert run_max_samples(log) is None


def test_without_dataset_the_run_json_next_to_the_log_gives_dataset_tokenizer_eos_and_max_samples(
        tmp_path, inputs, caplog, capsys):
    """A new user typed `python -m accuracy --accuracy-log RUN/mlperf_log_accuracy.json` and was asked for
    --dataset first: the run's own record names everything the gate used."""
    tok, data = inputs
    log = _run_folder(tmp_path, [0, 1, 2, 3], run_max=4)
    rec = {"run_settings": {"max_samples": 4, "dataset": str(data), "tokenizer": None},
           "model": {"path": str(tok), "eos_token_ids": [EOS]}}
    (tmp_path / "run.json").write_text(json.dumps(rec))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="accuracy"):
        rc = cli_main(["--accuracy-log", str(log)])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert rc in (0, 1) and "log checks: ok" in text, text
    assert f"from {tmp_path / 'run.json'}: --dataset {data} --tokenizer {tok} --eos-ids {EOS} --max-samples 4" in text
    said = f"EOS [{EOS}] ({tmp_path / 'run.json'} model.eos_token_ids)"  # no --eos-ids was given
    assert said in text and "(--eos-ids)" not in text, text
    assert (tmp_path / "accuracy.json").is_file()
    (tmp_path / "run.json").unlink()  # nothing names the dataset: exit 2, asking for it
    assert cli_main(["--accuracy-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert f"--dataset is required: {tmp_path / 'run.json'} is missing" in err and "--tokenizer PATH" in err


def test_dataset_without_tokenizer_names_the_tokenizer_the_runs_record_gives(tmp_path, inputs, capsys, caplog):
    """A new user's find: the README's first form without --tokenizer pointed at a tokenizer the user did not have,
    though the run.json next to the log names the right one."""
    tok, data = inputs
    log = _run_folder(tmp_path, [0, 1, 2, 3])
    (tmp_path / "run.json").write_text(json.dumps({"run_settings": {"dataset": str(data), "tokenizer": str(tok)},
                                                   "model": {"path": "/models/x"}}))
    caplog.clear()
    assert cli_main(["--accuracy-log", str(log), "--dataset", str(data)]) == 2
    err = capsys.readouterr().err + caplog.text
    assert f"names its gate tokenizer {tok}; pass --tokenizer {tok}, or leave out --dataset" in err
    assert not (tmp_path / "accuracy.json").exists()
    (tmp_path / "run.json").unlink()  # no record: the gate's own error, naming the accepted forms
    caplog.clear()
    assert cli_main(["--accuracy-log", str(log), "--dataset", str(data)]) == 2
    assert "no tokenizer given; pass --tokenizer PATH" in capsys.readouterr().err + caplog.text


@pytest.mark.parametrize("value", [-1, 0, "16", True, 2.0])
def test_a_hand_edited_max_samples_in_run_json_is_refused_before_anything_is_written(tmp_path, inputs, caplog, capsys,
                                                                                     value):
    """A max_samples of -1 suggested `--max-samples -1` (which argparse refuses), and "16" was dropped
    silently, so the re-score replaced the run's own accuracy.json with a coverage failure."""
    tok, data = inputs
    log = _run_folder(tmp_path, [0, 1, 2, 3])
    rec = {"run_settings": {"max_samples": value, "dataset": str(data), "tokenizer": None},
           "model": {"path": str(tok), "eos_token_ids": [EOS]}}
    (tmp_path / "run.json").write_text(json.dumps(rec))
    for argv in (["--accuracy-log", str(log)], ["--accuracy-log", str(log), "--dataset", str(data), "--tokenizer",
                                                str(tok), "--max-samples", "4"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'run.json'} run_settings.max_samples is {value!r}, not null or a whole number" in err
        assert not (tmp_path / "accuracy.json").exists()


@pytest.mark.parametrize("field, value", [("tokenizer", 5), ("tokenizer", ["tok"]), ("path", {"a": 1})])
def test_a_recorded_tokenizer_that_is_not_a_path_is_refused_naming_the_field(tmp_path, inputs, capsys, field, value):
    """Before: a run.json run_settings.tokenizer (or model.path) of 5 ended in a TypeError traceback (exit 1)."""
    tok, data = inputs
    log = _run_folder(tmp_path, list(range(N)))
    rec = {"run_settings": {"max_samples": None, "dataset": str(data), "tokenizer": None},
           "model": {"path": str(tok), "eos_token_ids": [EOS]}}
    (rec["run_settings"] if field == "tokenizer" else rec["model"])[field] = value
    (tmp_path / "run.json").write_text(json.dumps(rec))
    for argv in (["--accuracy-log", str(log)], ["--accuracy-log", str(log), "--dataset", str(data)]):
        assert cli_main(argv) == 2
        where = "run_settings.tokenizer" if field == "tokenizer" else "model.path"
        assert f"error: {tmp_path / 'run.json'} {where} is {value!r}, not a path" in capsys.readouterr().err
        assert not (tmp_path / "accuracy.json").exists()


def test_a_run_json_beside_the_log_that_is_a_fifo_is_not_read(tmp_path):
    """Before: a FIFO named run.json next to the log blocked python -m accuracy for ever (its run.json lookups)."""
    import os
    import threading

    from accuracy.__main__ import _run_record

    log = _run_folder(tmp_path, [0, 1])
    os.mkfifo(tmp_path / "run.json")
    got = []
    t = threading.Thread(target=lambda: got.append((_run_record(str(log)), run_max_samples(log))), daemon=True)
    t.start()
    t.join(10)
    assert got == [(None, None)]
