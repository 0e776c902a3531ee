"""scripts/bench/cpu_accounting.py: which category a process's CPU counts under in bench_flame's table."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import cpu_accounting  # noqa: E402


@pytest.mark.parametrize("title, category", [
    ("VLLM::EngineCore", "engine"),  # vLLM's own engine-core process (the standalone SUT's engine: was "other")
    ("sut-engine-0 (cpu:0)", "engine"),
    ("python -m sut.flame.serve --x", "flame service"),
    ("python -m sut run --sut vllm", "harness + client"),
    ("sleep 30", "other"),
])
def test_a_process_counts_under_its_category_by_its_title(title, category):
    code = ("import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); "
            "print('ready', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code, title], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert cpu_accounting._category(p.pid) == category
    finally:
        p.kill()
        p.wait()


def test_the_window_counts_own_cpu_by_the_category_seen_at_its_start():
    """A recheck's finds: the standalone engine exits as LoadGen's window ends (its command line already empty, so
    it counted as "other"), and a child reaped inside the window added its whole life to its parent (120 % of
    the machine). Categories now come from the window's start and each process counts its own utime + stime."""
    import os

    me, engine, manager = os.getpid(), 10**7 + 1, 10**7 + 2
    before = {me: (1, 0.0, 0.0), engine: (me, 5.0, 5.0), manager: (me, 1.0, 1.0)}
    after = {me: (1, 0.0, 0.0), engine: (me, 14.0, 14.0), manager: (me, 31.0, 1.5)}  # +29 s reaped child time
    cats = {engine: "engine", manager: "flame control plane"}
    share = cpu_accounting.window_cpu(before, after, 10.0, cats)
    n = os.cpu_count() or 1
    assert share == {"engine": round(9.0 / (10 * n), 4), "flame control plane": round(0.5 / (10 * n), 4)}
    assert set(cpu_accounting.categories({me: (1, 0, 0)})) == set()  # the script itself is not counted


def test_cpu_times_of_given_pids_reads_only_those_still_there():
    import os

    gone = 2**22 + 12345  # above Linux's pid_max default: no such process
    assert set(cpu_accounting.cpu_times([os.getpid(), gone])) == {os.getpid()}
    assert os.getpid() in cpu_accounting.cpu_times()
