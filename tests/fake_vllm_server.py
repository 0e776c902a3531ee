"""A tiny stand-in for vLLM's OpenAI-compatible server (tests only; never imported by the product).

Run as a script: ``python tests/fake_vllm_server.py --model M --port P [--host H] [faults]``; it takes
(and ignores) every other ``vllm serve`` flag, so the ``http`` transport's launcher can start it through
``HttpOptions.server_command``. Endpoints: ``/health``, ``/version``, ``/v1/models``, ``/metrics``
(``vllm:cache_config_info`` with ``enable_prefix_caching`` from ``--[no-]enable-prefix-caching``),
``/v1/completions`` (token-id prompts; streamed or not) and ``/_stats`` (what the tests check: the
request bodies, the most completions in flight at once, the client ports seen on ``/health`` and on
completions).

The "model" (deterministic): its k-th generated id is ``(prompt[0] + k) % 1000 + 10``, except that for a
prompt whose ids have an even sum it generates its EOS id ``--eos-id`` (128009) at position ``--eos-at``
(3; -1: never).
The server then behaves as ``vllm serve`` (vLLM 0.32, ``vllm/entrypoints/openai/completion/serving.py``,
``vllm/v1/core/sched/utils.py::check_stop``) for what the harness relies on:

* a sequence ends at its EOS id (unless ``ignore_eos``, or the server was started with
  ``--skip-tokenizer-init`` and so knows no EOS id) or at an id of the request's ``stop_token_ids``,
  that id included, with ``finish_reason`` ``stop`` (``stop_reason``: the stop id; None for the EOS);
  else at ``max_tokens`` with ``length``; no stop id ends a sequence before ``min_tokens`` ids (the EOS is
  masked there: the model generates its regular id instead);
* ``token_ids`` (and ``prompt_token_ids``) only with ``return_token_ids``, else ``null``;
* ``usage.prompt_tokens_details.cached_tokens`` (``--cached``, default 0) only with
  ``--enable-prompt-tokens-details``; streamed, ``usage`` only with ``stream_options.include_usage``;
* streamed: the first id at once, then chunks of ``stream_interval`` ids (the request's, default 1),
  ``finish_reason`` on the last chunk with ids; an error during generation is the chunk
  ``{"error": {"message", "type", "param", "code"}}`` then ``[DONE]``; non-streamed, HTTP 500 with that body.

``--api-key KEY`` (as ``vllm serve --api-key``): every ``/v1/*`` request without ``Authorization: Bearer KEY``
gets HTTP 401 ``{"error": "Unauthorized"}``; ``/_stats`` counts, per path, the requests that carried the key
and those that did not (``auth``). ``--version V`` (``/version``), ``--dtype``, ``--quantization`` (in
``/server_info``), ``--kv-cache-dtype`` and ``--block-size`` (in ``/metrics`` and ``/server_info``) set what
the server reports about its engine.

``--disable-log-stats`` leaves ``vllm:cache_config_info`` out of ``/metrics`` (as vLLM 0.32 does).

Faults: ``--text-only`` (no ``token_ids`` even when asked: a server that returns text), ``--no-metrics`` (no
``/metrics``), ``--metrics-prefix-caching True|False`` (what ``/metrics`` reports, whatever the flags),
``--fail-start`` (exit 3 at once with a message), ``--delay S`` (seconds per completion),
``--served-model-name`` (serve another id); ``--server-info`` (answer ``/server_info`` as vLLM's dev
mode does, with ``max_num_seqs`` 64); ``--max-new-tokens`` (the server's own lower token limit);
``--finish R`` (every answer ends with finish_reason R; ``none``: a stream of the first chunk, then
``[DONE]``); ``--error-after N`` (the error above after N generated ids: streamed, after the chunks of the
first N ids, or of all when N is at least the answer's length; non-streamed, when the answer has more); ``--truncate N`` (a broken server or proxy: ``stop`` after N
ids, no EOS); ``--swap-after N`` (after N completion requests, ``/metrics`` reads as another server's: a later
process start time and prefix caching on, as a server restarted behind the URL between two ``/health`` polls);
``--mixup`` (a broken proxy: every completion
but the start-up probe gets the previous one's reply, its prompt ids included); ``--splice`` (a broken proxy:
every stream but the first sends its own first chunk, its prompt ids included, then the previous stream's later chunks,
under that reply's ``id``, and its ``usage``); ``--start-time T`` (``/metrics``
reports T as the process start time: two servers started at once); ``--no-request-count`` (no
``vllm:request_success_total`` in ``/metrics``); ``--usage none|float`` (no ``usage``
at all, or ``completion_tokens`` one more than the ids, as a float); ``--dup-first-chunk`` (a broken proxy: in answers of 2 ids up to max_tokens - 1, the first streamed chunk is
sent twice, non-streamed the first id comes twice; ``usage.completion_tokens`` still counts what was generated); ``--bad-id ID`` (the id at position 1
of every answer is ID, e.g. one outside the vocabulary); ``--no-stop`` (a server that ignores the EOS and stop ids
it was given: answers run to ``max_tokens`` with the ``--eos-at`` EOS inside); ``--eos-anyway`` (the ``--eos-at`` EOS
comes before ``min_tokens`` too: a server that does not mask stop ids); ``--echo-auth`` (every error reply's message carries the
request's ``Authorization`` header, as a proxy's error page that echoes the request); ``--redirect-to URL`` (every
GET but ``/_stats`` and ``/health`` answers 307 to URL + its path: a server that sends clients, and their headers,
elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Optional

from aiohttp import web


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--text-only", action="store_true")
    p.add_argument("--no-metrics", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--metrics-prefix-caching", choices=("True", "False"), default=None)
    p.add_argument("--fail-start", action="store_true")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--cached", type=int, default=0)
    p.add_argument("--server-info", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="the server's own token limit (as vLLM's --override-generation-config max_new_tokens)")
    p.add_argument("--finish", default=None,
                   help="finish_reason of every answer; 'none': a stream of the first chunk, then [DONE]")
    p.add_argument("--eos-id", type=int, default=128009)
    p.add_argument("--eos-at", type=int, default=3)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--error-after", type=int, default=None)
    p.add_argument("--truncate", type=int, default=None)
    p.add_argument("--dup-first-chunk", action="store_true")
    p.add_argument("--mixup", action="store_true",
                   help="every completion but the probe (prompt [0]) gets the previous one's reply, prompt ids included")
    p.add_argument("--splice", action="store_true",
                   help="streamed: after its own first chunk, every answer goes on with the previous one's chunks")
    p.add_argument("--usage", choices=("count", "none", "float"), default="count",
                   help="usage.completion_tokens: the count; none: no usage at all; float: the count + 1 as a float")
    p.add_argument("--swap-after", type=int, default=None)
    p.add_argument("--bad-id", type=int, default=None)
    p.add_argument("--no-stop", action="store_true", help="never stop at an EOS or stop id")
    p.add_argument("--eos-anyway", action="store_true", help="the --eos-at EOS comes before min_tokens too")
    p.add_argument("--api-key", default=None)
    p.add_argument("--redirect-to", default=None,
                   help="answer every GET but /_stats and /health with 307 to this URL + the path")
    p.add_argument("--redirect-posts", action="store_true",
                   help="with --redirect-to, answer POSTs (completions) with 307 too")
    p.add_argument("--echo-auth", action="store_true",
                   help="every error reply's message carries the request's Authorization header (a proxy that echoes)")
    p.add_argument("--version", default="0.0.0-fake")
    p.add_argument("--no-request-count", action="store_true", help="no vllm:request_success_total in /metrics")
    p.add_argument("--start-time", type=float, default=None,
                   help="process_start_time_seconds to report (default: when it started)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--load-format", default="auto")
    a, _unknown = p.parse_known_args(argv)
    return a


class Fake:
    def __init__(self, a):
        self.a = a
        self.model_id = a.served_model_name or a.model
        self.started = time.time() if a.start_time is None else a.start_time  # /metrics process_start_time_seconds
        self.finished = 0  # /metrics vllm:request_success_total
        self.bodies: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.health_ports: set[int] = set()
        self.completion_ports: set[int] = set()
        self.auth: dict[str, list[int]] = {}  # path -> [requests with the key, requests without]
        self.held = None  # --mixup: the previous completion's (prompt, reply)
        self.spliced = None  # --splice: the previous stream's (reply id, ids, finish_reason, stop_reason)

    @web.middleware
    async def check_key(self, request, handler):
        """Count whether each request carried the key; refuse ``/v1/*`` without it (as ``vllm serve --api-key``)."""
        carried = self.a.api_key is not None and request.headers.get("Authorization") == f"Bearer {self.a.api_key}"
        if request.path != "/_stats":
            self.auth.setdefault(request.path, [0, 0])[0 if carried else 1] += 1
        redirected = ("GET", "POST") if self.a.redirect_posts else ("GET",)
        if self.a.redirect_to and request.method in redirected and request.path not in ("/_stats", "/health") \
                and not (request.method == "GET" and self.a.redirect_posts):
            raise web.HTTPTemporaryRedirect(self.a.redirect_to + request.path_qs)
        if self.a.api_key is not None and request.path.startswith("/v1") and not carried:
            return web.json_response({"error": "Unauthorized" + self._echo(request)}, status=401)
        return await handler(request)

    @staticmethod
    def _port(request) -> int:
        return request.transport.get_extra_info("peername")[1]

    async def health(self, request):
        self.health_ports.add(self._port(request))
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": self.a.version})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "root": self.a.model, "max_model_len": self.a.max_model_len}]})

    async def metrics(self, request):
        if self.a.no_metrics:
            return web.Response(status=404)
        if self.a.disable_log_stats:
            return web.Response(text="# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n", content_type="text/plain")
        epc = self.a.metrics_prefix_caching or ("True" if self.a.enable_prefix_caching else "False")
        swapped = self.a.swap_after is not None and len(self.bodies) >= self.a.swap_after
        epc, started = ("True", self.started + 60) if swapped else (epc, self.started)
        text = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{self.a.block_size}",cache_dtype="{self.a.kv_cache_dtype}",'
                f'enable_prefix_caching="{epc}",engine="0",'
                'gpu_memory_utilization="0.9",kv_cache_size_tokens="8192",num_gpu_blocks="512"} 1.0\n'
                "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
                "# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {started:.2f}\n")
        if not self.a.no_request_count:
            text += ("# HELP vllm:request_success_total Count of successfully processed requests.\n"
                     "# TYPE vllm:request_success_total counter\n"
                     f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{self.model_id}"}} '
                     f"{float(self.finished)}\n")
        return web.Response(text=text, content_type="text/plain")

    async def server_info(self, request):
        if not self.a.server_info:
            return web.Response(status=404)
        cfg = {"model_config": {"model": self.a.model, "dtype": f"torch.{self.a.dtype}",
                                "max_model_len": self.a.max_model_len, "enforce_eager": True, "seed": 0,
                                "quantization": self.a.quantization},
               "cache_config": {"enable_prefix_caching": self.a.enable_prefix_caching, "block_size": self.a.block_size,
                                "num_gpu_blocks": 512, "cache_dtype": self.a.kv_cache_dtype},
               "scheduler_config": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
               "load_config": {"load_format": self.a.load_format}}
        return web.json_response({"vllm_config": cfg, "vllm_env": {}, "system_env": {}})

    async def stats(self, request):
        return web.json_response({"bodies": self.bodies, "max_inflight": self.max_inflight,
                                  "health_ports": sorted(self.health_ports),
                                  "completion_ports": sorted(self.completion_ports), "auth": self.auth})

    def generate(self, prompt: list, body: dict) -> tuple[list, str, object]:
        """``(generated ids, finish_reason, stop_reason)`` as ``vllm serve`` ends a sequence (module docstring)."""
        a = self.a
        most = min(int(body.get("max_tokens", 16)), a.max_new_tokens or 1 << 30)
        least = int(body.get("min_tokens") or 0)
        stops = set(body.get("stop_token_ids") or ())
        eos = None if (body.get("ignore_eos") or a.skip_tokenizer_init) else a.eos_id
        ids = []
        for k in range(most):
            tok = (prompt[0] + k) % 1000 + 10
            if a.eos_at >= 0 and sum(prompt) % 2 == 0 and k == a.eos_at and (k >= least or a.eos_anyway):  # min_tokens masks stop ids
                tok = a.eos_id
            if k == 1 and a.bad_id is not None:
                tok = a.bad_id
            ids.append(tok)
            if k >= least and not a.no_stop and (tok == eos or tok in stops):  # vLLM: its EOS first (stop_reason None), then a stop id
                return ids, "stop", (None if tok == eos else tok)
            if a.truncate is not None and len(ids) >= a.truncate:
                return ids, "stop", None
        return ids, "length", None

    def _choice(self, ids, finish, body, stop_reason=None, prompt=None):
        wanted = bool(body.get("return_token_ids")) and not self.a.text_only
        ch = {"index": 0, "text": "", "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": ids if wanted else None}
        if prompt is not None:
            ch["prompt_token_ids"] = prompt if wanted else None
        return ch

    def _dup(self, ids, body) -> bool:
        """``--dup-first-chunk`` applies to this answer (2 ids up to max_tokens - 1: the start-up probe of one id
        passes, and an answer at max_tokens would be refused for its length before its count is compared)."""
        return self.a.dup_first_chunk and 1 < len(ids) < int(body.get("max_tokens", 16))

    def _usage(self, prompt, ids, body) -> Optional[dict]:
        n = len(ids)
        if self.a.usage == "none":
            return None
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n if self.a.usage == "count" else n + 1.0,
                 "total_tokens": len(prompt) + n}
        if self.a.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.a.cached}
        return usage

    def _echo(self, request) -> str:
        """With ``--echo-auth``: the request's Authorization header, as an error message would quote it."""
        return f" (request Authorization: {request.headers.get('Authorization')})" if self.a.echo_auth else ""

    def _error_body(self, request) -> dict:
        return {"error": {"message": "Internal server error" + self._echo(request), "type": "InternalServerError",
                          "param": None, "code": 500}}

    async def completions(self, request):
        body = await request.json()
        if body.get("model") != self.model_id:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": None, "code": 404}}, status=404)
        self.completion_ports.add(self._port(request))
        self.bodies.append(body)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            prompt = body["prompt"]
            ids, finish, stop_reason = self.generate(prompt, body)
            if self.a.mixup and prompt != [0]:  # a proxy that hands each reply to the next request
                (prompt, ids, finish, stop_reason), self.held = self.held or (prompt, ids, finish, stop_reason), \
                    (prompt, ids, finish, stop_reason)
            finish = finish if self.a.finish is None else (None if self.a.finish == "none" else self.a.finish)
            if not body.get("stream"):
                await asyncio.sleep(self.a.delay)
                if self.a.error_after is not None and len(ids) > self.a.error_after:
                    return web.json_response(self._error_body(request), status=500)
                sent = ids[:1] + ids if self._dup(ids, body) else ids
                reply = {"id": "cmpl-fake", "object": "text_completion", "model": self.model_id,
                         "choices": [self._choice(sent, finish, body, stop_reason, prompt)]}
                if (usage := self._usage(prompt, ids, body)) is not None:
                    reply["usage"] = usage
                return web.json_response(reply)
            return await self._stream(request, body, prompt, *self._splice(prompt, ids, finish, stop_reason))
        finally:
            self.inflight -= 1
            self.finished += 1

    def _splice(self, prompt, ids, finish, stop_reason) -> tuple:
        """``(ids, finish_reason, stop_reason, (reply id of the first chunk, of the later ones))`` to stream: this
        answer's, or with ``--splice`` its first id then the previous stream's later ones (module docstring)."""
        own = f"cmpl-fake-{len(self.bodies)}"
        if not self.a.splice or prompt == [0]:
            return ids, finish, stop_reason, (own, own)
        held, self.spliced = self.spliced, (own, ids, finish, stop_reason)
        if held is None:
            return ids, finish, stop_reason, (own, own)
        return ids[:1] + held[1][1:], held[2], held[3], (own, held[0])

    async def _stream(self, request, body, prompt, ids, finish, stop_reason, reply_ids=("cmpl-fake", "cmpl-fake")):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data) -> None:
            await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        step = max(1, int(body.get("stream_interval") or 1))
        bounds = [0, 1] if self.a.finish == "none" else sorted({0, min(1, len(ids)), len(ids), *range(1, len(ids), step)})
        for n, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if self.a.error_after is not None and lo >= self.a.error_after:
                break
            last = hi == len(ids) and self.a.finish != "none"
            for _ in range(2 if n == 0 and self._dup(ids, body) else 1):
                await send({"id": reply_ids[min(n, 1)], "object": "text_completion",
                            "model": self.model_id, "choices": [self._choice(ids[lo:hi], finish if last else None, body,
                                                     stop_reason if last else None, prompt if n == 0 else None)]})
            if n == 0:
                await asyncio.sleep(self.a.delay)
        if self.a.error_after is not None:
            await send(self._error_body(request))
        elif (body.get("stream_options") or {}).get("include_usage") and self.a.usage != "none":
            await send({"id": reply_ids[1], "object": "text_completion", "model": self.model_id, "choices": [],
                        "usage": self._usage(prompt, ids, body)})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def main(argv=None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.fail_start:
        print("fake server: refusing to start (--fail-start)", flush=True)
        sys.exit(3)
    f = Fake(a)
    app = web.Application(middlewares=[f.check_key])
    app.add_routes([web.get("/health", f.health), web.get("/version", f.version), web.get("/v1/models", f.models),
                    web.get("/metrics", f.metrics), web.get("/_stats", f.stats),
                    web.get("/server_info", f.server_info),
                    web.post("/v1/completions", f.completions)])
    print(f"fake vLLM server for {f.model_id} on {a.host}:{a.port}", flush=True)
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
