"""A tiny stand-in for vLLM's OpenAI-compatible server (tests only; never imported by the product).

Run as a script: ``python tests/fake_vllm_server.py --model M --port P [--host H] [faults]``; it takes
(and ignores) every other ``vllm serve`` flag, so the ``http`` transport's launcher can start it through
``HttpOptions.server_command``. Endpoints: ``/health``, ``/version``, ``/v1/models``, ``/metrics``
(``vllm:cache_config_info`` with ``enable_prefix_caching`` from ``--[no-]enable-prefix-caching``),
``/v1/completions`` (token-id prompts; streamed or not) and ``/_stats`` (what the tests check: the
request bodies, the most completions in flight at once, the client ports seen on ``/health`` and on
completions).

Output ids are deterministic: the k-th generated id is ``(prompt[0] + k) % 1000 + 10`` for
k < ``max_tokens``; ``usage.prompt_tokens_details.cached_tokens`` is ``--cached``.

``--disable-log-stats`` leaves ``vllm:cache_config_info`` out of ``/metrics`` (as vLLM 0.32 does).

Faults: ``--text-only`` (no ``token_ids``: a server that returns text), ``--no-metrics`` (no
``/metrics``), ``--metrics-prefix-caching True|False`` (what ``/metrics`` reports, whatever the flags),
``--fail-start`` (exit 3 at once with a message), ``--delay S`` (seconds per completion),
``--served-model-name`` (serve another id); ``--server-info`` (answer ``/server_info`` as vLLM's dev
mode does, with ``max_num_seqs`` 64).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

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
    p.add_argument("--finish", default="length",
                   help="finish_reason of the last chunk / reply; 'none': a stream of the first chunk, then [DONE]")
    a, _unknown = p.parse_known_args(argv)
    return a


class Fake:
    def __init__(self, a):
        self.a = a
        self.model_id = a.served_model_name or a.model
        self.bodies: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.health_ports: set[int] = set()
        self.completion_ports: set[int] = set()

    @staticmethod
    def _port(request) -> int:
        return request.transport.get_extra_info("peername")[1]

    async def health(self, request):
        self.health_ports.add(self._port(request))
        return web.Response(status=200)

    async def version(self, request):
        return web.json_response({"version": "0.0.0-fake"})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "root": self.a.model, "max_model_len": self.a.max_model_len}]})

    async def metrics(self, request):
        if self.a.no_metrics:
            return web.Response(status=404)
        if self.a.disable_log_stats:
            return web.Response(text="# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n", content_type="text/plain")
        epc = self.a.metrics_prefix_caching or ("True" if self.a.enable_prefix_caching else "False")
        text = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="{epc}",engine="0",'
                'gpu_memory_utilization="0.9",kv_cache_size_tokens="8192",num_gpu_blocks="512"} 1.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def server_info(self, request):
        if not self.a.server_info:
            return web.Response(status=404)
        cfg = {"model_config": {"model": self.a.model, "dtype": "torch.float32", "max_model_len": self.a.max_model_len,
                                "enforce_eager": True, "seed": 0},
               "cache_config": {"enable_prefix_caching": self.a.enable_prefix_caching, "block_size": 16,
                                "num_gpu_blocks": 512},
               "scheduler_config": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}, "load_config": {}}
        return web.json_response({"vllm_config": cfg, "vllm_env": {}, "system_env": {}})

    async def stats(self, request):
        return web.json_response({"bodies": self.bodies, "max_inflight": self.max_inflight,
                                  "health_ports": sorted(self.health_ports),
                                  "completion_ports": sorted(self.completion_ports)})

    @property
    def _finish(self):
        return None if self.a.finish == "none" else self.a.finish

    def _choice(self, ids, finish):
        ch = {"index": 0, "text": "", "finish_reason": finish}
        if not self.a.text_only:
            ch["token_ids"] = ids
        return ch

    async def completions(self, request):
        body = await request.json()
        if body.get("model") != self.model_id:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "code": 404}}, status=404)
        self.completion_ports.add(self._port(request))
        self.bodies.append(body)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            prompt = body["prompt"]
            n = min(body.get("max_tokens", 16), self.a.max_new_tokens or 1 << 30)
            ids = [(prompt[0] + k) % 1000 + 10 for k in range(n)]
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                     "prompt_tokens_details": {"cached_tokens": self.a.cached}}
            if not body.get("stream"):
                await asyncio.sleep(self.a.delay)
                return web.json_response({"id": "cmpl-fake", "object": "text_completion", "model": self.model_id,
                                          "choices": [self._choice(ids, self._finish)], "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps({"choices": [self._choice(ids[:1], None)]}).encode() + b"\n\n")
            await asyncio.sleep(self.a.delay)
            if self._finish is not None:
                await resp.write(b"data: " + json.dumps({"choices": [self._choice(ids[1:], self._finish)]}).encode()
                                 + b"\n\n")
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.inflight -= 1


def main(argv=None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.fail_start:
        print("fake server: refusing to start (--fail-start)", flush=True)
        sys.exit(3)
    f = Fake(a)
    app = web.Application()
    app.add_routes([web.get("/health", f.health), web.get("/version", f.version), web.get("/v1/models", f.models),
                    web.get("/metrics", f.metrics), web.get("/_stats", f.stats),
                    web.get("/server_info", f.server_info),
                    web.post("/v1/completions", f.completions)])
    print(f"fake vLLM server for {f.model_id} on {a.host}:{a.port}", flush=True)
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
