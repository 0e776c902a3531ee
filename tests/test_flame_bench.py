"""scripts/bench_flame.py without running a benchmark: which control plane it starts, and the CPU
accounting of other users' jobs."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, flame_bin_dir

spec = importlib.util.spec_from_file_location("bench_flame", REPO / "scripts" / "bench_flame.py")
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
