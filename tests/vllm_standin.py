"""A stand-in ``vllm`` / ``torch`` package for fast tests of the real engine worker (never imported by
the product).

``install(root, monkeypatch)`` writes the packages under ``root`` and puts ``root`` first on
``sys.path`` (spawned engine workers inherit it). The stand-in ``LLM`` builds an ``llm_engine``
with vLLM's V1 surface that the worker uses: ``add_request(rid, {"prompt_token_ids": [...]},
params)``, ``step()``, ``has_unfinished_requests()``, ``reset_prefix_cache()`` and ``vllm_config``.
Each step sleeps ``STANDIN_STEP_S`` (default 0.005 s) and gives every running request one more
token, ``(prompt[0] + k) % 1000 + 10`` for k = 0..max_tokens-1, after one prefill step with no token;
outputs follow ``params.output_kind`` (``FINAL_ONLY``: finished requests only, whole sequence;
``DELTA``: every running request, the new ids). ``num_cached_tokens``: 16 when a prompt with the
same first 16 ids was added before (and the cache was not reset), else 0. ``LLM.__init__`` starts a
child process (``sleep``) in the worker's process group, as vLLM's own children are, and writes its
pid to ``$STANDIN_CHILD_PIDS`` (one line per engine) so tests can check that it is ended too.
``$STANDIN_SHUTDOWN_S`` (default 0): seconds that releasing the ``LLM`` and the interpreter's exit
each take, as vLLM's shutdown (its full ``gc.collect``) and teardown do on CPU. ``$STANDIN_START_S``
(default 0): seconds ``LLM.__init__`` then takes, deaf to SIGTERM, as building a real engine is (minutes on
a GPU, in native code that Python's signal handlers do not interrupt). Every output carries the request's
``prompt_token_ids``, as vLLM's do. ``$STANDIN_FAULT=drop`` (default none): the second request to finish is
removed without any output (a request the engine loses).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

VLLM = '''
import atexit, os, signal, subprocess, time, types, weakref
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401

__version__ = "0.32.0+standin"
ns = types.SimpleNamespace


class _Engine:
    def __init__(self, kw):
        self.cfg = ns(model_config=ns(model=kw["model"], dtype="float32", max_model_len=kw["max_model_len"],
                                      quantization=None, enforce_eager=True, seed=0),
                      cache_config=ns(gpu_memory_utilization=None, cache_dtype="auto", block_size=16,
                                      enable_prefix_caching=kw["enable_prefix_caching"], num_gpu_blocks=64),
                      scheduler_config=ns(max_num_seqs=kw["max_num_seqs"], max_num_batched_tokens=4096),
                      load_config=ns(load_format="dummy"))
        self.vllm_config = self.cfg
        self.running = {}
        self.seen = set()
        self.step_s = float(os.environ.get("STANDIN_STEP_S", "0.005"))
        self.fault, self.finished = os.environ.get("STANDIN_FAULT", ""), 0

    def add_request(self, rid, prompt, params):
        assert isinstance(rid, str)
        ids = list(prompt["prompt_token_ids"])
        key = tuple(ids[:16])
        cached = 16 if (key in self.seen and len(ids) >= 16) else 0
        self.seen.add(key)
        self.running[rid] = {"ids": ids, "params": params, "out": [], "cached": cached, "prefilled": False}

    def has_unfinished_requests(self):
        return bool(self.running)

    def reset_prefix_cache(self):
        self.seen.clear()
        return True

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.running.items()):
            new = []
            if r["prefilled"]:
                new = [(r["ids"][0] + len(r["out"])) % 1000 + 10]
                r["out"].extend(new)
            r["prefilled"] = True
            done = len(r["out"]) >= r["params"].max_tokens
            if done:
                del self.running[rid]
                self.finished += 1
                if self.finished == 2 and self.fault == "drop":
                    continue
            kind = r["params"].output_kind
            if kind == RequestOutputKind.FINAL_ONLY and not done:
                continue
            ids = list(r["out"]) if kind == RequestOutputKind.FINAL_ONLY else new
            outs.append(ns(request_id=rid, prompt_token_ids=r["ids"], outputs=[ns(token_ids=ids)], finished=done,
                           num_cached_tokens=r["cached"]))
        return outs


class LLM:
    def __init__(self, **kw):
        child = subprocess.Popen(["sleep", "600"])
        path = os.environ.get("STANDIN_CHILD_PIDS")
        if path:
            with open(path, "a") as fh:
                fh.write(f"{child.pid}\\n")
        start_s = float(os.environ.get("STANDIN_START_S", "0"))
        if start_s:  # building the engine: SIGTERM does not end it (nor run the worker's handler) meanwhile
            before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(start_s)
            signal.signal(signal.SIGTERM, before)
        self.llm_engine = _Engine(kw)
        slow = float(os.environ.get("STANDIN_SHUTDOWN_S", "0"))
        if slow:  # vLLM's engine shutdown when the LLM is released (a full gc.collect), the interpreter's teardown
            weakref.finalize(self, time.sleep, slow)
            atexit.register(time.sleep, slow)

    def generate(self, prompts, params, use_tqdm=False):
        return [ns(outputs=[ns(token_ids=[(p["prompt_token_ids"][0] + k) % 1000 + 10 for k in range(params.max_tokens)])],
                   prompt_token_ids=list(p["prompt_token_ids"]), num_cached_tokens=0) for p in prompts]
'''
SAMPLING = '''
import copy
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def clone(self):
        return copy.copy(self)
'''
INPUTS = '''
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": list(prompt_token_ids)}
'''


def install(root: Path, monkeypatch) -> Path:
    """Write the stand-in packages under ``root`` and put it first on ``sys.path``; returns ``root``."""
    (root / "vllm").mkdir(parents=True)
    (root / "torch").mkdir()
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(VLLM))
    (root / "vllm" / "sampling_params.py").write_text(textwrap.dedent(SAMPLING))
    (root / "vllm" / "inputs.py").write_text(textwrap.dedent(INPUTS))
    (root / "torch" / "__init__.py").write_text('__version__ = "0.32.0+standin"\n')
    monkeypatch.syspath_prepend(str(root))
    return root
