"""Prefix caching as a real vLLM engine holds it, read back and judged without starting an engine.

``vllm.LLM(**kwargs)`` builds its engine from ``EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)``
and keeps that ``VllmConfig`` as ``llm.llm_engine.vllm_config``, which is what ``sut.engine.readback.read_back``
reads. Here the installed vLLM builds that config for the tiny model (no weights loaded, no engine core), in a
child process (importing vLLM takes ~20 s and stays out of the test process); the read-back records go through
the guard every LoadGen SUT runs at start (``TransportSUT.start`` -> ``sut.core.guard.check_replicas``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, TINY_MODEL, sut_env
from test_core import FakeSUT, _ctx

pytestmark = pytest.mark.timeout(300)

#: Three engines of the tiny model: prefix caching asked off (the harness's default), asked on, and left to
#: vLLM's own default (kwargs without ``enable_prefix_caching``: on for a decoder model in vLLM V1).
READ_BACK = r"""
import json, sys, types
import torch, vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
from sut.engine import EngineSettings, plan_engines, read_back

out = {}
for case, asked in (("asked_off", False), ("asked_on", True), ("vllm_default", None)):
    es = EngineSettings(model=sys.argv[1], dtype="float32", load_format="dummy", enforce_eager=True, device="cpu",
                        max_model_len=1024, enable_prefix_caching=bool(asked))
    slot = plan_engines(es)[0]
    kwargs = es.vllm_kwargs(slot.gpu_share)
    if asked is None:
        del kwargs["enable_prefix_caching"]
    cfg = EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=cfg))
    out[case] = {"config": cfg.cache_config.enable_prefix_caching, "block_size": cfg.cache_config.block_size,
                 "info": read_back(llm, vllm, torch, slot)}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def read_backs(tmp_path_factory):
    """``{case: {"config": vLLM's own enable_prefix_caching, "block_size", "info": the read-back record}}``."""
    path = tmp_path_factory.mktemp("readback") / "read_backs.json"
    r = subprocess.run([sys.executable, "-c", READ_BACK, str(TINY_MODEL), str(path)], cwd=REPO, env=sut_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return json.loads(path.read_text())


def test_read_back_reports_the_prefix_caching_of_vllms_own_config(read_backs):
    assert {c: v["config"] for c, v in read_backs.items()} == {"asked_off": False, "asked_on": True,
                                                               "vllm_default": True}
    for case, v in read_backs.items():
        info = v["info"]
        assert info["enable_prefix_caching"] is v["config"], case
        assert info["engine_args"]["max_model_len"] == 1024 and info["engine_args"]["block_size"] == v["block_size"]
        assert info["engine_args"]["model"] == str(TINY_MODEL) and info["device"]["kind"] == "cpu"


@pytest.mark.parametrize("case", ["vllm_default", "asked_on"])
def test_an_engine_that_holds_prefix_caching_on_is_refused_at_start(read_backs, case):
    """The settings asked for it off (so the check before start passes), the engine holds it on: the run stops
    before LoadGen starts, naming the replica."""
    from sut.errors import RunFailed

    sut = FakeSUT(_ctx(engine_info=read_backs[case]["info"]))
    try:
        with pytest.raises(RunFailed, match="replica 0 reports enable_prefix_caching=True; refusing to run"):
            sut.start()
    finally:
        sut.stop()


def test_an_engine_that_holds_prefix_caching_off_starts(read_backs):
    sut = FakeSUT(_ctx(engine_info=read_backs["asked_off"]["info"]))
    try:
        rec = sut.start()
        assert [e["enable_prefix_caching"] for e in rec["engines"]] == [False, False] and sut.unconfirmed == []
    finally:
        sut.stop()
