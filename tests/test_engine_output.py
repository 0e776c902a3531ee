"""Where vLLM's own output goes: ``RUN/engine-N.log``, not the console (unless ``--verbose``); an engine
that dies still shows why on the console; bad engine input exits 2 before any run folder exists.

The fast tests run the real engine worker (``sut.engine.worker.worker_main``: redirection, start-up,
read-back, failure reporting) in real spawned processes, with a stand-in ``vllm``/``torch`` package
put first on the worker's ``sys.path``. The stand-in writes the way vLLM does: Python logging-style
lines on stdout, a traceback on stderr, a C-level write to file descriptor 2 and a child process
that prints, so each path of the redirection is exercised. The slow test runs the real vLLM.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import vllm_standin
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, TINY_MODEL, sut_env

from sut.engine import EnginePool, EngineSettings, GenerationSettings, kv_cache_capacity, log_tail
from sut.errors import EngineError

FAKE_VLLM = '''
import os, subprocess, sys, types
from vllm.sampling_params import SamplingParams  # noqa: F401 (the worker imports it from here)

__version__ = "0.32.0+standin"


class LLM:
    def __init__(self, **kw):
        mode = os.environ.get("STANDIN_VLLM_MODE", "ok")
        print("INFO standin-vllm non-default args:", sorted(kw), flush=True)
        print("WARNING Chat template warmup failed\\nTraceback (most recent call last):\\n"
              "ValueError: Tokenizer not available when `skip_tokenizer_init=True`", file=sys.stderr, flush=True)
        os.write(2, b"[W utils.cpp:68] Warning: NUMA binding (C-level stderr)\\n")
        subprocess.run([sys.executable, "-c", "print('EngineCore child process says hello', flush=True)"])
        if mode == "crash":
            os.write(2, b"standin: CUDA error: out of memory\\n")
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("Engine core initialization failed. See root cause above.")
        ns = types.SimpleNamespace
        cfg = ns(model_config=ns(model=kw["model"], dtype="float32", max_model_len=kw["max_model_len"],
                                 quantization=None, enforce_eager=True, seed=0),
                 cache_config=ns(gpu_memory_utilization=None, cache_dtype="auto", block_size=128,
                                 enable_prefix_caching=False, num_gpu_blocks=4096, kv_cache_size_tokens=506538),
                 scheduler_config=ns(max_num_seqs=256, max_num_batched_tokens=4096),
                 load_config=ns(load_format="dummy"))
        self.llm_engine = ns(vllm_config=cfg, has_unfinished_requests=lambda: False)
'''
VLLM_LINES = ("Chat template warmup failed", "NUMA binding (C-level stderr)", "EngineCore child process says hello",
              "standin-vllm non-default args")


@pytest.fixture
def standin_vllm(tmp_path, monkeypatch):
    """Put a stand-in ``vllm`` and ``torch`` first on sys.path (spawned workers inherit it)."""
    root = tmp_path / "standin"
    (root / "vllm").mkdir(parents=True)
    (root / "torch").mkdir()
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (root / "vllm" / "sampling_params.py").write_text(textwrap.dedent(vllm_standin.SAMPLING))
    (root / "torch" / "__init__.py").write_text('__version__ = "0.32.0+standin"\n')
    monkeypatch.syspath_prepend(str(root))

    def mode(m: str) -> None:
        monkeypatch.setenv("STANDIN_VLLM_MODE", m)

    mode("ok")
    return mode


def _pool() -> EnginePool:
    es = EngineSettings(model=str(TINY_MODEL), dtype="float32", load_format="dummy", enforce_eager=True, device="cpu",
                        max_model_len=512)
    return EnginePool(es, GenerationSettings(), start_timeout_s=120)


@pytest.mark.timeout(120)
def test_engine_output_goes_to_the_log_and_not_to_the_console(standin_vllm, tmp_path, capfd):
    pool = _pool()
    try:
        (info,) = pool.start(log_dir=tmp_path)
    finally:
        pool.shutdown()
    out, err = capfd.readouterr()
    log = (tmp_path / "engine-0.log").read_text()
    for line in VLLM_LINES:
        assert line in log, line
        assert line not in out + err, line
    assert log.startswith("engine 0 (cpu:")
    assert info["kv_cache"] == {"blocks": 4096, "block_size": 128, "tokens": 524288, "tokens_from": "blocks",
                                 "vllm_tokens": 506538, "bytes_per_block": None}  # the stand-in config gives no model shape


@pytest.mark.timeout(120)
def test_without_a_log_folder_engine_output_reaches_the_console(standin_vllm, tmp_path, capfd):
    pool = _pool()
    try:
        pool.start(log_dir=None)
    finally:
        pool.shutdown()
    out, err = capfd.readouterr()
    for line in VLLM_LINES:
        assert line in out + err, line
    assert not list(tmp_path.glob("engine-*.log"))


@pytest.mark.timeout(120)
def test_an_engine_that_dies_at_start_shows_its_last_log_lines(standin_vllm, tmp_path):
    standin_vllm("crash")
    pool = _pool()
    with pytest.raises(EngineError) as ei:
        pool.start(log_dir=tmp_path)
    msg = str(ei.value)
    assert msg.startswith("engine 0 exited during start-up (code 3)")
    assert f"--- last lines of {tmp_path / 'engine-0.log'} ---" in msg
    assert "standin: CUDA error: out of memory" in msg  # the cause, seen only in the engine's own output
    assert "engine 0 exited during start-up (code 3)" in (tmp_path / "engine-0.log").read_text()


@pytest.mark.timeout(120)
def test_an_engine_exception_keeps_its_traceback_last_after_the_log_lines(standin_vllm, tmp_path):
    standin_vllm("raise")
    pool = _pool()
    with pytest.raises(EngineError) as ei:
        pool.start(log_dir=tmp_path)
    msg = str(ei.value)
    first, rest = msg.split("\n", 1)
    assert first == "engine 0 failed to start:"
    assert rest.index("EngineCore child process says hello") < rest.index("--- end of engine-0.log ---") \
        < rest.rindex("Traceback (most recent call last)")
    assert msg.rstrip().endswith("RuntimeError: Engine core initialization failed. See root cause above.")
    log = (tmp_path / "engine-0.log").read_text()
    assert "RuntimeError: Engine core initialization failed" in log  # the log holds the whole story


def test_kv_cache_capacity_is_blocks_times_block_size_with_vllms_figure_beside():
    """vLLM's kv_cache_size_tokens is concurrency x max_model_len (below the blocks' tokens); the cache holds
    blocks x block size, so that is the capacity; vLLM's figure only where the blocks are unknown."""
    from types import SimpleNamespace as NS

    assert kv_cache_capacity(NS(num_gpu_blocks=4096, block_size=128, kv_cache_size_tokens=506538)) == \
        {"blocks": 4096, "block_size": 128, "tokens": 524288, "tokens_from": "blocks", "vllm_tokens": 506538}
    assert kv_cache_capacity(NS(num_gpu_blocks=2808, block_size=16)) == \
        {"blocks": 2808, "block_size": 16, "tokens": 44928, "tokens_from": "blocks", "vllm_tokens": None}
    assert kv_cache_capacity(NS(block_size=16, kv_cache_size_tokens=900)) == \
        {"blocks": None, "block_size": 16, "tokens": 900, "tokens_from": "vllm", "vllm_tokens": 900}
    assert kv_cache_capacity(NS(block_size=16)) == \
        {"blocks": None, "block_size": 16, "tokens": None, "tokens_from": None, "vllm_tokens": None}


def test_log_tail_keeps_the_last_lines(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)) + "\n\n")
    assert log_tail(p, lines=3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "missing.log") == "" and log_tail(None) == ""


# ------------------------------------------------------------------------------------- the CLIs
def test_verbose_flag_of_sut_run_sends_engine_output_to_the_console():
    from sut.cli import build_parser, settings_from_args

    base = ["run", "--dataset", "d.json", "--model", "m"]
    for argv, console in ((base, False), (base + ["--verbose"], True), (["-v"] + base, True), (base + ["-v"], True)):
        rs, *_ = settings_from_args(build_parser().parse_args(argv))
        assert rs.engine_console is console, argv


@pytest.mark.parametrize("cli", ["run", "locality"])
def test_device_cuda_without_a_gpu_exits_2_and_leaves_no_run_folder(cli, tmp_path):
    out_dir = tmp_path / "results"
    if cli == "run":
        cmd = [sys.executable, "-m", "sut", "run", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
               "--dataset", str(tmp_path / "not-needed.json"), "--output-dir", str(out_dir), "--device", "cuda"]
    else:
        cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--documents", "2",
               "--doc-tokens", "300", "--output-dir", str(out_dir), "--device", "cuda"]
    env = dict(sut_env(), CUDA_VISIBLE_DEVICES="")  # no GPU visible, on any host
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "device=cuda but no GPU is visible" in res.stderr
    assert "Traceback" not in res.stderr and "starting" not in res.stderr
    assert not out_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sut_run_keeps_vllm_output_in_the_run_folder(tmp_path, synthetic_small):
    """The real vLLM on CPU: its warnings and the 'Chat template warmup failed' traceback are in
    RUN/engine-0.log only; the console keeps the harness's own lines."""
    data, _ = synthetic_small
    cmd = [sys.executable, "-m", "sut", "run", "--no-progress", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS,
           "--dataset", str(data), "--mode", "accuracy", "--max-samples", "4", "--no-accuracy-gate",
           "--output-dir", str(tmp_path)]
    res = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    log = (run / "engine-0.log").read_text()
    assert "Chat template warmup failed" in log and "Tokenizer not available" in log
    console = res.stdout + res.stderr
    assert "Chat template warmup failed" not in console and "Traceback" not in console
    assert "WARNING" not in console.replace("WARNING sut.run.harness: THIS RUN IS NOT COMPLIANT", "")
    rec = json.loads((run / "run.json").read_text())
    kv = rec["engines"][0]["kv_cache"]
    assert kv["tokens"] > 0 and kv["blocks"] > 0 and kv["block_size"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kv_cache_given_in_bytes_per_block_gives_exactly_those_blocks():
    """The read-back's bytes per block is vLLM's own: an engine given N x that many bytes (no block count)
    allocates exactly N blocks; two such engines start together (``sut.locality.kv_pin`` relies on both)."""
    es = EngineSettings(model=str(TINY_MODEL), device="cpu", load_format="dummy", dtype="float32", enforce_eager=True,
                        max_model_len=512)
    pool = EnginePool(es, GenerationSettings())
    try:
        (info,) = pool.start()
    finally:
        pool.shutdown()
    per_block = info["kv_cache"]["bytes_per_block"]
    assert per_block and per_block > 0 and info["kv_cache"]["blocks"] > 37
    given = EngineSettings(**{**es.__dict__, "engines_per_device": 2, "kv_cache_memory_bytes": 37 * per_block})
    pool = EnginePool(given, GenerationSettings())
    assert len(pool._waves()) == 1
    try:
        infos = pool.start()
    finally:
        pool.shutdown()
    assert [(i["kv_cache"]["blocks"], i["kv_cache"]["bytes_per_block"]) for i in infos] == [(37, per_block)] * 2
