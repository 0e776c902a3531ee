"""``python -m sut package --allow-noncompliant`` (the command the demo and quickstart.sh print) on
dev runs: the rehearsal tree holds exactly one NOT-COMPLIANT.txt, with every reason."""

import os
import stat
import subprocess
import sys

import pytest
from conftest import REPO, sut_env
from test_compliance import make_run, make_test06_run

RUN_REASON = "dataset has 64 samples, the benchmark needs 13368"


def test_rehearsal_tree_has_one_not_compliant_note_with_every_reason(tmp_path):
    base = tmp_path / "demo"
    perf = make_run(base, "performance-NOT-COMPLIANT", "performance",
                    compliance={"compliant": False, "reasons": [RUN_REASON]})
    acc = make_run(base, "accuracy-NOT-COMPLIANT", "accuracy", accuracy={"passed": False, "reasons": ["rouge1 0.1"]})
    t06 = make_test06_run(base)
    out = tmp_path / "submission"
    cmd = [sys.executable, "-m", "sut", "package", "--allow-noncompliant", "--out", str(out), "--system",
           "1xCPU_tiny_demo", "--submitter", "demo", "--performance", str(perf), "--accuracy", str(acc),
           "--test06", str(t06)]
    run = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    tree = out / "closed" / "demo"
    notes = sorted(out.rglob("NOT-COMPLIANT.txt"))
    assert notes == [tree / "NOT-COMPLIANT.txt"]  # one file, at the tree root; none in the scenario folder
    assert f"each in {notes[0]}" in run.stderr and "package-partial" not in run.stderr  # where it is, not was built
    lines = notes[0].read_text().splitlines()
    assert lines[0] == "These runs are not compliant; this tree is a rehearsal:"
    assert f"- Offline: performance run: {RUN_REASON}" in lines  # the runs' reasons, named by scenario ...
    assert any(ln.startswith("- Offline: accuracy run: the accuracy gate did not pass") for ln in lines)
    assert any("(one of) Interactive or Server" in ln for ln in lines)  # ... and the tree's own
    assert not any("audit config" in ln for ln in lines)  # a TEST06 run's audit config is no problem
    assert (tree / "results" / "1xCPU_tiny_demo" / "llama3.1-8b" / "Offline" / "TEST06").is_dir()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    again = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)  # the same --out
    assert again.returncode == 2 and "already holds" in again.stderr and "llama3.1-8b/Offline" in again.stderr, \
        again.stderr[-2000:]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # the first tree is left as it was


def test_compliant_tree_has_no_note(tmp_path):
    base = tmp_path / "runs"
    perf = [make_run(base / s, "perf", "performance", scenario=s, model_key=k)
            for s, k in (("Offline", "llama3_1-8b"), ("Server", "llama3_1-8b"))]
    acc = [make_run(base / s, "acc", "accuracy", scenario=s) for s in ("Offline", "Server")]
    from test_compliance import write_system_desc

    from sut.submission.tree import TreeSettings, package_tree

    root = package_tree(TreeSettings(out=str(tmp_path / "sub"), system="s", submitter="o", division="open",
                                     performance_runs=tuple(map(str, perf)), accuracy_runs=tuple(map(str, acc)),
                                     allow_noncompliant=True, system_desc=str(write_system_desc(tmp_path / "d.json"))))
    assert not list((tmp_path / "sub").rglob("NOT-COMPLIANT.txt"))
    assert {p.name for p in (root / "results" / "s" / "llama3.1-8b").iterdir()} == {"Offline", "Server"}


def test_refusal_lists_every_reason_of_every_scenario_at_once(tmp_path):
    """A new user fixed one scenario at a time: without --allow-noncompliant the refusal named only the tree's
    missing Server, then (once added) only Offline's reasons, never Server's. Now one refusal names them all,
    and nothing is written."""
    import pytest

    from sut.errors import ComplianceError
    from sut.submission.tree import TreeSettings, package_tree

    base = tmp_path / "runs"
    perf = make_run(base, "perf", "performance", compliance={"compliant": False, "reasons": [RUN_REASON]})
    acc = make_run(base, "acc", "accuracy", accuracy={"passed": False, "reasons": ["rouge1 0.1"]})
    t06 = make_test06_run(base)
    out = tmp_path / "sub"
    with pytest.raises(ComplianceError) as ei:
        package_tree(TreeSettings(out=str(out), system="s", submitter="o", performance_runs=(str(perf),),
                                  accuracy_runs=(str(acc),), test06_runs=(str(t06),)))
    msg = str(ei.value)
    assert "(one of) Interactive or Server" in msg and f"Offline: performance run: {RUN_REASON}" in msg
    assert "Offline: accuracy run: the accuracy gate did not pass" in msg
    assert not out.exists() or not any(out.rglob("*.json")), "a refused tree writes nothing"


def test_system_json_fills_what_run_json_knows_and_marks_the_rest():
    from types import SimpleNamespace

    from sut.submission.tree import FILL_IN, SYSTEM_FIELDS, system_json

    rec = {"sut": "vllm", "versions": {"vllm": "0.26.0", "torch": "2.11.0", "mlcommons-loadgen": "6.0.17"},
           "host_info": {"os": "Linux-x", "cpu": "Intel Xeon 8480", "cpu_count": 16, "gpu_driver": "580.1"},
           "devices": [{"kind": "cuda", "uuid": "GPU-1", "name": "NVIDIA H200"}]}
    out = system_json(SimpleNamespace(division="closed", submitter="o", system="1xH200"), rec)
    assert set(out) == set(SYSTEM_FIELDS)
    assert out["accelerators_per_node"] == 1 and out["accelerator_model_name"] == "NVIDIA H200"
    assert out["host_processor_model_name"] == "Intel Xeon 8480" and "NVIDIA driver 580.1" in out["other_software_stack"]
    assert out["host_processor_core_count"].startswith(FILL_IN) and "saw 16 logical CPUs" in out["host_processor_core_count"]
    assert out["status"].startswith(FILL_IN) and out["accelerator_memory_capacity"].startswith(FILL_IN)


@pytest.mark.parametrize("field, value, why", [
    ("host_info", "a host", "field 'host_info' must be an object, got str"),
    ("devices", "cuda", "field 'devices' must be a list of objects (or nulls), got str"),
    ("devices", ["cuda"], "field 'devices' must be a list of objects (or nulls), got list"),
    ("host_info", {"os": ["Linux"]}, "field 'host_info.os' must be a string, got list"),
    ("host_info", {"cpu_count": "16"}, "field 'host_info.cpu_count' must be an integer (within +-2**53), got str"),
    ("samples_per_s", float("nan"), "field 'samples_per_s' must be a finite number, got float NaN"),
    ("model", {"vocab_size": 10 ** 30}, "field 'model.vocab_size' must be an integer (within +-2**53), got int"),
    ("devices", [{"kind": "cuda", "name": 5}], "field 'devices[0].name' must be a string, got int 5"),
    ("devices", [{"kind": "cuda", "uuid": ["GPU-1"]}], "field 'devices[0].uuid' must be a string, got list"),
])
def test_package_refuses_a_run_json_field_of_the_wrong_type_with_exit_2_before_writing(tmp_path, field, value, why):
    """Before: a string host_info or devices crashed `package` building systems/<system>.json (exit 1, AttributeError
    "'str' object has no attribute 'get'"), after the scenario folders had been laid out in the build folder."""
    perf = make_run(tmp_path / "runs", "perf", "performance", **{field: value})
    acc = make_run(tmp_path / "runs", "acc", "accuracy")
    r = subprocess.run([sys.executable, "-m", "sut", "package", "--allow-noncompliant", "--out", str(tmp_path / "sub"),
                        "--system", "s", "--submitter", "o", "--division", "open", "--performance", str(perf),
                        "--accuracy", str(acc)], env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--performance {perf}: {perf / 'run.json'}: {why}" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.parametrize("flag, name, spoil, why", [
    ("--performance", "mlperf_log_detail.txt", "remove", "mlperf_log_detail.txt is missing"),
    ("--performance", "mlperf_log_summary.txt", "empty", "mlperf_log_summary.txt is empty"),
    ("--accuracy", "mlperf_log_detail.txt", "remove", "mlperf_log_detail.txt is missing"),
    ("--accuracy", "accuracy.txt", "folder", "accuracy.txt is missing (not a regular file)"),
    ("--accuracy", "mlperf_log_accuracy.json", "remove", "mlperf_log_accuracy.json is missing"),
    ("--test06", "mlperf_log_detail.txt", "remove", "mlperf_log_detail.txt is missing"),
    ("--performance", "user.conf", "remove", "its user.conf was not kept in the run folder and {folder}/user.conf "
                                             "does not exist any more"),
])
def test_package_refuses_a_run_folder_without_a_file_it_needs_with_exit_2_before_writing(tmp_path, flag, name, spoil,
                                                                                          why):
    """Before: a missing or empty log was a failed packaging (exit 1, "cannot package: ... is missing or empty"), and
    a TEST06 run without its mlperf_log_detail.txt was laid out with its scenario unchecked (exit 0)."""
    base = tmp_path / "runs"
    runs = {"--performance": make_run(base, "perf", "performance"), "--accuracy": make_run(base, "acc", "accuracy"),
            "--test06": make_test06_run(base)}
    folder = runs[flag]
    (folder / name).unlink()
    if spoil == "empty":
        (folder / name).write_bytes(b"")
    elif spoil == "folder":
        (folder / name).mkdir()
    r = subprocess.run([sys.executable, "-m", "sut", "package", "--allow-noncompliant", "--out", str(tmp_path / "sub"),
                        "--system", "s", "--submitter", "o", *[x for f, d in runs.items() for x in (f, str(d))]],
                       env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{flag} {folder}: {why.format(folder=folder)}" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_package_names_the_cause_of_a_run_that_did_not_end_ok_not_a_log_it_never_wrote(tmp_path, status):
    """A run whose engine died before LoadGen started has no LoadGen logs: the refusal names its status and cause
    (exit 1, as for every failed run), not "mlperf_log_summary.txt is missing" (exit 2, as if the folder were
    damaged). Before: the pre-check of the logs came first and hid the cause."""
    base = tmp_path / "runs"
    cause = "engine 0 (pid 123) exited unexpectedly with code -9 (SIGKILL)"
    perf = make_run(base, "perf", "performance", status=status, error=cause, validity=None)
    for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
        (perf / name).unlink()
    acc = make_run(base, "acc", "accuracy")
    r = subprocess.run([sys.executable, "-m", "sut", "package", "--allow-noncompliant", "--out", str(tmp_path / "sub"),
                        "--system", "s", "--submitter", "o", "--performance", str(perf), "--accuracy", str(acc)],
                       env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-1500:]
    assert f"performance run {perf}: status is '{status}' ({cause}), not 'ok'" in r.stderr, r.stderr[-1500:]
    assert "is missing" not in r.stderr and not (tmp_path / "sub").exists()


def test_system_json_takes_a_device_record_that_is_null():
    """``devices`` as the harness writes it (``[e.get("device") for e in engines]``) may hold null."""
    from types import SimpleNamespace

    from sut.submission.tree import system_json

    rec = {"devices": [None, {"kind": "cuda", "uuid": "GPU-1", "name": "NVIDIA H100"}]}
    out = system_json(SimpleNamespace(division="closed", submitter="o", system="s"), rec)
    assert out["accelerators_per_node"] == 1 and out["accelerator_model_name"] == "NVIDIA H100"


def test_measurements_and_readme_say_what_the_engines_ran_not_what_was_asked():
    """With --server-url, --quantization fp8 --kv-cache-dtype fp8 changed nothing on the running
    server, yet measurements.json said fp8 for both. Read-back values win; servers given by URL that do not report
    a setting leave it unknown; engines the harness started applied what was asked."""
    from sut.submission.files import UNKNOWN_REMOTE, measurements, readme

    asked = {"model": "/m/Llama-3.1-8B", "dtype": "auto", "quantization": "fp8", "kv_cache_dtype": "fp8",
             "max_num_seqs": 512}
    remote = {"engine_settings": asked, "versions": {"vllm": "0.32.0"}, "engines": [
        {"engine_args": {"model": "m", "kv_cache_dtype": "auto", "max_model_len": 4096},
         "device": {"kind": "remote", "slot": "http://h:1", "name": None, "uuid": None}}]}
    m = measurements(remote)
    assert m["kv_cache_data_type"] == "auto" and m["weight_data_types"] == UNKNOWN_REMOTE
    assert m["weight_transformations"] == UNKNOWN_REMOTE
    text = readme("1xH200", remote, {}, None, "llama3.1-8b", "Offline")
    assert f"quantization {UNKNOWN_REMOTE}, KV cache auto" in text and "max_model_len 4096" in text
    local = dict(remote, engines=[{"engine_args": {"model": "m", "max_model_len": 4096},
                                   "device": {"kind": "cuda", "slot": "0", "name": "H200", "uuid": "GPU-1"}}])
    m = measurements(local)
    assert m["weight_data_types"] == "fp8" and m["kv_cache_data_type"] == "fp8"


def test_the_os_is_named_as_system_descriptions_name_it(monkeypatch):
    """A new user's find: systems/<system>.json got "Linux-6.18...-x86_64-with-glibc2.36" (a platform string)."""
    import platform

    from sut.record.write import os_name

    monkeypatch.setattr(platform, "freedesktop_os_release", lambda: {"PRETTY_NAME": "Ubuntu 24.04.1 LTS"})
    monkeypatch.setattr(platform, "release", lambda: "6.8.0-45-generic")
    assert os_name() == "Ubuntu 24.04.1 LTS (kernel 6.8.0-45-generic)"

    def missing():
        raise OSError("no os-release")
    monkeypatch.setattr(platform, "freedesktop_os_release", missing)
    assert os_name() == platform.platform()


def test_src_readme_lists_the_untracked_files_the_commands_read(tmp_path):
    """A new user's find: every command used --user-conf my.user.conf, a file not in the commit, and src/README.md
    did not say so."""
    import subprocess

    from sut.submission.tree import untracked_inputs, write_src

    repo = tmp_path / "repo"
    (repo / "loadgen_configs").mkdir(parents=True)
    (repo / "loadgen_configs" / "cpu.toml").write_text("")
    (repo / "tok").mkdir()
    (repo / "tok" / "tokenizer.json").write_text("{}")
    for cmd in (["init", "-q"], ["add", "loadgen_configs", "tok"],
                ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    (repo / "my.user.conf").write_text("llama3_1-8b.Offline.target_qps = 3\n")
    cmds = [f"python -m sut run --config loadgen_configs/cpu.toml --user-conf {repo}/my.user.conf --tokenizer tok",
            "python -m sut run --config=loadgen_configs/cpu.toml --user-conf=my.user.conf --dataset /data/x.json"]
    runs = [("Offline", "performance", {"command": c}) for c in cmds]
    assert untracked_inputs([c.replace(f"{repo}/", "") for c in cmds], repo) == ["my.user.conf"]
    text = (write_src(tmp_path / "src", runs, repo) / "README.md").read_text()
    assert "## Files the commands read that are not in the commit\n\n- `my.user.conf`\n" in text
    assert untracked_inputs(cmds, tmp_path / "not-a-repo") == []


def test_package_names_a_locality_folder_as_not_mlperf_and_exits_2(tmp_path):
    """A recheck's find: the command line refused a `python -m sut.locality` folder as "not a run folder", and one
    whose locality.json was copied to run.json with exit 1, neither saying it is no MLPerf run."""
    import json

    loc = tmp_path / "x-SYNTHETIC-LOCALITY-NOT-MLPERF"
    loc.mkdir()
    (loc / "locality.json").write_text(json.dumps({"kind": "synthetic-locality", "mlperf": False}))
    cmd = [sys.executable, "-m", "sut", "package", "--out", str(tmp_path / "t"), "--system", "s", "--submitter", "x",
           "--performance", str(loc), "--accuracy", str(loc)]
    for _ in range(2):
        run = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "synthetic-locality" in run.stderr and "NOT an MLPerf run" in run.stderr
        assert not (tmp_path / "t").exists()
        (loc / "run.json").write_text((loc / "locality.json").read_text())  # then: renamed by hand


_STOP_MIDWAY = """
import os, signal, sys
import sut.submission.scenario as ps
from sut.cli import main
copy2, calls = ps.shutil.copy2, []
def copy_then_stop(*a, **k):
    calls.append(a)
    if len(calls) == 3:  # a few files of the first scenario copied
        os.kill(os.getpid(), signal.SIGTERM)
    return copy2(*a, **k)
ps.shutil.copy2 = copy_then_stop
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_package_exits_130_and_leaves_nothing_then_the_same_command_works(tmp_path):
    """Before: rc 143 (-15 here) with a partial tree at --out and no NOT-COMPLIANT.txt; the same command then
    refused the folder ("already holds")."""
    base = tmp_path / "demo"
    perf = make_run(base, "performance-NOT-COMPLIANT", "performance",
                    compliance={"compliant": False, "reasons": [RUN_REASON]})
    acc = make_run(base, "accuracy", "accuracy")
    t06 = make_test06_run(base)
    out = tmp_path / "new" / "submission"
    args = ["package", "--allow-noncompliant", "--out", str(out), "--system", "s", "--submitter", "o",
            "--performance", str(perf), "--accuracy", str(acc), "--test06", str(t06)]
    stopped = subprocess.run([sys.executable, "-c", _STOP_MIDWAY, *args], env=sut_env(), cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 130 and "interrupted (SIGTERM)" in stopped.stderr, stopped.stderr[-2000:]
    assert not (tmp_path / "new").exists(), sorted(map(str, (tmp_path / "new").rglob("*")))
    again = subprocess.run([sys.executable, "-m", "sut", *args], env=sut_env(), cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "closed" / "o" / "NOT-COMPLIANT.txt").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["submission"]  # no build folder left beside it


def test_package_into_an_existing_out_merges_and_leaves_no_build_folder(tmp_path):
    from sut.submission.tree import TreeSettings, package_new_tree

    base = tmp_path / "runs"
    perf = make_run(base, "perf", "performance", compliance={"compliant": False, "reasons": [RUN_REASON]})
    acc = make_run(base, "acc", "accuracy")
    out = tmp_path / "sub"
    (out / "closed" / "other").mkdir(parents=True)
    (out / "closed" / "other" / "keep.txt").write_text("x")
    root = package_new_tree(TreeSettings(out=str(out), system="s", submitter="o", division="open",
                                         performance_runs=(str(perf),), accuracy_runs=(str(acc),),
                                         allow_noncompliant=True))
    assert root == out / "open" / "o" and (root / "systems" / "s.json").is_file()
    assert (out / "closed" / "other" / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "sub"]


@pytest.mark.parametrize("target", ["empty", "holding-a-tree", "missing"])
def test_package_into_an_out_that_is_a_symbolic_link_fills_the_folder_it_points_to(tmp_path, target):
    """Before: --out a link to an empty folder did all the work, then failed with "[Errno 20] Not a directory:
    '...package-partial-...' -> '.../out'" (a rename onto the link)."""
    from sut.submission.tree import TreeSettings, package_new_tree

    base = tmp_path / "runs"
    perf = make_run(base, "perf", "performance", compliance={"compliant": False, "reasons": [RUN_REASON]})
    acc = make_run(base, "acc", "accuracy")
    real = tmp_path / "elsewhere" / "real"
    if target != "missing":
        real.mkdir(parents=True)
        real.chmod(0o750)  # an empty one is replaced by the build folder: its permissions stay (not mkdtemp's 0700)
    if target == "holding-a-tree":
        (real / "closed" / "other").mkdir(parents=True)
        (real / "closed" / "other" / "keep.txt").write_text("x")
    link = tmp_path / "links" / "out"
    link.parent.mkdir()
    link.symlink_to(real, target_is_directory=True)
    root = package_new_tree(TreeSettings(out=str(link), system="s", submitter="o", division="open",
                                         performance_runs=(str(perf),), accuracy_runs=(str(acc),),
                                         allow_noncompliant=True))
    assert root == link / "open" / "o" and link.is_symlink()
    assert (real / "open" / "o" / "systems" / "s.json").is_file()
    assert target != "holding-a-tree" or (real / "closed" / "other" / "keep.txt").read_text() == "x"
    assert [p.name for p in link.parent.iterdir()] == ["out"] and [p.name for p in real.parent.iterdir()] == ["real"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(real.stat().st_mode) == (0o777 & ~umask if target == "missing" else 0o750)


def _offline_server_runs(base):
    perf = [make_run(base / s, "perf", "performance", scenario=s) for s in ("Offline", "Server")]
    acc = [make_run(base / s, "acc", "accuracy", scenario=s) for s in ("Offline", "Server")]
    return perf, acc


def test_package_refuses_fill_in_placeholders_naming_each_field(tmp_path):
    """Before: a compliant tree was written with 16 FILL-IN fields in systems/<system>.json (the v6.1 checker
    refuses only a FILL-IN status)."""
    import json

    from test_compliance import write_system_desc

    from sut.submission.tree import FILL_IN, TreeSettings, package_tree

    perf, acc = _offline_server_runs(tmp_path / "runs")
    kw = dict(system="s", submitter="o", division="open", performance_runs=tuple(map(str, perf)),
              accuracy_runs=tuple(map(str, acc)))
    from sut.errors import ComplianceError

    with pytest.raises(ComplianceError, match="field 'status' is still FILL-IN") as ei:  # the template alone
        package_tree(TreeSettings(out=str(tmp_path / "none"), **kw))
    assert str(ei.value).count("is still FILL-IN (--system-json FILE gives it)") >= 16
    partial = write_system_desc(tmp_path / "partial.json", cooling=f"{FILL_IN}: cooling")
    del_field = json.loads(partial.read_text())
    del del_field["host_storage_type"], del_field["status"]
    partial.write_text(json.dumps(del_field))

    with pytest.raises(ComplianceError) as ei:
        package_tree(TreeSettings(out=str(tmp_path / "sub"), system_desc=str(partial), **kw))
    lines = str(ei.value).splitlines()[1:]
    assert sorted(ln.strip() for ln in lines) == sorted(
        f"systems/s.json: field {k!r} is still FILL-IN (--system-json FILE gives it)"
        for k in ("status", "host_storage_type", "cooling"))
    assert not (tmp_path / "sub").exists()
    rehearsal = package_tree(TreeSettings(out=str(tmp_path / "reh"), system_desc=str(partial),
                                          allow_noncompliant=True, **kw))
    note = (rehearsal / "NOT-COMPLIANT.txt").read_text()
    assert "field 'cooling' is still FILL-IN" in note and "field 'status' is still FILL-IN" in note
    full = package_tree(TreeSettings(out=str(tmp_path / "full"), system_desc=str(write_system_desc(tmp_path / "f.json")),
                                     **kw))
    assert not (full / "NOT-COMPLIANT.txt").exists()
    assert FILL_IN not in (full / "systems" / "s.json").read_text()


@pytest.mark.parametrize("content, why", [
    ("[1]", "must be a JSON object"), ('{"cooling": {"a": 1}}', "field 'cooling' must be a plain value"),
    ('{"submitter": "other"}', "field 'submitter' is 'other', the command's is 'o'"), ("{", "malformed JSON"),
    ('{"status": 5}', "field 'status' is 5, the checker takes"), ('{"status": "soon"}', "field 'status' is 'soon'"),
    ('{"acelerator_model_name": "H100"}', "field 'acelerator_model_name' is not one the checker reads; did you mean "
     "'accelerator_model_name'?"),
    ('{"host_memory_capacity": NaN}', "field 'host_memory_capacity' must be a finite number, got nan"),
    ('{"host_memory_capacity": 1e999}', "field 'host_memory_capacity' must be a finite number, got inf"),
    ('{"host_storage_capacity": -Infinity}', "field 'host_storage_capacity' must be a finite number, got -inf"),
])
def test_package_refuses_a_bad_system_json_with_exit_2_before_writing(tmp_path, content, why):
    perf, acc = _offline_server_runs(tmp_path / "runs")
    desc = tmp_path / "d.json"
    desc.write_text(content)
    r = subprocess.run([sys.executable, "-m", "sut", "package", "--out", str(tmp_path / "sub"), "--system", "s",
                        "--submitter", "o", "--division", "open", "--system-json", str(desc),
                        "--performance", *map(str, perf), "--accuracy", *map(str, acc)],
                       env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--system-json {desc}: {why}" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "sub").exists()


def test_package_refuses_an_empty_out_before_anything(tmp_path, monkeypatch):
    """Before: --out '' laid the tree out in the current folder."""
    from sut.submission.tree import TreeSettings, package_new_tree

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--out '': an empty path; name the submission tree's root folder"):
        package_new_tree(TreeSettings(out="", system="s", submitter="o", performance_runs=("p",), accuracy_runs=("a",)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file of at most 1,048,576 bytes"),
                                       ("device", "not a regular file of at most"), ("folder", "is a folder")])
def test_a_system_json_that_is_no_regular_file_is_refused_unread(tmp_path, kind, why):
    """Before: a FIFO blocked package for ever and /dev/zero was read until the OOM killer came."""
    from sut.submission.tree import TreeSettings, read_system_desc

    path = {"fifo": tmp_path / "fifo", "device": "/dev/zero", "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ValueError, match=f"--system-json {path}: {why}"):
        read_system_desc(TreeSettings(out=str(tmp_path / "sub"), system="s", submitter="o", performance_runs=("p",),
                                      accuracy_runs=("a",), system_desc=str(path)))


def test_system_json_keeps_a_field_of_its_own_and_a_power_field(tmp_path, caplog):
    from sut.submission.tree import TreeSettings, read_system_desc
    desc = tmp_path / "d.json"
    desc.write_text('{"power_supply_details": "2x 3 kW", "lab_rack": "B7"}')
    ts = TreeSettings(out=str(tmp_path / "sub"), system="s", submitter="o", division="open", system_desc=str(desc),
                      performance_runs=("p",), accuracy_runs=("a",))
    with caplog.at_level("WARNING"):
        got = read_system_desc(ts)
    assert got == {"power_supply_details": "2x 3 kW", "lab_rack": "B7"}
    warned = [r.getMessage() for r in caplog.records]
    assert any("'lab_rack' is not one the v6.1 checker reads" in m for m in warned), warned
    assert not any("power_supply_details" in m for m in warned), warned


@pytest.mark.parametrize("url, reachable", [
    ("https://github.com/org/harness.git", True), ("ssh://git@host/org/harness", True),
    ("git@github.com:org/harness.git", True), ("host:org/harness", True),
    ("/work/main", False), ("../harness", False), ("file:///work/main", False), ("./a:b", False),
    ("C:\\src\\harness", False), ("harness", False)])
def test_a_remote_is_a_place_to_fetch_from_only_when_it_is_a_url_or_host_path(url, reachable):
    from sut.submission.tree import is_reachable_remote

    assert is_reachable_remote(url) is reachable


def test_src_readme_does_not_publish_a_local_clones_path_as_its_repository(tmp_path, caplog):
    """A new user's find: src/README.md said `repository: /work/main` (the clone's origin, a folder on that
    machine) without a word; now a FILL-IN note and a warning at package time, and a URL is kept."""
    from sut.submission.tree import write_src

    repo = tmp_path / "repo"
    repo.mkdir()
    for cmd in (["init", "-q"],
                ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    runs = [("Offline", "performance", {"command": "python -m sut run --mode performance"})]
    for remote, shown in ((None, "the checkout has no git remote origin"),
                          ("/work/main", "the git remote origin is /work/main, a local path, not a URL")):
        if remote:
            subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", remote], check=True)
        caplog.clear()
        with caplog.at_level("WARNING", logger="sut.submission.tree"):
            text = (write_src(tmp_path / "src", runs, repo) / "README.md").read_text()
        assert f"- repository: FILL-IN: URL where reviewers can get this commit ({shown})\n" in text
        assert [r.getMessage() for r in caplog.records] == [
            f"src/README.md: 'repository' is FILL-IN ({shown}): replace it with the URL where reviewers can get this "
            "commit before submitting"]
    url = "https://github.com/org/harness.git"
    subprocess.run(["git", "-C", str(repo), "remote", "set-url", "origin", url], check=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sut.submission.tree"):
        text = (write_src(tmp_path / "src", runs, repo) / "README.md").read_text()
    assert f"- repository: {url}\n" in text and "FILL-IN" not in text and not caplog.records


def test_the_cpu_systems_file_of_the_submission_page_leaves_nothing_to_fill_in(tmp_path):
    """docs/submission.md's my_system.json for a CPU rehearsal: every field the template leaves FILL-IN on a CPU
    run is given, and accelerators_per_node is the text "0" (the checker reads the number 0 as empty)."""
    import json
    import re

    from sut.submission.tree import TreeSettings, read_system_desc, system_desc_problems, system_json

    page = (REPO / "docs" / "submission.md").read_text()
    block = re.search(r"cat > my_system\.json <<'EOF'\n(.*?)\nEOF\n", page, re.S)
    assert block, "no my_system.json example in docs/submission.md"
    desc = tmp_path / "my_system.json"
    desc.write_text(block.group(1))
    ts = TreeSettings(out=str(tmp_path / "sub"), system="1xCPU_vllm", submitter="ORG", performance_runs=("p",),
                      accuracy_runs=("a",), allow_noncompliant=True, system_desc=str(desc))
    cpu_run = {"devices": [{"kind": "cpu"}], "versions": {"vllm": "0.32.0"}, "sut": "vllm",
               "host_info": {"os": "Linux", "cpu": "a CPU", "cpu_count": 2}}
    template = system_json(ts, cpu_run)
    assert template["accelerators_per_node"] == 0  # what the checker calls empty
    system = system_json(ts, cpu_run, read_system_desc(ts))
    assert system_desc_problems("1xCPU_vllm", system) == []
    assert system["accelerators_per_node"] == "0" and system["status"] == "available"
    assert set(json.loads(block.group(1))) == {k for k, v in template.items() if "FILL-IN" in str(v)} | {
        "accelerators_per_node"}  # the example gives those fields and no other
