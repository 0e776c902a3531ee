"""``python -m sut package --allow-noncompliant`` (the command the demo and quickstart.sh print) on
dev runs: the rehearsal tree holds exactly one NOT-COMPLIANT.txt, with every reason."""

import subprocess
import sys

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
    lines = notes[0].read_text().splitlines()
    assert lines[0] == "These runs are not compliant; this tree is a rehearsal:"
    assert f"- Offline: performance run: {RUN_REASON}" in lines  # the runs' reasons, named by scenario ...
    assert any(ln.startswith("- Offline: accuracy run: the accuracy gate did not pass") for ln in lines)
    assert any("(one of) Interactive or Server" in ln for ln in lines)  # ... and the tree's own
    assert not any("audit config" in ln for ln in lines)  # a TEST06 run's audit config is no problem
    assert (tree / "results" / "1xCPU_tiny_demo" / "llama3.1-8b" / "Offline" / "TEST06").is_dir()


def test_compliant_tree_has_no_note(tmp_path):
    base = tmp_path / "runs"
    perf = [make_run(base / s, "perf", "performance", scenario=s, model_key=k)
            for s, k in (("Offline", "llama3_1-8b"), ("Server", "llama3_1-8b"))]
    acc = [make_run(base / s, "acc", "accuracy", scenario=s) for s in ("Offline", "Server")]
    from sut.package_tree import TreeSettings, package_tree

    root = package_tree(TreeSettings(out=str(tmp_path / "sub"), system="s", submitter="o", division="open",
                                     performance_runs=tuple(map(str, perf)), accuracy_runs=tuple(map(str, acc)),
                                     allow_noncompliant=True))
    assert not list((tmp_path / "sub").rglob("NOT-COMPLIANT.txt"))
    assert {p.name for p in (root / "results" / "s" / "llama3.1-8b").iterdir()} == {"Offline", "Server"}
