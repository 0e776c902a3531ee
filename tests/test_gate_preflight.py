"""The accuracy gate's tokenizer is resolved before a run starts (accuracy/preflight.py, sut/record/write.py
gate_tokenizer, sut/run/harness.py prepare_run), with a hint that fits the data; and the gen_len wording of the gate's
reasons and of ``python -m sut package`` says what the number is (characters over all samples)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env

from accuracy.errors import TokenizerNotFoundError
from accuracy.preflight import is_synthetic_dataset, resolve_gate_tokenizer
from accuracy.reference import Reference, judge

LLAMA_RECORD = {"instruction": {"llama": "Summarize the following news article ..."}, "input": "Some article.",
                "tok_input": [128000, 9906, 13], "output": "A summary."}


@pytest.fixture
def synthetic(tmp_path):
    """An 8-sample synthetic dataset (``_with_tokenizer_folder`` adds the tokenizer next to it, as the demo lays
    it out)."""
    from sut.data.synthetic import SyntheticSettings, write_dataset

    data = tmp_path / "data" / "synthetic_8.json"
    write_dataset(data, SyntheticSettings(samples=8, seed=0, median=200, max_len=600))
    return data


def _with_tokenizer_folder(data: Path) -> Path:
    from sut.data.synthetic import write_tokenizer

    folder = data.parent / "tokenizer"
    write_tokenizer(folder)  # the demo's word-level tokenizer (the preflight loads it)
    return folder


def _real_style(tmp_path) -> Path:
    data = tmp_path / "cnn_eval.json"
    data.write_text(json.dumps([LLAMA_RECORD] * 2))
    return data


def test_synthetic_data_points_to_the_tokenizer_next_to_it(synthetic):
    folder = _with_tokenizer_folder(synthetic)
    assert is_synthetic_dataset(synthetic)
    with pytest.raises(TokenizerNotFoundError) as e:
        resolve_gate_tokenizer(None, TINY_MODEL, synthetic)
    msg = str(e.value)
    assert f"model folder {TINY_MODEL} has none" in msg and f"--tokenizer {folder}" in msg
    assert "--no-accuracy-gate" in msg and "llama3_tokenizer" not in msg and "Llama 3" not in msg


def test_synthetic_data_without_its_tokenizer_says_how_to_write_it(synthetic):
    with pytest.raises(TokenizerNotFoundError, match=r"synthetic data: pass --tokenizer PATH .*--tokenizer-out PATH\)"
                                                     r".*--no-accuracy-gate") as e:
        resolve_gate_tokenizer(None, TINY_MODEL, synthetic)
    assert "llama3_tokenizer" not in str(e.value)


def test_cnn_dailymail_data_points_to_a_llama3_tokenizer(tmp_path):
    data = _real_style(tmp_path)
    assert not is_synthetic_dataset(data)
    with pytest.raises(TokenizerNotFoundError, match=r"Llama 3 tokenizer .*llama3_tokenizer/tokenizer\.model.*"
                                                     r"--no-accuracy-gate") as e:
        resolve_gate_tokenizer(None, TINY_MODEL, data)
    assert "synthetic" not in str(e.value)


def test_a_given_or_model_tokenizer_is_used_and_a_wrong_flag_is_named(tmp_path, synthetic):
    folder = _with_tokenizer_folder(synthetic)
    assert resolve_gate_tokenizer(str(folder), TINY_MODEL, synthetic) == folder
    assert resolve_gate_tokenizer(None, folder, synthetic) == folder  # a model folder with its tokenizer
    with pytest.raises(TokenizerNotFoundError, match=rf"^--tokenizer: tokenizer path {tmp_path / 'nope'} does not "
                                                     rf"exist; .*--tokenizer {folder} "):
        resolve_gate_tokenizer(str(tmp_path / "nope"), TINY_MODEL, synthetic)


def _prepare(tmp_path, data, **run):
    from sut.engine import EngineSettings, GenerationSettings
    from sut.run.harness import prepare_run
    from sut.settings.run import RunSettings

    rs = RunSettings(sut="vllm", dataset=str(data), output_dir=str(tmp_path / "out"), user_conf=str(CPU_CONF), **run)
    es = EngineSettings(model=str(TINY_MODEL), load_format="dummy", dtype="float32", enforce_eager=True,
                        max_model_len=4096, device="cpu")
    return prepare_run(rs, es, GenerationSettings())


def test_prepare_run_checks_the_gate_tokenizer_only_when_the_gate_runs(tmp_path, synthetic):
    from sut.errors import InputError

    with pytest.raises(InputError, match="--no-accuracy-gate"):
        _prepare(tmp_path, synthetic, mode="accuracy")
    _prepare(tmp_path, synthetic, mode="accuracy", accuracy_gate=False)
    _prepare(tmp_path, synthetic, mode="performance")
    _prepare(tmp_path, synthetic, mode="accuracy", tokenizer=str(_with_tokenizer_folder(synthetic)))
    assert not (tmp_path / "out").exists()


def test_prepare_run_refuses_what_the_gate_could_not_use_after_the_run(tmp_path, synthetic):
    """An accuracy run with a record lacking ``output``, or a --tokenizer file that is no
    tokenizer, ran to the end and said "accuracy gate: not run" with exit 0."""
    from sut.errors import InputError

    tok = str(_with_tokenizer_folder(synthetic))
    not_a_tokenizer = tmp_path / "tokenizer.json"
    not_a_tokenizer.write_text("{}")
    with pytest.raises(InputError, match=r"accuracy gate: the tokenizer .*tokenizer.json does not load"):
        _prepare(tmp_path, synthetic, mode="accuracy", tokenizer=str(not_a_tokenizer))
    records = json.loads(synthetic.read_text())
    del records[1]["output"]
    broken = tmp_path / "data" / "no_output.json"
    broken.write_text(json.dumps(records))
    with pytest.raises(InputError, match=r"accuracy gate: .*record 1 has no string field 'output'.*--no-accuracy-gate"):
        _prepare(tmp_path, broken, mode="accuracy", tokenizer=tok)
    _prepare(tmp_path, broken, mode="accuracy", tokenizer=tok, max_samples=1)  # record 1 is not kept
    _prepare(tmp_path, broken, mode="accuracy", accuracy_gate=False)
    assert not (tmp_path / "out").exists()


def test_prepare_run_refuses_a_gate_tokenizer_that_did_not_make_the_dataset(tmp_path, synthetic):
    """Llama 3 ids (128000 ...) with the synthetic word-level tokenizer: found before the run (it used to be a gate
    FAIL after it); the message names the file, record, field, id and the tokenizer's vocabulary."""
    from accuracy.tokenizer import load_tokenizer
    from sut.data.synthetic import write_tokenizer
    from sut.errors import InputError

    # synthetic ids are drawn from [1000, 120000): all inside this tokenizer (120,000 words + Llama 3's specials)
    tok = str(write_tokenizer(tmp_path / "small_tokenizer", vocab_size=120000))
    vocab = load_tokenizer(tok).vocab_size
    assert vocab < 128000
    with pytest.raises(InputError, match=rf"cnn_eval.json: record 0, field 'tok_input': id 128000 is outside the "
                                         rf"vocabulary of the tokenizer .*tokenizer \({vocab} ids\)"):
        _prepare(tmp_path, _real_style(tmp_path), mode="accuracy", tokenizer=tok)
    records = json.loads(synthetic.read_text())
    for r in records:  # without the BOS id 128000 (this tokenizer numbers its specials from 120000)
        r["tok_input"] = [i for i in r["tok_input"] if i < 120000]
    records[3]["tok_input"][-1] = vocab  # the first id past the tokenizer, still inside the model's vocabulary
    past = tmp_path / "data" / "past.json"
    past.write_text(json.dumps(records))
    with pytest.raises(InputError, match=rf"past.json: record 3, field 'tok_input': id {vocab} is outside"):
        _prepare(tmp_path, past, mode="accuracy", tokenizer=tok)
    _prepare(tmp_path, past, mode="accuracy", tokenizer=tok, max_samples=3)  # record 3 is not kept
    _prepare(tmp_path, past, mode="performance")  # no gate, no check
    assert not (tmp_path / "out").exists()



def test_prepare_run_refuses_a_same_size_tokenizer_whose_words_differ(tmp_path, synthetic):
    """Ids that all fit the tokenizer but were made by another one of the same size (here: every word one id off):
    the gate would decode the outputs into other words and FAIL after the run; refused before it, naming the
    records, the tokenizer and --no-accuracy-gate."""
    from sut.errors import InputError

    tok = str(_with_tokenizer_folder(synthetic))
    records = json.loads(synthetic.read_text())
    for r in records:
        r["tok_input"] = [r["tok_input"][0]] + [i + 1 for i in r["tok_input"][1:]]  # BOS kept; ids < 120,001
    shifted = tmp_path / "data" / "shifted.json"
    shifted.write_text(json.dumps(records))
    with pytest.raises(InputError, match=r"accuracy gate: the tokenizer .*tokenizer\) did not make .*shifted.json: it "
                                         r"decodes the 'tok_input' of record\(s\) 0, 1, 2 .*--no-accuracy-gate"):
        _prepare(tmp_path, shifted, mode="accuracy", tokenizer=tok)
    _prepare(tmp_path, shifted, mode="accuracy", accuracy_gate=False)  # no gate, no check
    _prepare(tmp_path, synthetic, mode="accuracy", tokenizer=tok)  # the tokenizer that made it
    assert not (tmp_path / "out").exists()


def test_cli_accuracy_run_without_a_tokenizer_exits_2_before_anything_starts(tmp_path, synthetic):
    folder = _with_tokenizer_folder(synthetic)
    out_dir = tmp_path / "results"
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--config", "loadgen_configs/cpu_tiny.toml", "--mode",
                          "accuracy", "--dataset", str(synthetic), "--max-samples", "8", "--output-dir", str(out_dir)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"pass --tokenizer {folder}" in out.stderr and "--no-accuracy-gate" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not out_dir.exists()


# ------------------------------------------------------------------------------------------- gen_len wording
REF = Reference("datacenter", "test", {"rouge1": 38.7, "rouge2": 15.9, "rougeL": 24.4, "rougeLsum": 35.7,
                                       "gen_len": 8167644}, 13368)
SCORES = {"rouge1": 40.0, "rouge2": 16.0, "rougeL": 25.0, "rougeLsum": 36.0, "gen_len": 67131, "gen_num": 64}


def test_gate_reason_says_characters_over_all_samples():
    from accuracy.gate import _reasons
    from accuracy.loadgen_log import check_log

    verdict = judge(SCORES, REF)
    (reason,) = _reasons(check_log([], 0, 10, (1,), 128), verdict)[-1:]
    assert reason == ("gen_len 67131 outside [35192.721, 43013.326] (characters over all samples; reference scaled "
                      "to this sample count 39103.023)")


def test_package_words_gen_len_as_the_gate_does_also_for_older_gate_files(tmp_path):
    from test_compliance import make_run, make_test06_run, settings

    from sut.submission.scenario import check_scenario

    runs = tmp_path / "runs"
    perf, t06 = make_run(runs, "perf", "performance"), make_test06_run(runs)
    acc = make_run(runs, "acc", "accuracy", accuracy={"passed": False})
    verdict = judge(SCORES, REF)
    old = {"passed": False, "verdict": verdict, "scores": SCORES,  # as the gate wrote it before this wording
           "reasons": ["rouge1 30.0 < 38.313 (99% of reference 38.7)",
                       "gen_len 67131 outside [35192.721, 43013.326] (per-sample)"]}
    (acc / "accuracy.json").write_text(json.dumps(old))
    from test_compliance import make_log_entry, write_log

    write_log(acc / "mlperf_log_accuracy.json", [make_log_entry(i, [1, 2, 128009]) for i in range(SCORES["gen_num"])])
    (problem,) = [p for p in check_scenario(settings(tmp_path, perf, acc, t06, allow_noncompliant=True)).problems
                  if "gate" in p]
    assert "(per-sample)" not in problem and "rouge1 30.0 < 38.313" in problem
    assert ("gen_len 67131 outside [35192.721, 43013.326] (characters over all samples; reference scaled to this "
            "sample count 39103.023)") in problem


def test_the_gate_after_a_run_names_the_model_as_the_source_of_its_eos_ids(tmp_path, synthetic, caplog):
    """A new user's find: `sut run` printed "EOS [...] (--eos-ids)" though no such flag exists there; the ids come
    from the run's model folder."""
    from types import SimpleNamespace

    from accuracy.loadgen_log import make_log_entry
    from sut.record.gate import accuracy_gate_record

    tok = str(_with_tokenizer_folder(synthetic))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    entries = [make_log_entry(i, [1000 + i, 128009]) for i in range(8)]
    (run_dir / "mlperf_log_accuracy.json").write_text(json.dumps(entries))
    rs = SimpleNamespace(mode="accuracy", accuracy_gate=True, tokenizer=tok, dataset=str(synthetic), max_samples=None)
    model = SimpleNamespace(path="models/m", eos_token_ids=(128001, 128009))
    with caplog.at_level("INFO", logger="accuracy"):
        rec = accuracy_gate_record(rs, SimpleNamespace(model="models/m"), model, None, run_dir)
    assert "skipped" not in rec, rec
    source = "eos_token_id of the run's model models/m"
    assert json.loads((run_dir / "accuracy.json").read_text())["inputs"]["eos_ids_source"] == source
    said = [r.getMessage() for r in caplog.records if "EOS [" in r.getMessage()]
    assert said and f"EOS [128001, 128009] ({source})" in said[0] and "--eos-ids" not in said[0], said
