"""Shared fixtures: paths, the tiny model, small synthetic datasets, real-data skips."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_MODEL = REPO / "sut" / "models" / "tiny-llama3"
CPU_CONF = REPO / "loadgen_configs" / "cpu_tiny.user.conf"
TINY_ENGINE_ARGS = ["--model", str(TINY_MODEL), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
                    "--max-model-len", "4096"]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "realdata" in item.keywords and not SHARED_DATA.is_dir():
            item.add_marker(pytest.mark.skip(reason=f"{SHARED_DATA} is absent"))


@pytest.fixture
def write_json(tmp_path):
    def _w(obj, name="data.json"):
        p = tmp_path / name
        p.write_text(json.dumps(obj))
        return p

    return _w


@pytest.fixture(scope="session")
def synthetic_small(tmp_path_factory):
    """64-sample synthetic dataset (seed 0) and its word-level tokenizer folder."""
    from sut.synthetic import SyntheticSettings, write_dataset, write_tokenizer

    d = tmp_path_factory.mktemp("synthetic")
    write_dataset(d / "syn64.json", SyntheticSettings(samples=64, seed=0, median=300, max_len=1200))
    write_tokenizer(d / "tok")
    return d / "syn64.json", d / "tok"


def sut_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
