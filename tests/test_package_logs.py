"""``python -m sut package`` checks the run folders' LoadGen logs against their run.json (``sut/submission/logs.py``):
a user relabelled a Server run Interactive, marked an INVALID run VALID, and cut or padded accuracy logs, and
``package`` laid them out."""

import json
import shutil

import pytest
from test_compliance import gate_result, make_log_entry, make_run, make_test06_run, settings, write_log

from sut.errors import ComplianceError
from sut.submission.scenario import check_scenario


def _detail(folder, **values):
    (folder / "mlperf_log_detail.txt").write_text("".join(
        f':::MLLOG {json.dumps({"key": k, "value": v})}\n' for k, v in values.items()))


def _edit(folder, **fields):
    rec = json.loads((folder / "run.json").read_text())
    rec.update(fields)
    (folder / "run.json").write_text(json.dumps(rec))


@pytest.fixture
def runs(tmp_path):
    base = tmp_path / "runs"
    return make_run(base, "perf", "performance"), make_run(base, "acc", "accuracy"), make_test06_run(base)


def test_runs_whose_logs_agree_with_run_json_are_laid_out(tmp_path, runs):
    perf, acc, t06 = runs
    _detail(perf, effective_scenario="Offline", result_validity="VALID")
    _detail(acc, effective_scenario="Offline")
    assert check_scenario(settings(tmp_path, perf, acc, t06)).problems == ()


@pytest.mark.parametrize("fields, detail, said", [
    (dict(scenario="Interactive", loadgen_scenario="Server", model_key="llama3_1-8b-interactive"),
     dict(effective_scenario="Server", requested_server_ttft_latency=2_000_000_000,
          requested_server_tpot_latency=100_000_000, result_validity="VALID"),
     "run.json says Interactive, but its mlperf_log_detail.txt ran with a TTFT limit of 2000 ms (Interactive's is 500"),
    (dict(scenario="Server", loadgen_scenario="Server"), dict(effective_scenario="Offline", result_validity="VALID"),
     "run.json says scenario Server (LoadGen Server), but its mlperf_log_detail.txt ran LoadGen's Offline"),
    (dict(), dict(effective_scenario="Offline", result_validity="INVALID"),
     "run.json says 'VALID', but its mlperf_log_detail.txt says 'INVALID'"),
    (dict(), dict(effective_scenario="Offline"),  # a recheck's find: the line cut out of the log
     "run.json says 'VALID', but its mlperf_log_detail.txt says nothing (no result_validity line)"),
])
def test_a_performance_run_json_that_its_detail_log_contradicts_is_refused(tmp_path, runs, fields, detail, said):
    perf, acc, t06 = runs
    _edit(perf, **fields)
    _detail(perf, **detail)
    with pytest.raises(ComplianceError, match="performance run .*" + said.replace("(", r"\(").replace(")", r"\)")):
        check_scenario(settings(tmp_path, perf, acc, t06, allow_noncompliant=True))


def test_an_accuracy_log_cut_padded_or_not_the_one_scored_is_refused(tmp_path, runs):
    perf, acc, t06 = runs
    log = acc / "mlperf_log_accuracy.json"
    four = [make_log_entry(i, [1, 2, 128009]) for i in range(4)]
    _edit(acc, ledger={"issued": 4, "completed": 4})
    for entries, said in ((four[:2], "holds 2 responses, run.json's ledger says 4 samples were issued"),
                          (four[:3] + four[:1], r"holds 1 repeated sample\(s\)")):
        write_log(log, entries)
        with pytest.raises(ComplianceError, match="accuracy run .*mlperf_log_accuracy.json " + said):
            check_scenario(settings(tmp_path, perf, acc, t06))
    write_log(log, four)
    gate = json.loads((acc / "accuracy.json").read_text())
    (acc / "accuracy.json").write_text(json.dumps(dict(gate, scores=dict(gate["scores"], gen_num=64))))
    with pytest.raises(ComplianceError, match="holds 4 responses, accuracy.json scored 64: re-score"):
        check_scenario(settings(tmp_path, perf, acc, t06))
    (acc / "accuracy.json").write_text(json.dumps(dict(gate, scores=dict(gate["scores"], gen_num=4))))
    with pytest.raises(ComplianceError, match="mlperf_log_accuracy.json is not the log its accuracy.json scored "
                                              r"\(sha256 [0-9a-f]{12}\.\.\. recorded\): it changed after the gate"):
        check_scenario(settings(tmp_path, perf, acc, t06))  # found by a fault test: an edited log kept an old verdict
    gate = gate_result(True, log=log)
    (acc / "accuracy.json").write_text(json.dumps(dict(gate, scores=dict(gate["scores"], gen_num=4))))
    check_scenario(settings(tmp_path, perf, acc, t06))


def test_a_gate_verdict_without_the_logs_hash_or_against_a_home_made_reference_is_not_compliant(tmp_path, runs):
    perf, acc, t06 = runs
    log = acc / "mlperf_log_accuracy.json"
    for gate, said in ((gate_result(True), "accuracy.json records no sha256 of the log it scored"),
                       (dict(gate_result(True, log=log), reference={"name": "/tmp/ref.json"}),
                        "the gate passed against the reference '/tmp/ref.json', not the official targets")):
        (acc / "accuracy.json").write_text(json.dumps(gate))
        with pytest.raises(ComplianceError, match="not compliant .*\n  accuracy run: " + said):
            check_scenario(settings(tmp_path, perf, acc, t06))
        assert any(said in p for p in check_scenario(settings(tmp_path, perf, acc, t06,
                                                              allow_noncompliant=True)).problems)


def test_a_test06_run_relabelled_to_another_scenario_is_refused(tmp_path, runs):
    perf, acc, t06 = runs
    _detail(t06, effective_scenario="Server", requested_server_ttft_latency=2_000_000_000)
    with pytest.raises(ComplianceError, match=r"TEST06 run .*run.json says scenario Offline \(LoadGen Offline\), but "
                                              "its mlperf_log_detail.txt ran LoadGen's Server"):
        check_scenario(settings(tmp_path, perf, acc, t06))


def test_a_missing_test06_run_names_the_scenario(tmp_path, runs):
    perf, acc, _ = runs
    with pytest.raises(ComplianceError, match="closed-division llama3.1-8b Offline needs a TEST06 run .*--scenario "
                                              "Offline"):
        check_scenario(settings(tmp_path, perf, acc, None))


def test_a_run_made_with_another_user_conf_is_refused_naming_the_setting(tmp_path, runs):
    """A known gap: package laid out a scenario whose accuracy run read another user.conf than the
    performance run, and the tree holds only the performance run's."""
    perf, acc, t06 = runs
    _detail(perf, effective_scenario="Offline", result_validity="VALID")
    _detail(acc, effective_scenario="Offline")
    (acc / "user.conf").write_text("# other comments, same setting\nllama3_1-8b.Offline.target_qps = 5\n"
                                   "llama3_1-8b.Server.target_qps = 9\n")  # another run's line: not this run's
    assert check_scenario(settings(tmp_path, perf, acc, t06)).problems == ()
    for same in ("5.0", "+5", "5e0"):  # the same number, written otherwise (sut.settings.userconf.value_key)
        (acc / "user.conf").write_text(f"llama3_1-8b.Offline.target_qps = {same}\n")
        assert check_scenario(settings(tmp_path, perf, acc, t06)).problems == (), same
    (acc / "user.conf").write_text("llama3_1-8b.Offline.target_qps = 6\n")
    with pytest.raises(ComplianceError, match=r"accuracy run .*acc read other LoadGen settings from its user.conf "
                                              r"than the performance run: target_qps '6' vs '5'"):
        check_scenario(settings(tmp_path, perf, acc, t06))
    (acc / "user.conf").write_text("llama3_1-8b.Offline.target_qps = 5\n")
    (t06 / "user.conf").write_text("llama3_1-8b.Offline.target_qps = 5\nllama3_1-8b.Offline.min_duration = 1000\n")
    with pytest.raises(ComplianceError, match=r"TEST06 run .* min_duration '1000' vs None"):
        check_scenario(settings(tmp_path, perf, acc, t06))
    (t06 / "user.conf").unlink()
    with pytest.raises(ComplianceError, match=r"TEST06 run .*: its user.conf was not kept in the run folder"):
        check_scenario(settings(tmp_path, perf, acc, t06))


def test_a_locality_run_is_refused_as_not_mlperf_by_package_and_accuracy(tmp_path, runs):
    """Package and accuracy refused a `python -m sut.locality` folder without saying it is no
    MLPerf run (one message blamed a model key, another was '[Errno 21] Is a directory')."""
    from accuracy.loadgen_log import AccuracyInputError, read_accuracy_log

    perf, acc, t06 = runs
    loc = tmp_path / "x-SYNTHETIC-LOCALITY-NOT-MLPERF"
    loc.mkdir()
    (loc / "locality.json").write_text(json.dumps({"kind": "synthetic-locality", "mlperf": False}))
    with pytest.raises(ComplianceError, match="is a synthetic-locality run .*NOT an MLPerf run"):
        check_scenario(settings(tmp_path, loc, acc, t06))
    (loc / "run.json").write_text((loc / "locality.json").read_text())  # renamed by hand
    with pytest.raises(ComplianceError, match="is a synthetic-locality run folder .*NOT an MLPerf run"):
        check_scenario(settings(tmp_path, loc, acc, t06))  # the folder's name and locality.json say so first
    (loc / "locality.json").unlink()
    loc = loc.rename(tmp_path / "renamed")
    with pytest.raises(ComplianceError, match=r"a synthetic-locality record \(\"mlperf\": false\), NOT an MLPerf run"):
        check_scenario(settings(tmp_path, loc, acc, t06))
    (loc / "locality.json").write_text((loc / "run.json").read_text())
    (loc / "run.json").unlink()
    with pytest.raises(AccuracyInputError, match="is a synthetic-locality run folder .*NOT an MLPerf run"):
        read_accuracy_log(loc)
    with pytest.raises(AccuracyInputError, match="its folder is a synthetic-locality run folder .*NOT an MLPerf"):
        read_accuracy_log(loc / "locality.json")
    shutil.copy(loc / "locality.json", tmp_path / "x.json")  # the record alone, elsewhere
    with pytest.raises(AccuracyInputError, match="is a synthetic-locality record .*NOT an MLPerf run"):
        read_accuracy_log(tmp_path / "x.json")
    with pytest.raises(AccuracyInputError, match="is a folder: pass --accuracy-log .*mlperf_log_accuracy.json"):
        read_accuracy_log(acc)



def test_a_locality_run_cut_off_before_its_record_is_refused_too(tmp_path, runs):
    """A locality run stopped before its locality.json holds only its header and cases (or only its name says what
    it is): still no MLPerf run, for accuracy, package and test06-verify alike."""
    from accuracy.loadgen_log import LOCALITY_SUFFIX, AccuracyInputError, read_accuracy_log
    from sut.locality import RUN_SUFFIX

    assert LOCALITY_SUFFIX == RUN_SUFFIX  # the accuracy package imports nothing of sut: one value, kept in step
    perf, acc, t06 = runs
    for name, files in (("cut", ("run_header.json",)), ("cases", ("cases.jsonl",)), ("x" + RUN_SUFFIX, ())):
        loc = tmp_path / name
        loc.mkdir()
        shutil.copy(acc / "mlperf_log_accuracy.json", loc)
        for f in files:
            (loc / f).write_text("{}\n")
        with pytest.raises(AccuracyInputError, match="is a synthetic-locality run folder .*NOT an MLPerf run"):
            read_accuracy_log(loc)
        with pytest.raises(ComplianceError, match="is a synthetic-locality run .*NOT an MLPerf run"):
            check_scenario(settings(tmp_path, loc, acc, t06))


def _locality_record(**edits) -> dict:
    """A ``locality.json`` as ``sut.locality.runner.write_record`` writes it (its settings part), edited."""
    rec = {"kind": "synthetic-locality", "mlperf": False, "notice": "NOT an MLPerf result", "status": "ok",
           "command": "python -m sut.locality run", "trace_hash": "ab" * 32, "input_hashes": ["cd" * 32],
           "trace_settings": {"documents": 1}, "pair_settings": {"pairs": 1}, "router_settings": {},
           "engine_settings": {"model": "/m"}, "model": {"path": "/m", "revision": "r"}}
    for k, v in edits.items():
        if v is None:
            rec.pop(k, None)
        else:
            rec[k] = v
    return rec


@pytest.mark.parametrize("edits", [dict(mlperf=None, kind=None), dict(mlperf=True, kind="mlperf-loadgen"),
                                   dict(mlperf="false", kind=None), dict(mlperf=0, kind="mlperf-loadgen")])
def test_a_locality_record_with_its_marker_removed_or_changed_is_refused_as_run_json(tmp_path, runs, edits):
    """Before: a locality.json copied to run.json with "mlperf": false removed (or made true, kind mlperf-loadgen)
    passed check_record; test06-verify verified a log beside it and package went on to the run's mode."""
    from accuracy.__main__ import main as accuracy_main
    from sut.record.test06 import verify_run_folder

    perf, acc, t06 = runs
    loc = tmp_path / "renamed"
    loc.mkdir()
    shutil.copy(acc / "mlperf_log_accuracy.json", loc)
    (loc / "run.json").write_text(json.dumps(_locality_record(**edits)))
    with pytest.raises(ComplianceError, match=r"run.json: a synthetic-locality record \(.*\), NOT an MLPerf run"):
        check_scenario(settings(tmp_path, loc, acc, t06))
    with pytest.raises(ComplianceError, match=r"a synthetic-locality record .*NOT an MLPerf run"):
        verify_run_folder(loc, out=tmp_path / "t06out")
    assert not (tmp_path / "t06out").exists()
    assert accuracy_main(["--accuracy-log", str(loc / "mlperf_log_accuracy.json"), "--dataset", "/d.json",
                          "--tokenizer", "/t"]) == 2
    assert sorted(p.name for p in loc.iterdir()) == ["mlperf_log_accuracy.json", "run.json"]
    case = {"pair": 0, "system": "standalone", "policy": "round_robin", "timed": {"requests": 1},
            "validation": {"failures": 0}}  # one cases.jsonl line as run.json
    (loc / "run.json").write_text(json.dumps(case))
    with pytest.raises(ComplianceError, match=r"a synthetic-locality record \(its \"mlperf\" marker removed\)"):
        check_scenario(settings(tmp_path, loc, acc, t06))


def test_a_locality_folder_with_a_run_json_or_below_a_locality_folder_is_refused(tmp_path, runs, capsys):
    """Before: a run.json put beside a locality run's files made the folder pass for a run folder, and a case folder
    of a locality run (or any folder below one) was never looked at: package, test06-verify and python -m accuracy
    took a log planted there, the gate writing accuracy.json into the locality run."""
    from accuracy.__main__ import main as accuracy_main
    from accuracy.loadgen_log import AccuracyInputError, read_accuracy_log
    from sut.record.test06 import verify_run_folder

    perf, acc, t06 = runs
    loc = tmp_path / "x-SYNTHETIC-LOCALITY-NOT-MLPERF"
    shutil.copytree(acc, loc)  # a real accuracy run's files, run.json included, in a locality run's folder
    (loc / "cases.jsonl").write_text("")
    inner = tmp_path / "plain" / "pair0-standalone-round_robin"
    shutil.copytree(acc, inner)  # a case folder of a locality run (renamed) holding an accuracy run
    (inner.parent / "locality.json").write_text(json.dumps(_locality_record()))
    for d, said in ((loc, "is a synthetic-locality run folder"),
                    (inner, f"lies inside {inner.parent}, which is a synthetic-locality run folder")):
        before = sorted(p.name for p in d.iterdir())
        with pytest.raises(ComplianceError, match=f"{said} .*NOT an MLPerf run"):
            check_scenario(settings(tmp_path, perf, d, t06))
        with pytest.raises(ComplianceError, match=f"{said} .*NOT an MLPerf run"):
            verify_run_folder(d, out=tmp_path / "t06out")
        with pytest.raises(ComplianceError, match=f"{said} .*NOT an MLPerf run"):
            verify_run_folder(t06, out=d)
        with pytest.raises(AccuracyInputError, match=f"its folder {said} .*NOT an MLPerf run"):
            read_accuracy_log(d / "mlperf_log_accuracy.json")
        capsys.readouterr()
        assert accuracy_main(["--accuracy-log", str(d / "mlperf_log_accuracy.json"), "--dataset", "/d.json",
                              "--tokenizer", "/t"]) == 2
        assert f"its folder {said}" in capsys.readouterr().err
        assert accuracy_main(["--accuracy-log", str(acc / "mlperf_log_accuracy.json"), "--dataset", "/d.json",
                              "--tokenizer", "/t", "--output-dir", str(d)]) == 2
        assert f"--output-dir {d} {said}" in capsys.readouterr().err
        assert sorted(p.name for p in d.iterdir()) == before
    assert not (tmp_path / "t06out").exists()


def test_locality_files_further_up_than_a_parent_do_not_make_a_run_folder_locality(tmp_path):
    """A locality report written into a folder that MLPerf runs lie two levels below is no reason to refuse them;
    a suffix-named locality run folder further up is."""
    from accuracy.loadgen_log import locality_folder_why

    run = tmp_path / "results" / "server" / "run1"
    run.mkdir(parents=True)
    (tmp_path / "results" / "locality.json").write_text(json.dumps(_locality_record()))
    assert locality_folder_why(run) is None
    assert "lies inside" in locality_folder_why(run.parent)  # a case folder's parent holds the record
    deep = tmp_path / "r-SYNTHETIC-LOCALITY-NOT-MLPERF" / "a" / "b"
    deep.mkdir(parents=True)
    assert locality_folder_why(deep).startswith(f"lies inside {deep.parent.parent}, which is")
