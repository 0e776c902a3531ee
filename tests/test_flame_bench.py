"""scripts/bench/bench_flame.py without running a benchmark: which control plane it starts, and the CPU
accounting of other users' jobs."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, flame_bin_dir

spec = importlib.util.spec_from_file_location("bench_flame", REPO / "scripts" / "bench" / "bench_flame.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _args(**kw):
    return SimpleNamespace(**dict(dict(flame_endpoint=None, flame_bin=None, control_plane=None), **kw))


def test_control_plane_choice(tmp_path):
    assert bench.resolve_control_plane(_args(flame_endpoint="http://h:8080")) == ("external", None)
    assert bench.resolve_control_plane(_args(flame_bin=str(tmp_path))) == ("standin", None)  # no binaries there
    with pytest.raises(SystemExit, match="needs flame-session-manager"):
        bench.resolve_control_plane(_args(flame_bin=str(tmp_path), control_plane="real"))
    found = flame_bin_dir()
    if found is not None:  # the default is the real control plane where its binaries are
        assert bench.resolve_control_plane(_args(flame_bin=str(found))) == ("real", found)
        assert bench.resolve_control_plane(_args(flame_bin=str(found), control_plane="standin")) == ("standin", found)


def test_foreign_cpu_counts_a_reaped_child_only_inside_the_window():
    me = os.getpid()
    # another user's job 10 reaps its child 11, which had used 500 s before the window and 2 s inside it
    before = {me: (1, 0.0), 10: (1, 100.0), 11: (10, 500.0)}
    after = {me: (1, 0.0), 10: (1, 100.0 + 502.0 + 1.0)}
    assert bench.foreign_cpu_s(before, after) == pytest.approx(3.0)
    # our own processes never count
    assert bench.foreign_cpu_s({me: (1, 0.0)}, {me: (1, 0.0), 20: (me, 50.0)}) == 0.0


def test_main_rotates_the_configurations_and_writes_the_summary(tmp_path, monkeypatch, capsys):
    """main() end to end with the runs faked: flags of each run, rotated order, means, ratios, target."""
    calls = []
    tokens = {"standalone": 100.0, "flame32": 99.6, "flame64": 99.0}

    def fake_run_one(name, sut_args, common, out_dir, log_dir):
        calls.append((name, sut_args, common))
        config = name.split("-", 1)[1]
        return {"name": name, "rc": 0, "process_s": 1.0, "tokens_per_s": tokens[config] + int(name[1]),
                "samples": 8, "validity": "VALID", "foreign_cpu_share": 0.5 if name == "r1-flame64" else 0.0,
                "steal_share": 0.0, "loadgen_window_cpu_share": {"engine": 0.5}}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench.time, "strftime", lambda fmt: "stamp")
    assert bench.main(["--flame-endpoint", "http://fsm:8080", "--dataset", "d.json", "--out", str(tmp_path),
                       "--idle-wait-s", "0", "--rounds", "2", "--target-qps", "3", "--ignore-eos",
                       "--flame-option", "executors_per_engine=9", "--foreign-cpu-max", "0.1"]) == 0
    assert [c[0] for c in calls] == ["r0-standalone", "r0-flame32", "r0-flame64",
                                     "r1-flame32", "r1-flame64", "r1-standalone"]
    common = calls[0][2]
    assert common[:4] == ["--model", str(REPO / "sut" / "models" / "tiny-llama3"), "--load-format", "dummy"]
    for flag in (["--dataset", "d.json"], ["--dtype", "float32"], ["--max-model-len", "4096"], ["--target-qps", "3.0"]):
        assert common[common.index(flag[0]) + 1] == flag[1]
    assert "--enforce-eager" in common and "--benchmark-ignore-eos" in common
    flame32 = calls[1][1]
    assert flame32[:3] == ["--sut", "flame", "--batch-size"] and "http://fsm:8080" in flame32
    assert flame32[-2:] == ["--option", "executors_per_engine=9"]
    summary = json.loads((tmp_path / "stamp" / "summary.json").read_text())
    assert summary["control_plane"] == "external" and summary["endpoint"] == "http://fsm:8080"
    assert len(summary["runs"]) == 6  # every run is recorded, the one that shared the CPU too ...
    cfg = summary["configs"]
    assert cfg["flame64"]["runs"] == 1 and cfg["standalone"]["runs"] == 2  # ... but left out of the means
    assert cfg["standalone"]["mean_tokens_per_s"] == pytest.approx(100.5)
    assert cfg["flame32"]["ratio_to_standalone"] == pytest.approx(100.1 / 100.5)
    assert cfg["flame64"]["ratio_to_standalone"] == pytest.approx(99.0 / 100.5)
    out = capsys.readouterr().out
    assert "1 run(s) shared the CPU" in out and "NOT MET" in out
