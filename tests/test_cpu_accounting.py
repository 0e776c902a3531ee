"""scripts/cpu_accounting.py: which category a process's CPU counts under in bench_flame's table."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
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
