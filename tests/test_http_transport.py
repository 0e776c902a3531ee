"""The ``http`` transport and ``--sut vllm-http`` against a fake vLLM OpenAI server (``fake_vllm_server.py``).

Fast: no vLLM engine. The real ``vllm serve`` runs are in ``test_http_cpu.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env

from sut.core import guard
from sut.core.transport import TransportSpec, make_transport
from sut.core.transports import http_readback as readback
from sut.core.transports import http_servers as servers
from sut.core.transports.http_api import ReplyError
from sut.core.transports.http_options import HttpOptions
from sut.engine import EngineSettings, GenerationSettings
from sut.engine.handle import OOM_HINT
from sut.errors import InputError, ServerInputError, TransportError
from sut.http_sut import UNCONFIRMED_REASON, HttpSUT
from sut.messages import Request

pytestmark = pytest.mark.timeout(120)

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"
MODEL = str(TINY_MODEL)
EOS = (128001, 128008, 128009)


class Sink:
    """Records what the transport delivers, in order."""

    def __init__(self):
        self.events, self.fatal = [], []
        self.results: dict[int, tuple[int, object]] = {}
        self.firsts: dict[int, int] = {}
        self.cond = threading.Condition()

    def on_first(self, replica, firsts):
        with self.cond:
            for f in firsts:
                self.events.append(("first", f.rid))
                self.firsts[f.rid] = f.token_id

    def on_results(self, replica, results):
        with self.cond:
            for c in results:
                self.events.append(("done", c.rid))
                self.results[c.rid] = (replica, c)
            self.cond.notify_all()

    def on_fatal(self, event):
        with self.cond:
            self.fatal.append(event)
            self.cond.notify_all()

    def wait(self, what, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(what, timeout), f"timed out; fatal={self.fatal}, results={len(self.results)}"


def transport(options: HttpOptions, stream=False, gen=None, log_dir=None, **engine):
    es = EngineSettings(model=MODEL, max_model_len=4096, **engine)
    gen = gen or GenerationSettings(max_tokens=6, eos_token_ids=EOS)
    return make_transport("http", TransportSpec(engine=es, generation=gen, options=options, stream=stream,
                                                log_dir=log_dir))


def requests(n, start=0):
    return [Request(i, np.array([i, 7, 8, 9], dtype=np.int32)) for i in range(start, start + n)]


def answer(first: int, max_tokens: int = 6) -> list[int]:
    """What the fake server answers prompt ``[first, 7, 8, 9]`` (``requests``): an even sum (an even ``first``)
    stops at its EOS at position 3."""
    ids = [(first + k) % 1000 + 10 for k in range(max_tokens)]
    return ids[:3] + [128009] if first % 2 == 0 and max_tokens > 3 else ids


def stats_of(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/_stats", timeout=5) as r:
        return json.loads(r.read())


# -- options ---------------------------------------------------------------------------------------
def test_urls_option_takes_a_list_or_a_comma_string():
    assert HttpOptions(urls="http://a:1/, https://b:2/v1 ,").urls == ("http://a:1", "https://b:2")
    assert HttpOptions(urls=["http://a:1"]).urls == ("http://a:1",)
    assert HttpOptions().urls == ()
    for bad in ("ftp://a:1", "a:1", "http://"):
        with pytest.raises(ValueError, match="not an http"):
            HttpOptions(urls=bad)


def test_bad_options_are_input_errors_naming_the_option():
    with pytest.raises(InputError, match="max_inflight_per_replica must be >= 1"):
        HttpSUT.check_options({"max_inflight_per_replica": 0})
    with pytest.raises(InputError, match="not an http"):
        HttpSUT.check_options({"urls": "localhost:8000"})
    with pytest.raises(InputError, match="unknown .*batch_size"):
        HttpSUT.check_options({"batch_size": 4})


def test_serve_command_is_built_from_the_engine_settings(monkeypatch):
    # an in-process vLLM config (another test) sets this in os.environ; the servers' env starts from os.environ
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    es = EngineSettings(model="/m", dtype="bfloat16", max_model_len=3000, max_num_seqs=64, max_num_batched_tokens=8192,
                        long_prefill_token_threshold=512, enable_chunked_prefill=False, gpu_memory_utilization=0.9,
                        kv_cache_dtype="fp8", quantization="fp8", load_format="dummy", enforce_eager=True, seed=3)
    slot = servers.EngineSlot(0, "cuda", "1", gpu_share=2, env=(("CUDA_VISIBLE_DEVICES", "1"),))
    cmd = servers.serve_command(["vllm", "serve"], es, slot, 8123)
    text = " ".join(cmd)
    for part in ("--model /m", "--dtype bfloat16", "--max-model-len 3000", "--max-num-seqs 64",
                 "--max-num-batched-tokens 8192", "--long-prefill-token-threshold 512", "--no-enable-chunked-prefill",
                 "--gpu-memory-utilization 0.45", "--kv-cache-dtype fp8", "--quantization fp8", "--load-format dummy",
                 "--enforce-eager", "--seed 3", "--no-enable-prefix-caching", "--skip-tokenizer-init",
                 "--host 127.0.0.1", "--port 8123", "--enable-prompt-tokens-details"):
        assert part in text, part
    assert cmd[-1] == "--disable-log-stats"  # the engine of --sut vllm: vllm.LLM's disable_log_stats=True
    assert "--disable-log-stats" not in servers.serve_command(["vllm", "serve"], es, slot, 8123, log_stats=True)
    extra = servers.serve_command(["vllm", "serve"], es, slot, 8123, extra=("--max-num-partial-prefills", "2"))
    assert extra[-3:] == ["--disable-log-stats", "--max-num-partial-prefills", "2"]
    env = servers.server_env(servers.EngineSlot(0, "cpu", "0-1", env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                                                                       ("VLLM_CPU_OMP_THREADS_BIND", "0-1"))))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == str(servers.KEEP_ALIVE_S)


@pytest.mark.parametrize("args, flag", [
    ("--port 9000", "--port"), ("--host=0.0.0.0", "--host"), ("--model /other", "--model"),
    ("--enable-prefix-caching", "--enable-prefix-caching"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    ("--disable_log_stats", "--disable-log-stats")])
def test_server_args_that_the_harness_owns_are_input_errors_naming_the_flag(args, flag):
    with pytest.raises(InputError, match=f"server_args: {flag} is set by"):
        HttpSUT.check_options({"server_args": args})


@pytest.mark.parametrize("args, flag", [("--max_num_seqs 8", "--max-num-seqs"),
                                        ("--quantization=fp8", "--quantization"),
                                        ("--no-enable-chunked-prefill", "--no-enable-chunked-prefill"),
                                        ("--enable-prompt-tokens-details", "--enable-prompt-tokens-details")])
def test_server_args_giving_an_engine_setting_are_refused_before_the_run(args, flag):
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu", load_format="dummy")
    opts = HttpSUT.check_options({"server_args": f"--max-num-partial-prefills 2 {args}"})
    with pytest.raises(InputError, match=f"server_args: {flag} is set by the harness"):
        HttpSUT.preflight(opts, es)
    with pytest.raises(ServerInputError, match=f"server_args: {flag} is set by the harness"):
        transport(opts, device="cpu")
    ok = HttpSUT.check_options({"server_args": "--max-num-partial-prefills 2"})
    assert ok.server_args == ("--max-num-partial-prefills", "2")
    HttpSUT.preflight(ok, es)



@pytest.mark.parametrize("name", ["server_start_timeout_s", "health_interval_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1])
def test_server_timings_must_be_finite_and_positive(name, value):
    """inf passed: a server that hangs in its start was waited for for good, and the health monitor never ran."""
    with pytest.raises(InputError, match=f"{name} must be a finite number > 0, got {value}"):
        HttpSUT.check_options({name: value})


def test_more_connections_than_the_open_file_limit_are_refused_before_any_server(monkeypatch):
    """The client opens max_inflight_per_replica connections per server before LoadGen starts: more than ulimit -n
    allows failed on "Too many open files" after the servers had started (a huge value never ended). The soft limit
    is raised up to the hard one first, as `vllm serve` does for itself; beyond the hard limit the run is refused."""
    import resource

    limits, raised = [1024, 4096], []

    def setrlimit(which, new):
        raised.append(new)
        limits[0] = new[0]

    monkeypatch.setattr(resource, "getrlimit", lambda which: tuple(limits))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu", load_format="dummy")
    HttpSUT.preflight(HttpSUT.check_options({"max_inflight_per_replica": 768}), es)
    assert raised == []  # 768 + 256 fit the soft limit
    HttpSUT.preflight(HttpSUT.check_options({}), dataclasses.replace(es, max_num_seqs=512))
    assert raised == [(1024 + 256, 4096)]  # the default 2 x 512 connections: the soft limit raised
    with pytest.raises(InputError, match=r"3,841 connections per server \(--max-inflight-per-replica\) x 1 server\(s\) "
                                         r"\+ 256 other files is more than this process may open \(ulimit -n 1,280, "
                                         r"hard limit 4,096\)"):
        HttpSUT.preflight(HttpSUT.check_options({"max_inflight_per_replica": 3841}), es)
    with pytest.raises(InputError, match="ulimit -n"):
        HttpSUT.preflight(HttpSUT.check_options({"max_inflight_per_replica": 10**20}), es)


def test_the_harness_engine_loops_admission_interval_is_refused_for_servers():
    """--admit-every-steps is the in-process worker's loop (sut.engine.worker.serve): `vllm serve` has none."""
    opts = HttpSUT.check_options({})
    HttpSUT.preflight(opts, EngineSettings(model=MODEL, max_model_len=4096, device="cpu", admit_every_steps=1,
                                           load_format="dummy"))
    two = EngineSettings(model=MODEL, max_model_len=4096, device="cpu", admit_every_steps=2, load_format="dummy")
    with pytest.raises(InputError, match="--admit-every-steps 2 is the harness's own engine loop"):
        HttpSUT.preflight(opts, two)  # the locality runner's HTTP system checks here
    from types import SimpleNamespace

    from sut.run.harness import _check_backend
    with pytest.raises(InputError, match="--admit-every-steps 2"):  # before the (dead) server is contacted
        _check_backend(SimpleNamespace(sut="vllm-http"), two, {"urls": "http://127.0.0.1:9"})


def test_a_preset_whose_server_engine_admits_every_2nd_step_runs_over_http_only_with_admit_every_steps_1(capsys):
    """loadgen_configs/h100_fp8.toml sets [engine.Server] admit_every_steps = 2: --sut vllm-http with it is refused
    (exit 2) with the way out, before a given server is contacted (a dead URL is not what the user hears of first);
    --admit-every-steps 1 gets past that check."""
    from sut.cli import main

    base = ["run", "--config", str(REPO / "loadgen_configs" / "h100_fp8.toml"), "--sut", "vllm-http", "--scenario",
            "Server", "--model", MODEL, "--dataset", "/nonexistent/data.json"]
    for extra in ([], ["--server-url", "http://127.0.0.1:9"]):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert "give --admit-every-steps 1 to run that preset over HTTP" in err and "does not answer" not in err
    assert main(base + ["--admit-every-steps", "1", "--server-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "admit-every-steps" not in err and "does not answer" in err


#: Words vLLM's parser (argparse, abbreviations allowed) reads as a harness-owned flag -> that flag.
SMUGGLED = [("--enable-prefix", "--enable-prefix-caching"), ("--no-enable-prefix", "--no-enable-prefix-caching"),
            ("--max-num-seq 4", "--max-num-seqs"), ("--max-num-s=4", "--max-num-seqs"),
            ("--gpu-memory-util 0.5", "--gpu-memory-utilization"),
            ("--gpu_memory_util=0.5", "--gpu-memory-utilization"), ("--device-mem 0.5", "--gpu-memory-utilization"),
            ("-q fp8", "--quantization"), ("-qfp8", "--quantization"), ("-q=fp8", "--quantization"),
            ("--mod /x", "--model"), ("--disable-log-s", "--disable-log-stats"), ("--config c.yaml", "--config")]


@pytest.mark.parametrize("args, flag", SMUGGLED)
def test_abbreviated_or_short_flags_of_the_harness_are_refused(args, flag):
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu")
    with pytest.raises(ValueError, match=f"server_args: {flag} .*is set by"):
        servers.check_server_args(HttpOptions(server_args=f"--max-num-partial-prefills 2 {args}").server_args, es)
    with pytest.raises(InputError, match=f"server_args: {flag} .*is set by"):
        HttpSUT.preflight(HttpSUT.check_options({"server_args": args}), es)


@pytest.mark.parametrize("args", ["--max-num-partial-prefills 2", "-O3", "-O 3", "--optimization-level 3",
                                  "--served-model-name m", "--config-format auto", "--compilation-config.mode 0",
                                  "-cc {}", "--", "--max-logprobs -1", "-dpn 0", "--data-parallel-rank 0"])
def test_other_vllm_flags_pass_the_server_args_check(args):
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu")
    servers.check_server_args(HttpOptions(server_args=args).server_args, es)


#: server_args words that set a placement flag (http_options.PLACEMENT_FLAGS) -> that flag.
PLACEMENT = [("-tp 2", "--tensor-parallel-size"), ("--tensor-parallel-size=2", "--tensor-parallel-size"),
             ("--tensor-parallel 2", "--tensor-parallel-size"), ("-pp 2", "--pipeline-parallel-size"),
             ("--pipeline_parallel_size 2", "--pipeline-parallel-size"), ("-dp 2", "--data-parallel-size"),
             ("--data-parallel-size 2", "--data-parallel-size"), ("-dpl 1", "--data-parallel-size-local"),
             ("-dcp 2", "--decode-context-parallel-size"), ("-pcp 2", "--prefill-context-parallel-size")]


@pytest.mark.parametrize("args, flag", PLACEMENT)
def test_placement_flags_are_refused_naming_the_harnesss_placement(args, flag):
    with pytest.raises(InputError, match=f"server_args: {flag} .*is set by the harness's placement: one server per"):
        HttpSUT.check_options({"server_args": f"--max-num-partial-prefills 2 {args}"})
    with pytest.raises(InputError, match=f"server_command: {flag} .*placement"):
        HttpSUT.check_options({"server_command": f"vllm serve {args}"})


@pytest.mark.parametrize("value, word", [(["some/model", "--max-num-partial-prefills", "2"], "some/model"),
                                         ("--max-num-partial-prefills 2 some/model", "some/model"),
                                         ("--max-num-partial-prefills=2 m", "m"), ("-O3 m", "m"), ("-- m", "m"),
                                         ("-1", "-1")])
def test_a_positional_word_in_server_args_is_refused_as_a_model(value, word):
    with pytest.raises(InputError, match=f"server_args: '{word}' is a positional argument, which vLLM reads as the "
                                         "model"):
        HttpSUT.check_options({"server_args": value})


@pytest.mark.parametrize("command", ["vllm serve some/model", "vllm serve --max-num-partial-prefills 2 some/model",
                                     "python -m vllm.entrypoints.openai.api_server some/model"])
def test_a_model_in_the_server_command_is_refused(command):
    with pytest.raises(InputError, match="server_command: 'some/model' is a positional argument"):
        HttpSUT.check_options({"server_command": command})
    HttpSUT.check_options({"server_command": "vllm serve"})  # a program of its own keeps its own words:
    HttpSUT.check_options({"server_command": f"{sys.executable} {FAKE} --delay 0"})


@pytest.mark.parametrize("command, flag", [("vllm serve --quantization fp8", "--quantization"),
                                           ("vllm serve -q fp8", "--quantization"),
                                           ("python -m vllm.entrypoints.openai.api_server --max-num-seq 4",
                                            "--max-num-seqs"),
                                           ("vllm serve --port=1", "--port"),
                                           ("./serve.sh --enable-prefix", "--enable-prefix-caching")])
def test_server_command_flags_are_checked_as_server_args(command, flag):
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu")
    with pytest.raises(InputError, match=f"server_command: {flag} .*is set by"):
        HttpSUT.preflight(HttpSUT.check_options({"server_command": command}), es)
    if flag not in ("--port", "--enable-prefix-caching"):  # those are refused by HttpOptions already
        with pytest.raises(ServerInputError, match=f"server_command: {flag} .*is set by"):
            transport(HttpOptions(server_command=command), device="cpu")
    HttpSUT.preflight(HttpSUT.check_options({"server_command": f"{sys.executable} {FAKE} --delay 0"}), es)


@pytest.mark.slow
def test_the_check_refuses_exactly_what_vllms_own_parser_reads_as_a_harness_setting():
    """Against vLLM's ``vllm serve`` parser (importing it takes 15-25 s here): every option string
    whose dest the harness sets is refused, also as its shortest unique abbreviation (which vLLM
    parses as the flag); every other option passes."""
    from dataclasses import fields

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from sut.core.transports.http_options import PLACEMENT_FLAGS, positional_word
    parser = make_arg_parser(FlexibleArgumentParser())
    es = EngineSettings(model=MODEL, max_model_len=4096, device="cpu")
    owned = ({f.name for f in fields(EngineSettings)} | set(es.vllm_kwargs())
             | {"host", "port", "model", "config", "enable_prompt_tokens_details", "disable_uvicorn_access_log"}
             | {f[2:].replace("-", "_") for f in PLACEMENT_FLAGS})
    options = {o: a.dest for a in parser._actions for o in a.option_strings if a.dest != "help"}

    def refused(words):
        try:
            servers.check_server_args(HttpOptions(server_args=words).server_args, es)
            return False
        except ValueError:
            return True

    wrong = [o for o, dest in options.items() if refused([o, "1"]) != (dest in owned)]
    assert not wrong, f"check disagrees with vLLM's parser on {wrong}"
    for opt, dest in options.items():
        if dest not in owned or not opt.startswith("--") or opt == "--config":
            continue
        abbrev = next((opt[:n] for n in range(3, len(opt))
                       if [o for o in options if o.startswith(opt[:n])] == [opt]), opt)
        action = parser._option_string_actions[opt]
        value = [] if action.nargs == 0 else [str(next(iter(action.choices or ["1"])))]
        assert refused([abbrev, *value]), abbrev
        as_abbrev, as_flag = parser.parse_known_args([abbrev, *value]), parser.parse_known_args([opt, *value])
        assert vars(as_abbrev[0]) == vars(as_flag[0]) and as_abbrev[1] == [], abbrev
    for words in (["m"], ["--max-logprobs", "2", "m"], ["--max-logprobs=2", "m"], ["-O3", "m"], ["-O", "3"], ["-O3"],
                  ["--", "m"], ["-1"], ["--max-logprobs", "-1"], ["-cc", "{}", "m"]):
        as_model = parser.parse_args(words).model_tag is not None  # vLLM's own reading (-O3: its preprocessing)
        assert (positional_word(words) is not None) == as_model, words

def test_server_args_are_refused_with_urls_and_must_be_strings():
    with pytest.raises(InputError, match="server_args: only for servers started here"):
        HttpSUT.check_options({"urls": "http://127.0.0.1:1", "server_args": "--max-num-partial-prefills 2"})
    with pytest.raises(ValueError, match="server_args: expected a string or a list of strings"):
        HttpOptions(server_args=3)


def test_prefix_caching_from_launch_args_and_contradicting_sources():
    assert readback.launch_prefix_caching(["x", "--enable-prefix-caching", "--no-enable-prefix-caching"]) is False
    assert readback.launch_prefix_caching(["x", "--no-enable-prefix-caching", "--enable_prefix_caching"]) is True
    assert readback.launch_prefix_caching(["x", "--seed", "0"]) is None
    assert readback.launch_prefix_caching(["x", "--no-enable-prefix-caching", "--enable-prefix"]) is True
    assert readback.launch_prefix_caching(["x", "--enable-prefix-caching", "--no-enable-pre"]) is False
    assert readback.agreed_prefix_caching([("launch arguments", False), ("/metrics", None)]) is False
    assert readback.agreed_prefix_caching([("/metrics", None)]) is None
    with pytest.raises(ReplyError, match=r"contradicts itself \(launch arguments: off, /metrics: on\)"):
        readback.agreed_prefix_caching([("launch arguments", False), ("/metrics", True)])


# -- requests and results --------------------------------------------------------------------------
def test_token_ids_cached_tokens_and_sampling_on_two_replicas(fake_server, started):
    """Answers that stop at EOS ('stop') and at max_tokens ('length'); cached tokens only where the server reports
    them (vLLM: only with --enable-prompt-tokens-details)."""
    (u0, _), (u1, _) = fake_server("--cached", "3", "--enable-prompt-tokens-details"), fake_server("--cached", "3")
    t = transport(HttpOptions(urls=[u0, u1], max_inflight_per_replica=4))
    started.append(t)
    sink = Sink()
    records = t.start(sink)
    assert [r.info["url"] for r in records] == [u0, u1]
    assert all(r.enable_prefix_caching is False and r.info["served_model"] == MODEL for r in records)
    t.submit(0, requests(10))
    t.submit(1, requests(10, start=10))
    sink.wait(lambda: len(sink.results) == 20)
    for rid, (replica, c) in sink.results.items():
        assert replica == (0 if rid < 10 else 1)
        assert c.token_ids.dtype == np.int32 and list(c.token_ids) == answer(rid)
        assert c.cached_tokens == (3 if rid < 10 else None) and c.t_queued <= c.t_done and c.t_first is None
    body = [b for b in stats_of(u0)["bodies"] if b["prompt"] == [3, 7, 8, 9]][0]
    assert body["model"] == MODEL and body["return_token_ids"] is True and "stream" not in body
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (6, 1, False)
    assert body["stop_token_ids"] == list(EOS) and body["temperature"] == 0.0 and body["top_p"] == 1.0
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (0, 0.0, 1.0)
    assert [e["samples"] for e in t.stats()["engines"]] == [10, 10] and not sink.fatal


def test_ignore_eos_asks_for_fixed_length_outputs(fake_server, started):
    url, _ = fake_server()
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=2),
                  gen=GenerationSettings(max_tokens=5, ignore_eos=True, eos_token_ids=EOS))
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(1))
    sink.wait(lambda: len(sink.results) == 1)
    body = stats_of(url)["bodies"][-1]
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (5, 5, True)
    assert list(sink.results[0][1].token_ids) == [10, 11, 12, 13, 14]  # the EOS at position 3 masked: 5 ids


@pytest.mark.parametrize("eos, expected", [(EOS, [10, 11, 12, 128009]), ((128001,), [10, 11, 12, 128009, 14, 15])])
def test_a_server_that_knows_no_eos_stops_at_the_requests_stop_token_ids(fake_server, started, eos, expected):
    """Servers started here get --skip-tokenizer-init: they know no EOS id, only the request's stop_token_ids
    (the model's EOS ids) end an answer early."""
    url, _ = fake_server("--skip-tokenizer-init")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=2), gen=GenerationSettings(max_tokens=6,
                                                                                          eos_token_ids=eos))
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(1))
    sink.wait(lambda: len(sink.results) == 1)
    assert list(sink.results[0][1].token_ids) == expected and not sink.fatal


@pytest.mark.parametrize("after, said", [
    (2, "request 0 failed: server error: Internal server error"),  # mid-answer: no finish_reason would say it too
    (1000, "request 0 failed: server error: Internal server error"),  # after the last ids: they looked complete
])
def test_an_error_chunk_in_the_stream_is_fatal_naming_the_servers_message(fake_server, started, after, said):
    """vLLM streams an exception during generation as a chunk {"error": {...}}, then [DONE]."""
    url, _ = fake_server("--error-after", str(after))
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1), stream=True)
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(1))
    sink.wait(lambda: sink.fatal or sink.results)
    assert sink.fatal and said in sink.fatal[0].message and not sink.results


def test_streaming_reports_each_first_token_before_its_completion(fake_server, started):
    url, _ = fake_server("--delay", "0.05")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=8), stream=True)
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(12))
    sink.wait(lambda: len(sink.results) == 12)
    for rid, (_, c) in sink.results.items():
        assert sink.events.index(("first", rid)) < sink.events.index(("done", rid))
        assert sink.firsts[rid] == c.token_ids[0] and list(c.token_ids) == answer(rid)
        assert c.t_queued <= c.t_first <= c.t_done and c.cached_tokens is None  # not sent without prompt-tokens details
    body = stats_of(url)["bodies"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("stream, flags, said", [
    (True, ["--finish", "none"], "the answer ended with no finish_reason after 1 ids"),
    (True, ["--finish", "abort", "--eos-at", "-1"], "the answer ended with finish_reason 'abort' after 6 ids"),
    (False, ["--finish", "abort", "--eos-at", "-1"], "the answer ended with finish_reason 'abort' after 6 ids"),
    (True, ["--max-new-tokens", "3"], "finish_reason 'length' after 3 ids, but max_tokens is 6"),
    (False, ["--max-new-tokens", "3"], "finish_reason 'length' after 3 ids, but max_tokens is 6"),
])
def test_an_answer_the_server_cut_short_is_fatal(fake_server, started, stream, flags, said):
    """First chunk then [DONE], finish_reason abort, or the server's own lower token limit ('length' early,
    without ignore_eos, so the dispatcher's length check would let it through): the run fails."""
    url, _ = fake_server(*flags)
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=2), stream=stream)
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(2))
    sink.wait(lambda: sink.fatal)
    assert said in sink.fatal[0].message and not sink.results


def test_requests_in_flight_are_bounded_on_connections_opened_before_start_returns(fake_server, started):
    url, _ = fake_server("--delay", "0.05")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=3))
    started.append(t)
    sink = Sink()
    t.start(sink)
    opened = set(stats_of(url)["health_ports"])
    assert len(opened) >= 3  # the pool's connections exist before the first request
    t.submit(0, requests(30))
    sink.wait(lambda: len(sink.results) == 30)
    st = stats_of(url)
    assert st["max_inflight"] == 3  # 30 requests, never more than 3 on the server at once
    used = set(st["completion_ports"])
    assert len(used) <= 4 and len(used - opened) <= 1  # completions ride the pre-opened connections (+ the probe's)


# -- errors before the run -----------------------------------------------------------------------
def test_unreachable_url_is_an_input_error_naming_it(started):
    url = f"http://127.0.0.1:{servers.free_port()}"
    with pytest.raises(InputError, match=f"server {url} does not answer"):
        HttpSUT.check_options({"urls": url})
    t = transport(HttpOptions(urls=url))
    with pytest.raises(ServerInputError, match=f"replica 0 \\({url}\\) does not answer") as e:
        t.start(Sink())
    assert isinstance(e.value, TransportError) and isinstance(e.value, InputError)


def test_a_server_of_another_model_is_refused_unless_named(fake_server, started):
    url, _ = fake_server(model="/models/Other-Model-7B")
    with pytest.raises(ServerInputError, match=f"\\({url}\\) serves another model.*Other-Model-7B"):
        transport(HttpOptions(urls=url)).start(Sink())
    t = transport(HttpOptions(urls=url, model_name="/models/Other-Model-7B", max_inflight_per_replica=1))
    started.append(t)
    assert t.start(Sink())[0].info["served_model"] == "/models/Other-Model-7B"


def test_same_model_under_another_folder_is_recognised_by_name(fake_server, started):
    url, _ = fake_server(model=f"/elsewhere/{TINY_MODEL.name}")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1))
    started.append(t)
    assert t.start(Sink())[0].info["served_model"] == f"/elsewhere/{TINY_MODEL.name}"


def test_a_server_with_a_shorter_context_is_refused(fake_server):
    url, _ = fake_server("--max-model-len", "2048")
    with pytest.raises(ServerInputError, match="serves max_model_len 2048 < --max-model-len 4096"):
        transport(HttpOptions(urls=url)).start(Sink())


def test_a_server_that_returns_text_instead_of_ids_is_a_transport_error(fake_server):
    url, _ = fake_server("--text-only")
    with pytest.raises(TransportError, match=f"\\({url}\\) probe completion failed: .*text instead of token ids") as e:
        transport(HttpOptions(urls=url)).start(Sink())
    assert not isinstance(e.value, InputError)


def test_unconfirmed_prefix_caching_is_refused_unless_allowed_and_then_not_compliant(fake_server, started):
    url, _ = fake_server("--no-metrics")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1))
    started.append(t)
    records = t.start(Sink())
    assert records[0].enable_prefix_caching is None
    with pytest.raises(guard.PrefixCachingError, match="could not be confirmed off"):
        guard.check_replicas(records, allowed=False)
    assert guard.check_replicas(records, allowed=False, allow_unconfirmed=True) == [0]
    assert HttpSUT.noncompliance_reasons(HttpOptions(allow_unconfirmed_prefix_caching=True)) == [UNCONFIRMED_REASON]
    assert HttpSUT.noncompliance_reasons(HttpOptions()) == []


def test_a_given_server_with_prefix_caching_on_or_unread_is_refused_before_the_run(fake_server):
    """The check before the run folder (``HttpSUT.preflight``) names the URL and why; the options that allow it
    (and a study, which allows prefix caching) let it pass."""
    engine = EngineSettings(model=MODEL, max_model_len=4096)
    unread, _ = fake_server("--disable-log-stats")
    on, _ = fake_server("--enable-prefix-caching")
    with pytest.raises(InputError, match=f"server {unread}: prefix caching could not be confirmed off: its /metrics "
                                         "has no vllm:cache_config_info: start it without --disable-log-stats"):
        HttpSUT.preflight(HttpOptions(urls=unread), engine)
    with pytest.raises(InputError, match=f"server {on} reports enable_prefix_caching=True"):
        HttpSUT.preflight(HttpOptions(urls=on, allow_unconfirmed_prefix_caching=True), engine)
    HttpSUT.preflight(HttpOptions(urls=unread, allow_unconfirmed_prefix_caching=True), engine)
    HttpSUT.preflight(HttpOptions(urls=on, allow_prefix_caching=True), engine)
    HttpSUT.preflight(HttpOptions(urls=f"{unread},{on}"), engine, confirm_prefix_caching=False)


def test_server_info_of_a_dev_mode_server_is_read_back(fake_server, started):
    url, _ = fake_server("--no-metrics", "--server-info")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1))
    started.append(t)
    info = t.start(Sink())[0].info
    assert info["enable_prefix_caching"] is False and info["engine_args_from"] == ["/v1/models", "/server_info"]
    assert info["engine_args"]["max_num_seqs"] == 64 and info["engine_args"]["dtype"] == "float32"
    assert info["kv_cache"]["tokens"] == 512 * 16 and info["vllm_version"] == "0.0.0-fake"


def test_a_server_reporting_prefix_caching_on_is_refused(fake_server, started):
    url, _ = fake_server("--enable-prefix-caching")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1))
    started.append(t)
    records = t.start(Sink())
    with pytest.raises(guard.PrefixCachingError, match="reports enable_prefix_caching=True"):
        guard.check_replicas(records, allowed=False, allow_unconfirmed=True)


# -- failures during the run ---------------------------------------------------------------------
def test_server_killed_mid_run_is_one_fatal_event_naming_it(fake_server, started):
    url, proc = fake_server("--delay", "0.3")
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=4))
    started.append(t)
    sink = Sink()
    t.start(sink)
    t.submit(0, requests(40))
    sink.wait(lambda: len(sink.results) >= 4)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    sink.wait(lambda: sink.fatal, timeout=10)
    assert time.monotonic() - t0 < 5
    assert len(sink.fatal) == 1 and sink.fatal[0].replica == 0 and url in sink.fatal[0].message
    with pytest.raises(TransportError, match="is gone"):
        t.submit(0, requests(1, start=100))
    time.sleep(0.5)
    assert len(sink.fatal) == 1  # at most one fatal event
    # the next test of a one-process series (sut/run/series.py) must not attach to the dead transport
    with pytest.raises(TransportError, match="a replica failed during an earlier test"):
        t.attach(Sink())


@pytest.mark.parametrize("sig, said", [
    (signal.SIGKILL, "failed its health check ({url}/health): "),
    (signal.SIGSTOP, "failed its health check ({url}/health): no answer within 0.5 s (a stopped or overloaded server)"),
], ids=["dies", "stopped"])
def test_an_idle_server_that_dies_or_stops_is_found_by_the_health_check(fake_server, started, monkeypatch, sig, said):
    import sut.core.transports.http as http_transport
    monkeypatch.setattr(http_transport, "HEALTH_TIMEOUT_S", 0.5)
    url, proc = fake_server()
    t = transport(HttpOptions(urls=url, max_inflight_per_replica=1, health_interval_s=0.2))
    started.append(t)
    sink = Sink()
    t.start(sink)
    os.killpg(proc.pid, sig)
    try:
        sink.wait(lambda: sink.fatal, timeout=10)
    finally:
        if sig == signal.SIGSTOP:
            os.killpg(proc.pid, signal.SIGCONT)
    assert said.format(url=url) in sink.fatal[0].message, sink.fatal[0].message


# -- servers started here -------------------------------------------------------------------------
def _group_gone(pgid, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_started_servers_are_recorded_watched_and_ended(tmp_path, started, caplog):
    opts = HttpOptions(server_command=f"{sys.executable} {FAKE}", max_inflight_per_replica=2)
    t = transport(opts, log_dir=str(tmp_path), device="cpu", engines_per_device=2)
    started.append(t)
    sink = Sink()
    records = t.start(sink)
    assert len(records) == 2
    for r in records:
        info = r.info
        assert info["url"].startswith("http://127.0.0.1:") and info["pid"] and info["enable_prefix_caching"] is False
        assert "--no-enable-prefix-caching" in info["launch_args"] and info["device"]["kind"] == "cpu"
        assert "--disable-log-stats" in info["launch_args"] and info["engine_args"]["disable_log_stats"] is True
        # statistics off: /metrics has no cache config; the launch arguments are the read-back
        assert info["engine_args"]["max_model_len"] == 4096
        assert info["engine_args_from"] == ["launch args", "/v1/models"]
        assert (tmp_path / f"server-{r.index}.log").is_file()
    assert sorted(r.info["device"]["slot"] for r in records) == ["0", "1"]
    t.submit(1, requests(3))
    sink.wait(lambda: len(sink.results) == 3)
    pid = records[1].info["pid"]
    os.kill(pid, signal.SIGKILL)
    sink.wait(lambda: sink.fatal, timeout=5)
    msg = sink.fatal[0].message
    assert sink.fatal[0].replica == 1 and "exited unexpectedly (killed by signal 9)" in msg
    assert msg.endswith(OOM_HINT)  # a SIGKILL: the likely sender and what to change, after the pointer to the log
    # the log's last lines: logged once at once; the event (reported again at the run's end) names the log
    assert "fake vLLM server" not in msg and "the last lines of its log are above" in msg and "server-1.log" in msg
    assert sum("fake vLLM server" in r.getMessage() for r in caplog.records) == 1
    t.stop()
    assert all(_group_gone(r.info["pid"]) for r in records)


def test_a_stop_cut_short_by_a_stop_signal_is_finished_by_the_next_stop(tmp_path, started, monkeypatch):
    """Ctrl-C while ``stop`` closes the client (or waits for the servers to end) cut it short: the servers must
    still be ended, then and by the next ``stop`` (the run's own stop after a start that failed), which used to
    return at once and leave them running."""
    t = transport(HttpOptions(server_command=f"{sys.executable} {FAKE}"), log_dir=str(tmp_path), device="cpu")
    started.append(t)
    (rec,) = t.start(Sink())
    pid = rec.info["pid"]

    def interrupted():
        raise KeyboardInterrupt("SIGINT, Ctrl-C")

    monkeypatch.setattr(t, "_close_client", interrupted)
    monkeypatch.setattr(t, "_end_servers", interrupted)  # the signal lands before any server was signalled
    with pytest.raises(KeyboardInterrupt):
        t.stop()
    monkeypatch.undo()
    assert not _group_gone(pid, timeout=0.5)
    t.stop()
    assert _group_gone(pid) and t.servers[0].ended
    t.stop()  # again: nothing left to end, nothing signalled


def test_server_log_stats_and_server_args_reach_a_started_server(tmp_path, started):
    opts = HttpOptions(server_command=f"{sys.executable} {FAKE}", max_inflight_per_replica=1, server_log_stats=True,
                       server_args="--max-num-partial-prefills 2")
    t = transport(opts, log_dir=str(tmp_path), device="cpu")
    started.append(t)
    (rec,) = t.start(Sink())
    info = rec.info
    assert "--disable-log-stats" not in info["launch_args"]
    assert info["launch_args"][-2:] == ["--max-num-partial-prefills", "2"]
    assert info["engine_args_from"] == ["launch args", "/v1/models", "/metrics"]
    assert info["enable_prefix_caching"] is False
    assert info["engine_args"]["disable_log_stats"] is False and info["engine_args"]["block_size"] == 16


def test_a_started_server_whose_metrics_contradict_its_launch_args_is_refused(tmp_path):
    opts = HttpOptions(server_command=f"{sys.executable} {FAKE} --metrics-prefix-caching True", server_log_stats=True)
    t = transport(opts, log_dir=str(tmp_path), device="cpu")
    with pytest.raises(TransportError, match=r"contradicts itself \(launch arguments: off, /metrics: on\)"):
        t.start(Sink())
    assert all(_group_gone(s.pid) for s in t.servers)


def test_a_server_that_fails_to_start_names_it_with_its_log(tmp_path):
    opts = HttpOptions(server_command=f"{sys.executable} {FAKE} --fail-start", server_start_timeout_s=30)
    t = transport(opts, log_dir=str(tmp_path), device="cpu")
    with pytest.raises(TransportError, match="server 0 .* exited during start-up") as e:
        t.start(Sink())
    assert "refusing to start" in str(e.value) and not isinstance(e.value, InputError)


# -- the whole run through the CLI ----------------------------------------------------------------
def _run(tmp_path, synthetic_small, *args):
    data, _ = synthetic_small
    return subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", "--sut", "vllm-http", "--user-conf",
                           str(CPU_CONF), "--model", MODEL, "--max-model-len", "4096", "--dataset", str(data),
                           "--mode", "accuracy", "--max-samples", "8", "--no-accuracy-gate",
                           "--output-dir", str(tmp_path), *args],
                          env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=90)


def test_cli_accuracy_run_over_a_given_server(tmp_path, synthetic_small, fake_server):
    url, _ = fake_server()
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--max-inflight-per-replica", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["sut"] == "vllm-http" and rec["ledger"]["completed"] == 8
    assert rec["engines"][0]["url"] == url and rec["engines"][0]["samples"] == 8
    assert rec["prefix_caching"]["enabled"] is False and rec["options"]["urls"] == [url]
    assert rec["http"]["exposure"] == [{"url": url, "loopback": True, "tls": False, "warning": None}]
    assert any(f"the weights of {url} are not read back" in w for w in rec["warnings"])  # no /server_info here
    log = json.loads((run / "mlperf_log_accuracy.json").read_text())
    assert sorted(r["qsl_idx"] for r in log) == list(range(8))
    lengths = {len(logged_ids(r["data"])) for r in log}
    assert lengths == {4, 128}  # answers that stopped at EOS ('stop') and at max_tokens ('length')
    assert all(logged_ids(r["data"])[-1] == 128009 for r in log if len(logged_ids(r["data"])) == 4)


def test_cli_with_ignore_eos_every_generated_id_reaches_loadgen(tmp_path, synthetic_small, fake_server):
    """A benchmark run that ignores EOS: EOS ids inside an answer are ids like any other; LoadGen gets all
    max_tokens of them (not the answer cut after its first EOS), and the run does not fail."""
    url, _ = fake_server("--eos-anyway")  # vLLM's min_tokens (= max_tokens here) would mask it
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--benchmark-ignore-eos")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    log = [logged_ids(r["data"]) for r in json.loads((run / "mlperf_log_accuracy.json").read_text())]
    assert {len(ids) for ids in log} == {128} and any(ids[3] == 128009 for ids in log), log


def logged_ids(hexdata: str) -> list[int]:
    return np.frombuffer(bytes.fromhex(hexdata), "<i4").tolist()


SERVER = ["--scenario", "Server", "--target-qps", "20"]


def _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, *flags):
    """``(url, run folder, run.json)`` of a run against a fake server started with ``flags``, checked to have failed
    (exit 1, no traceback, run.json "failed")."""
    url, _ = fake_server(*flags)
    out = _run(tmp_path, synthetic_small, "--server-url", url, *scenario)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed", rec.get("error")
    return url, run, rec


@pytest.mark.parametrize("scenario, flags, said", [
    ([], ["--truncate", "5"], "answered 5 ids, fewer than max_tokens 128, ending in 14, not an EOS id "
                              "[128001, 128008, 128009] (an answer cut short): [10, 11, 12, 13, 14]"),
    (SERVER, ["--truncate", "3"], "answered 3 ids, fewer than max_tokens 128, ending in 12, not an EOS id"),
    ([], ["--bad-id", "200000"], "answered id 200000 at position 1 of "),
    (SERVER, ["--bad-id", "200000"], "answered id 200000 at position 1 of "),
    ([], ["--no-stop"], "answered EOS id 128009 at position 3 of 128 ids, not at the end (the engine did not stop at "
                        "an EOS id it was given): [10, 11, 12, 128009, 14, ... (118 more), "),
    (SERVER, ["--no-stop"], "answered EOS id 128009 at position 3 of 128 ids, not at the end"),
])
def test_cli_an_answer_cut_short_or_outside_the_vocabulary_fails_the_run(tmp_path, synthetic_small, fake_server,
                                                                         scenario, flags, said):
    """A server (or proxy) that says 'stop' after a few ids without an EOS, or sends an id outside the model's
    vocabulary (128,256): exit 1, run.json failed naming request, sample, replica and the ids; none reaches LoadGen."""
    url, run, rec = _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, *flags)
    assert re.search(rf"request \d+ \(QSL index \d+, LoadGen sample \d+\): replica 0 \({re.escape(url)}\) "
                     rf"{re.escape(said)}", rec["error"]), rec["error"]
    for r in json.loads((run / "mlperf_log_accuracy.json").read_text()):
        ids = logged_ids(r["data"])
        assert 200000 not in ids and (not ids or len(ids) == 128 or ids[-1] == 128009), ids


@pytest.mark.parametrize("scenario", [[], SERVER], ids=["offline", "server"])
def test_cli_ids_sent_twice_fail_the_run_on_the_servers_own_count(tmp_path, synthetic_small, fake_server, scenario):
    """A proxy that repeats a streamed chunk (or an id) passes length, EOS and vocabulary checks; the server's
    usage.completion_tokens differs from the ids received: exit 1, run.json failed naming replica, request and the
    request's QSL index and LoadGen sample."""
    url, run, rec = _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, "--dup-first-chunk")
    assert re.search(rf"replica 0 \({re.escape(url)}\) request \d+ failed: the server counted 4 generated tokens "
                     r"\(usage.completion_tokens\) but 5 ids came: ids were lost or sent twice on the way "
                     r"\(QSL index \d+, LoadGen sample \d+\)", rec["error"]), \
        rec["error"]
    for r in json.loads((run / "mlperf_log_accuracy.json").read_text()):
        ids = logged_ids(r["data"])
        assert not ids or len(ids) == 128 or ids.count(ids[0]) == 1, ids  # no doubled answer reached LoadGen


@pytest.mark.parametrize("scenario", [[], SERVER], ids=["offline", "server"])
def test_cli_replies_mixed_up_between_requests_fail_the_run_on_their_prompt_ids(tmp_path, synthetic_small, fake_server,
                                                                               scenario):
    """A proxy that hands each reply to the next request passes every check on the answer itself (length, EOS,
    vocabulary, count); the reply's prompt_token_ids are another request's: exit 1, run.json failed naming replica,
    request, QSL index and LoadGen sample; no other sample's answer reaches LoadGen."""
    url, _run_dir, rec = _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, "--mixup")
    assert re.search(rf"replica 0 \({re.escape(url)}\) request \d+ failed: the reply answers another prompt: its "
                     r"prompt_token_ids \(\d+ ids: \[.*\) are not the \d+ ids sent: replies were mixed up on the way "
                     r"\(QSL index \d+, LoadGen sample \d+\)", rec["error"]), rec["error"]
    assert rec["ledger"]["completed"] <= 1, rec["ledger"]  # the first request's own reply; no mixed one was taken


@pytest.mark.parametrize("scenario", [SERVER, ["--scenario", "Interactive", "--target-qps", "20"]],
                         ids=["server", "interactive"])
def test_cli_a_stream_spliced_with_another_replys_chunks_fails_the_run(tmp_path, synthetic_small, fake_server,
                                                                       scenario):
    """A proxy that goes on with another request's chunks after a stream's own first chunk (the only one that carries
    the prompt ids) passes every check on the answer (length, EOS, vocabulary, count, prompt ids): its later chunks
    carry the other reply's id. Exit 1, run.json failed naming replica, request, QSL index and LoadGen sample."""
    url, _run_dir, rec = _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, "--splice")
    assert re.search(rf"replica 0 \({re.escape(url)}\) request \d+ failed: a stream chunk of reply "
                     r"'cmpl-fake-\d+' came in the stream of reply 'cmpl-fake-\d+': replies were mixed up on the way "
                     r"\(QSL index \d+, LoadGen sample \d+\)", rec["error"]), rec["error"]
    assert rec["ledger"]["completed"] <= 1, rec["ledger"]  # the first stream's own reply; no spliced one was taken


@pytest.mark.parametrize("scenario", [[], SERVER], ids=["offline", "server"])
@pytest.mark.parametrize("usage, said", [
    ("none", "the reply carries no usage.completion_tokens"),
    ("float", "usage.completion_tokens is not a count of tokens (an integer >= 0)"),
])
def test_cli_a_server_without_its_own_token_count_is_refused_at_the_probe(tmp_path, synthetic_small, fake_server,
                                                                          scenario, usage, said):
    """Without usage.completion_tokens (or with one that is no count) ids sent twice could not be caught: the start-up
    probe refuses the server before LoadGen starts (exit 1, run.json failed naming the replica and the cause)."""
    url, run, rec = _failed_run_against(fake_server, tmp_path, synthetic_small, scenario, "--usage", usage)
    assert not (run / "mlperf_log_accuracy.json").exists(), rec
    assert f"replica 0 ({url}) probe completion failed: {said}" in rec["error"], rec["error"]


@pytest.mark.parametrize("scenario", [[], SERVER], ids=["offline", "server"])
def test_cli_a_server_replaced_behind_its_url_during_the_run_fails_it(tmp_path, synthetic_small, fake_server,
                                                                      scenario):
    """A server restarted (here: with prefix caching on) between two /health polls answers under the same URL; the
    read-back after the run sees another process start time and prefix caching: exit 1, run.json failed naming both,
    not an "ok" record that claims the settings read back at the start."""
    url, _ = fake_server("--swap-after", "3")
    out = _run(tmp_path, synthetic_small, "--server-url", url, *scenario)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed"
    assert rec["error"].startswith(f"vllm-http replica 0 ({url}) is not the server read back at the start (restarted "
                                   "or replaced during the run): enable_prefix_caching False -> True; process_start_s "), \
        rec["error"]
    url, _ = fake_server()  # the same run against a server that stays itself: ok
    out = _run(tmp_path / "same", synthetic_small, "--server-url", url, *scenario)
    assert out.returncode == 0, out.stderr[-3000:]


def test_cli_unconfirmed_prefix_caching_exits_2_before_a_run_folder_unless_allowed_then_not_compliant(
        tmp_path, synthetic_small, fake_server):
    """A server started with --disable-log-stats has no vllm:cache_config_info in /metrics: the check before the
    run names the URL, the cause and the flag; no run folder."""
    url, _ = fake_server("--disable-log-stats")
    (tmp_path / "a").mkdir()
    out = _run(tmp_path / "a", synthetic_small, "--server-url", url)
    said = (f"server {url}: prefix caching could not be confirmed off: its /metrics has no vllm:cache_config_info: "
            "start it without --disable-log-stats (or pass --allow-unconfirmed-prefix-caching to run anyway")
    assert out.returncode == 2 and said in out.stderr, out.stderr[-2000:]
    assert not list((tmp_path / "a").iterdir())
    url, _ = fake_server("--no-metrics")
    out = _run(tmp_path / "b", synthetic_small, "--server-url", url, "--allow-unconfirmed-prefix-caching")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "b").iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["compliance"]["compliant"] is False and UNCONFIRMED_REASON in rec["compliance"]["reasons"]
    assert rec["prefix_caching_unconfirmed_replicas"] == [0]


def test_cli_unreachable_url_exits_2_before_a_run_folder(tmp_path, synthetic_small):
    url = f"http://127.0.0.1:{servers.free_port()}"
    out = _run(tmp_path, synthetic_small, "--server-url", url)
    assert out.returncode == 2 and f"server {url} does not answer" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@pytest.fixture
def not_http():
    """The URL of a loopback port that answers every connection with bytes that are not HTTP (an SSH banner)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01not http\r\n\r\n")
                conn.settimeout(1.0)
                try:
                    conn.recv(4096)
                except OSError:
                    pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    done.set()
    th.join(5)
    srv.close()


def test_cli_a_port_that_answers_other_bytes_exits_2_naming_it(tmp_path, synthetic_small, not_http):
    out = _run(tmp_path, synthetic_small, "--server-url", not_http)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"server {not_http} does not answer HTTP ({not_http}/health: not an HTTP reply (BadStatusLine: " \
           "'SSH-2.0-OpenSSH_9.6" in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    with pytest.raises(InputError, match=f"server {not_http}: {not_http}/v1/models: not an HTTP reply"):
        HttpSUT.preflight(HttpOptions(urls=not_http), EngineSettings(model=MODEL))  # the locality study's check


def test_cli_one_server_given_twice_under_two_host_names_exits_2_naming_both(tmp_path, synthetic_small, fake_server):
    url, _ = fake_server()
    twin = url.replace("127.0.0.1", "localhost")
    out = _run(tmp_path, synthetic_small, "--server-url", f"{url},{twin}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"--server-url gives one server twice: {url} and {twin} both reach 127.0.0.1:{url.rsplit(':', 1)[1]}" \
        in out.stderr, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_urls_of_distinct_servers_pass_the_check():
    from sut.http_sut import check_distinct

    check_distinct(["http://127.0.0.1:8000", "http://localhost:8001", "http://127.0.0.1:8000/proxy/b"])
    with pytest.raises(InputError, match="http://localhost:80 and http://127.0.0.1 both reach 127.0.0.1:80"):
        check_distinct(["http://localhost:80", "http://127.0.0.1"])


def test_cli_server_scenario_streams_the_first_token_of_every_sample(tmp_path, synthetic_small, fake_server):
    url, _ = fake_server("--delay", "0.02")
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--scenario", "Server", "--target-qps", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["routing"]["policy"] == "least_pending"
    assert rec["ledger"]["issued"] == rec["ledger"]["completed"] == rec["ledger"]["first_tokens"] == 8
    for r in json.loads((run / "mlperf_log_accuracy.json").read_text()):
        ids = np.frombuffer(bytes.fromhex(r["data"]), "<i4")
        first = np.frombuffer(bytes.fromhex(r["token_data"]), "<i4")
        assert list(first) == [ids[0]] and r["token_count"] == len(ids)


def test_cli_server_accuracy_run_with_an_answer_cut_short_fails_with_exit_1_not_a_crash(tmp_path, synthetic_small,
                                                                                        fake_server):
    """The samples still outstanding (or issued after the failure) are answered empty; LoadGen 6.0.17 in accuracy
    mode crashed the process (SIGSEGV, run.json left "running") when such a sample had no first token."""
    url, _ = fake_server("--delay", "0.02", "--finish", "none")
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--scenario", "Server", "--target-qps", "20")
    assert out.returncode == 1, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed" and "the answer ended with no finish_reason after 1 ids" in rec["error"]


@pytest.mark.parametrize("scenario, after, said", [
    (SERVER, 200, "failed: server error: Internal server error"),  # the error chunk after an answer's last ids
    ([], 100, 'failed: HTTP 500: {"error": {"message": "Internal server error"'),  # answers of 128 ids
])
def test_cli_a_server_error_during_generation_fails_the_run(tmp_path, synthetic_small, fake_server, scenario, after,
                                                             said):
    url, _ = fake_server("--error-after", str(after))
    out = _run(tmp_path, synthetic_small, "--server-url", url, *scenario)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed" and f"vllm-http replica 0 ({url}) request " in rec["error"], rec["error"]
    assert said in rec["error"], rec["error"]


def test_cli_server_of_another_model_exits_2_naming_it(tmp_path, synthetic_small, fake_server):
    url, _ = fake_server(model="/models/Other-Model-7B")
    out = _run(tmp_path, synthetic_small, "--server-url", url)
    assert out.returncode == 2 and f"server {url}: serves another model" in out.stderr, out.stderr[-2000:]
    assert "pass --served-model-name ID" in out.stderr  # the flag first (found by a fault test: only the option was named)
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.iterdir())  # refused before the run folder is made (HttpSUT.preflight)


def test_cli_a_server_with_dummy_weights_must_be_declared_so_that_the_run_is_not_compliant(tmp_path, synthetic_small,
                                                                                          fake_server):
    """A given server that reports random weights (/server_info load_format) is refused before the run folder unless
    the run says --load-format dummy, which marks it not compliant; its weights are then read back (no warning)."""
    url, _ = fake_server("--server-info", "--load-format", "dummy")
    out = _run(tmp_path, synthetic_small, "--server-url", url)
    assert out.returncode == 2 and f"server {url} loaded dummy (random) weights" in out.stderr, out.stderr[-2000:]
    assert "pass --load-format dummy" in out.stderr and not list(tmp_path.iterdir())
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--load-format", "dummy")
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = tmp_path.iterdir()
    rec = json.loads((run / "run.json").read_text())
    assert run.name.endswith("-NOT-COMPLIANT")
    assert any("dummy (random) weights" in r for r in rec["compliance"]["reasons"])
    assert rec["engines"][0]["engine_args"]["load_format"] == "dummy"
    assert not any("not read back" in w for w in rec.get("warnings", []))


def test_cli_server_with_a_shorter_context_exits_2_before_a_run_folder(tmp_path, synthetic_small, fake_server):
    url, _ = fake_server("--max-model-len", "512")
    out = _run(tmp_path, synthetic_small, "--server-url", url, "--max-model-len", "1024")
    assert out.returncode == 2 and f"server {url} serves max_model_len 512 < --max-model-len 1024" in out.stderr, \
        out.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_cli_ctrl_c_ends_the_servers_it_started(tmp_path, synthetic_small):
    data, _ = synthetic_small
    cmd = [sys.executable, "-m", "sut", "run", "--no-progress", "--sut", "vllm-http", "--user-conf", str(CPU_CONF),
           "--model", MODEL, "--max-model-len", "4096", "--device", "cpu", "--dataset", str(data),
           "--option", f"server_command={sys.executable} {FAKE} --delay 0.2", "--max-inflight-per-replica", "2",
           "--min-duration-s", "60", "--min-query-count", "1", "--output-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=sut_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline, rec = time.monotonic() + 60, {}
        while not rec.get("engines") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            runs = list(tmp_path.iterdir())
            if runs and (runs[0] / "run.json").is_file():
                rec = json.loads((runs[0] / "run.json").read_text())
        assert rec.get("engines"), proc.stdout.read() if proc.poll() is not None else "no engines in run.json"
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130, proc.stdout.read()[-3000:]
    final = json.loads((runs[0] / "run.json").read_text())
    assert final["status"] == "failed" and "interrupted (SIGINT" in final["error"]
    assert _group_gone(rec["engines"][0]["pid"])


@pytest.mark.parametrize("args, flag", [("--port 9000", "--port"), ("--max-num-seqs 4", "--max-num-seqs")])
def test_cli_server_args_of_the_harness_exit_2_before_a_run_folder(tmp_path, synthetic_small, args, flag):
    out = _run(tmp_path, synthetic_small, "--device", "cpu", "--option", f"server_args={args}")
    assert out.returncode == 2 and f"server_args: {flag} is set by" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("option, message", [
    ('server_args=["some/model", "--max-num-partial-prefills", "2"]', "server_args: 'some/model' is a positional"),
    ("server_command=vllm serve some/model", "server_command: 'some/model' is a positional"),
    ("server_args=-tp 2", "server_args: --tensor-parallel-size ('-tp' is --tensor-parallel-size to vLLM's parser) is "
                          "set by the harness's placement"),
    ("server_command=no-such-vllm serve", "server_command 'no-such-vllm serve': 'no-such-vllm' is not an executable "
                                          "on PATH or a path to one")])
def test_cli_a_model_or_placement_in_server_args_exits_2_before_a_run_folder(tmp_path, synthetic_small, option,
                                                                             message):
    out = _run(tmp_path, synthetic_small, "--device", "cpu", "--option", option)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["", " , ", [""]])
def test_an_empty_server_url_is_refused_not_taken_as_start_servers_here(value):
    with pytest.raises(ValueError, match="empty"):
        HttpOptions(urls=value)
    assert HttpOptions().urls == ()


def test_chunks_without_new_ids_are_empty_and_text_instead_of_ids_is_refused():
    from sut.core.transports import http_api as api

    assert api.parse_chunk({"choices": [{"index": 0, "text": "", "token_ids": None, "finish_reason": "length"}]}) \
        == ([], None, "length")
    assert api.parse_chunk({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 4}}}) == ([], 4, None)
    with pytest.raises(api.NoTokenIds):
        api.parse_chunk({"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]})
    with pytest.raises(api.NoTokenIds):
        api.parse_completion({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})


def test_server_side_engine_settings_that_cannot_reach_running_servers_are_named():
    from sut.engine import EngineSettings
    from sut.http_sut import server_side_settings

    assert server_side_settings(EngineSettings(model="m", max_model_len=4096)) == {}
    assert server_side_settings(EngineSettings(model="m", quantization="fp8", kv_cache_dtype="fp8")) == {
        "kv_cache_dtype": "fp8", "quantization": "fp8"}


def test_a_server_still_starting_is_killed_after_2_s_not_the_ready_grace(tmp_path, caplog):
    """SIGTERM during a harness-started `vllm serve`'s start-up took ~18 s (the 15 s grace of a
    running server); README promises what a starting local engine gets: SIGKILL 2 s after SIGTERM."""
    from sut.core.transports import http_servers
    from sut.engine import EngineSlot

    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60"], start_new_session=True)
    s = http_servers.ServerProcess(0, EngineSlot(0, "cpu", "0"), "http://127.0.0.1:1", ["x"], proc, None)
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        http_servers.end(s)
    assert time.monotonic() - t0 < 5 and proc.poll() is not None
    assert "is still starting: ending it now (SIGTERM, SIGKILL after 2 s)" in caplog.text


@pytest.mark.parametrize("ids", [[5, -5], [True, 3], [1.0], "12", [7, 2**32 + 20], [2**31]])
def test_token_ids_that_are_no_token_ids_fail_the_reply(ids):
    """An id past int32 is refused by name, whatever numpy does with it (before 2.0 it narrows 2**32 + 20 to 20, an id
    inside the vocabulary that the answer check would pass)."""
    from sut.core.transports import http_api as api

    said = r"not a list of token ids \(integers >= 0 that fit int32\)"
    with pytest.raises(api.ReplyError, match=said):
        api.parse_chunk({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": None}]})
    with pytest.raises(api.ReplyError, match=said):
        api.parse_completion({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "stop"}]})
    assert api.parse_chunk({"choices": [{"index": 0, "text": "", "token_ids": [0, 2**31 - 1]}]})[0] == [0, 2**31 - 1]


@pytest.mark.parametrize("reason, n, said", [
    ("length", 129, "the answer has 129 ids, more than max_tokens 128 (finish_reason 'length'): the server sent ids twice"),
    ("stop", 200, "the answer has 200 ids, more than max_tokens 128 (finish_reason 'stop')"),
    ("length", 3, "finish_reason 'length' after 3 ids, but max_tokens is 128 (the server's own token limit is lower"),
])
def test_too_many_ids_are_not_blamed_on_a_lower_server_limit(reason, n, said):
    """A user's server that sent the first id twice was told "the server's own token limit is lower"."""
    from sut.core.transports.http_api import ReplyError, check_finished

    with pytest.raises(ReplyError, match=re.escape(said)):
        check_finished(reason, n, 128)
    check_finished("length", 128, 128)
    check_finished("stop", 5, 128)

