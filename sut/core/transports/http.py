"""The ``http`` transport: vLLM OpenAI-compatible servers (``vllm serve``), given as URLs or started here.

Replicas: one per URL of ``HttpOptions.urls``; without URLs, one server per engine slot started on
this host (``http_servers``: one per visible GPU, one on a CPU host; bound to 127.0.0.1, ended with the
run). Wire format: ``http_api``; what a server reports about itself: ``http_readback``.

Algorithm
---------
One asyncio event loop on one thread ("vllm-http-client") owns one ``aiohttp.ClientSession`` for every
replica. ``start`` (blocking) starts the servers and waits for ``/health``, then per replica reads
``/version``, ``/v1/models`` (the served model must be ``--model``: ``http_readback.pick_model``; its
``max_model_len`` must cover the engine's), ``/metrics`` (prefix caching read back, with a started
server's launch arguments: ``http_readback``) and ``/server_info`` where the server offers it, sends
one 1-token probe completion (a server that returns text instead of ids fails here), and opens
``max_inflight_per_replica`` keep-alive connections (concurrent ``/health`` requests) before it
returns: the client and its connections exist before the first query (the study had to drop a
score distorted by concurrent client start-up). Then each replica gets a FIFO queue and
``max_inflight_per_replica`` worker coroutines (default 2 x ``max_num_seqs``): ``submit`` puts
requests on the queue (it never blocks), a worker sends one request at a time, so an Offline query
of 13,368 samples keeps at most that many requests (and sockets) per replica in flight and queues
the rest.

A request is one ``POST /v1/completions``; streamed (``spec.stream``, Server/Interactive, or
``spec.detail``, for first-token times) its first chunk with ids becomes a ``FirstToken`` at once.
A request that cannot get a connection at all (a keep-alive connection the server closed) is sent
once more; any other failure (HTTP error, broken stream, no ids) fails the run: one ``FatalEvent``
naming the replica and URL (for a server started here: how its process ended, with its log's last
lines). A monitor polls every replica's ``/health`` every ``health_interval_s`` (a server that is gone
fails the run within seconds even while nothing is in flight); a watcher thread per started server
reports its exit at once. ``stop`` cancels every request, closes the session and ends every server's
process group.

A server of ``--fleet`` with an ``api_key_env`` gets ``Authorization: Bearer <key>`` on every request
(``http_fleet``: read-back, probe, completions, ``/health``, ``/metrics``); the key is never recorded or
logged (``run.json`` ``engines[]``: ``node``, ``gpu``, ``api_key_env``, ``api_key: "set"``). Once every replica
is read back, their records must agree on the fields that change results (``http_fleet.fleet_agreement``:
model, max_model_len, dtype, quantization, kv-cache dtype, vLLM version, prefix caching, block size; unknown
where a server does not report one), recorded in ``stats()["http"]["agreement"]``.

A URL whose host is not this host's loopback is warned about at ``start`` (console) and recorded per replica in
``stats()["http"]["exposure"]`` (``server_exposure``): the harness cannot see how such a server is fenced.

Errors: a URL that does not answer, refuses its key, serves another model or another engine than the
other servers is the user's input:
``ServerInputError`` (an ``InputError`` and a ``TransportError``: the CLI exits 2); a server that
cannot start, returns text instead of ids, or dies is a ``TransportError`` (exit 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Optional, Sequence

import aiohttp
import numpy as np

from sut.core.exposure import exposure
from sut.core.transport import Transport, TransportSpec, register_transport
from sut.core.transports import http_api as api
from sut.core.transports import http_fleet as fleet
from sut.core.transports import http_readback as readback
from sut.core.transports import http_servers as servers
from sut.core.transports.http_options import HttpOptions
from sut.engine import plan_engines
from sut.errors import EngineError, ServerInputError, TransportError
from sut.messages import Completion, FirstToken, ReplicaRecord, Request

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0  # read-back requests and the probe completion
HEALTH_TIMEOUT_S = 30.0  # a /health answer slower than this fails the run
CONNECT_TIMEOUT_S = 30.0
END_CHECK_TIMEOUT_S = 4 * PROBE_TIMEOUT_S + 10  # a replica's read-back after the run: its four GETs, each timed
_JSON = {"Content-Type": "application/json"}


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, api.ReplyError) else f"{type(e).__name__}: {text}"


#: What whoever reaches a ``vllm serve`` server can do (``sut.core.exposure``).
SERVER_RISK = "a vLLM server serves whoever reaches it unless it was started with --api-key"


def server_exposure(url: str) -> dict:
    """``sut.core.exposure.exposure`` of a server URL (a warning, also logged, when its host is not loopback,
    https or not: TLS does not keep others out of a vLLM server)."""
    rec = exposure(url, "vllm-http server", SERVER_RISK, tls_fences=False)
    if rec["warning"]:
        log.warning("%s", rec["warning"])
    return rec


@register_transport("http")
class HttpTransport(Transport):
    """vLLM OpenAI-compatible servers behind the ``Transport`` interface (module docstring).

    Raises ``ServerInputError`` at construction when servers are to be started here and the engines
    cannot be placed (``--device cuda`` without a GPU), or ``server_args`` gives an engine setting's flag.
    """

    options_cls = HttpOptions

    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.options: HttpOptions = spec.options or HttpOptions()
        try:
            servers.check_server_args(self.options.server_args, spec.engine, self.options.server_command)
            self.slots = [] if self.options.servers else plan_engines(spec.engine)
            keys = [fleet.api_key(s) for s in self.options.servers] or [None] * len(self.slots)
        except (EngineError, ValueError) as e:
            raise ServerInputError(str(e)) from None
        self.urls = list(self.options.server_urls) or [""] * len(self.slots)
        self._auth = [fleet.auth_headers(k) for k in keys]  # per replica; a key is sent, never recorded
        self._keys = tuple(k for k in keys if k)  # hidden in every message (a server's reply may quote them)
        self._post_headers = [{**_JSON, **a} for a in self._auth]
        self.agreement: dict = {}  # http_fleet.fleet_agreement of the replicas (set by start)
        self.inflight = self.options.max_inflight_per_replica or 2 * spec.engine.max_num_seqs
        self.stream = spec.stream or spec.detail
        self.servers: list[servers.ServerProcess] = []
        self.samples = [0] * len(self.urls)
        self.retries = 0
        self._dead = [False] * len(self.urls)  # under self._lock, as samples and retries
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._queues: list[asyncio.Queue] = []
        self._tasks: list[asyncio.Task] = []
        self._bases: list[dict] = [{} for _ in self.urls]  # per replica: model + sampling fields
        self.exposure: list[dict] = []  # per replica: server_exposure of its URL (set by start)

    @property
    def replicas(self) -> int:
        return len(self.urls)

    def _name(self, r: int) -> str:
        return f"vllm-http replica {r} ({self.urls[r]})"

    # -- start ----------------------------------------------------------------------------------
    def start(self, sink) -> list[ReplicaRecord]:
        """Start or reach every server, read each back, open the connections; ``TransportError`` /
        ``ServerInputError`` (nothing left running)."""
        self.check_prefix_caching_setting()
        self.sink = sink
        try:
            if self.slots:
                self._start_servers()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-http-client", daemon=True)
            self._thread.start()
            self.exposure = [server_exposure(u) for u in self.urls]
            infos = self._call(self._connect_all())
            self.agreement = self._agree(infos)
            self.records = [ReplicaRecord(r, info) for r, info in enumerate(infos)]
            self._call(self._start_workers())
        except BaseException:
            self.stop()
            raise
        return self.records

    def end_check(self) -> Optional[str]:
        """After LoadGen's last answer: read every live replica back again (``/version``, ``/v1/models``,
        ``/metrics``, ``/server_info``) and compare with its start record (``http_readback.identity_changes``:
        model, version, prefix caching, engine arguments, KV cache, process start time). Returns why the run's
        answers cannot all be from the servers it read back (a server restarted or replaced behind its URL, e.g.
        with prefix caching on), or None. The ``/health`` poll sees only a restart slower than its interval."""
        if self._loop is None or not self.records:
            return None
        for r, rec in enumerate(self.records):
            if self._dead[r]:
                continue
            try:
                now = self._call(self._reread(r), timeout=END_CHECK_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a replica that cannot be read back now cannot vouch for the run
                return f"{self._name(r)} could not be read back after the run: {_describe(e)}"
            changed = readback.identity_changes(rec.info, now)
            if changed:
                return (f"{self._name(r)} is not the server read back at the start (restarted or replaced during "
                        f"the run): {'; '.join(changed)}")
        return None

    async def _version_and_models(self, r: int) -> tuple:
        """Replica ``r``'s ``/version`` body, ``/v1/models`` body and that body's ``data`` list (None: not a list
        of a dict body). Raises what ``_get`` raises."""
        version = await self._get(r, "/version")
        models = await self._get(r, "/v1/models")
        return version, models, ((models or {}).get("data") if isinstance(models, dict) else None)

    async def _reread(self, r: int) -> dict:
        version, _, listed = await self._version_and_models(r)
        model = self._bases[r]["model"]
        served = next((m for m in listed or [] if isinstance(m, dict) and str(m.get("id")) == model), None)
        if served is None:
            raise api.ReplyError(f"{self.urls[r]}/v1/models no longer lists {model!r}")
        return await self._read_back(r, served, version)

    def _start_servers(self) -> None:
        try:
            prefix = servers.launcher(self.options.server_command)
            for i, slot in enumerate(self.slots):
                s = servers.launch(i, slot, self.spec.engine, prefix, self.spec.log_dir, self.options.server_log_stats,
                                   self.options.server_args)
                self.servers.append(s)
                self.urls[i] = s.url
                servers.watch(s, self._on_server_exit)
            servers.wait_ready(self.servers, self.options.server_start_timeout_s)
        except OSError as e:
            raise TransportError(f"vllm-http server {len(self.servers)} could not be started: {e}") from None
        except (RuntimeError, EngineError) as e:
            raise TransportError(str(e)) from None

    def _agree(self, infos: list[dict]) -> dict:
        """``http_fleet.fleet_agreement`` of the replicas' records; servers that differ: ``ServerInputError``
        (given servers) or ``TransportError`` (started here)."""
        try:
            return fleet.fleet_agreement(infos)
        except ValueError as e:
            cls = ServerInputError if self.options.servers else TransportError
            raise cls(fleet.redact(f"vllm-http: {e}", self._keys)) from None

    def _on_server_exit(self, server: servers.ServerProcess) -> None:
        if self.records:  # during start-up, wait_ready reports it
            self._fatal(server.index, server.exit_message())

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect_all(self) -> list[dict]:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=servers.KEEP_ALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S), read_bufsize=1 << 22)
        tasks = [asyncio.create_task(self._connect(r)) for r in range(self.replicas)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:  # the first failure wins; the others stop
            if t.done() and t.exception() is not None:
                for other in tasks:
                    other.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise t.exception()
        return [t.result() for t in tasks]

    def _error(self, r: int, what: str, user_input: bool) -> TransportError:
        cls = ServerInputError if user_input and self.options.servers else TransportError
        return cls(fleet.redact(f"{self._name(r)} {what}", self._keys))

    def _status(self, r: int, resp) -> str:
        """``http_fleet.status_text`` of replica ``r``'s reply ``resp`` (a given server sent no key: say so)."""
        key_sent = bool(self._auth[r]) or not self.options.servers
        return fleet.status_text(resp.status, key_sent, resp.headers.get("Location"))

    async def _get(self, r: int, path: str, as_json: bool = True):
        """GET ``path`` of replica ``r`` (with its key): the decoded body, or None on 404 (no such endpoint)."""
        url = f"{self.urls[r]}{path}"
        try:
            async with self._http_get(url, headers=self._auth[r],
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise api.ReplyError(f"GET {url}: {self._status(r, resp)}: "
                                         f"{await _text_capped(resp, 300, self._keys)}")
                text = (await _read_capped(resp, api.MAX_REPLY_BYTES)).decode("utf-8", "replace")
        except asyncio.TimeoutError:  # aiohttp's timeout says nothing itself
            raise api.ReplyError(f"GET {url}: no complete answer within {PROBE_TIMEOUT_S:g} s") from None
        return json.loads(text) if as_json else text

    def _http_get(self, url, **kw):
        """The session's GET without following redirects (a key must not go where a redirect points)."""
        return self._session.get(url, allow_redirects=False, **kw)

    def _http_post(self, url, **kw):
        """The session's POST without following redirects (as ``_http_get``)."""
        return self._session.post(url, allow_redirects=False, **kw)

    async def _connect(self, r: int) -> dict:
        url = self.urls[r]
        try:
            version, models, listed = await self._version_and_models(r)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, api.ReplyError) as e:
            raise self._error(r, f"does not answer: {_describe(e)}", user_input=True) from None
        if not isinstance(listed, list) or not listed:
            raise self._error(r, f"lists no model at {url}/v1/models: {str(models)[:200]}", user_input=True)
        try:
            model = readback.pick_model(listed, self.spec.engine.model, self.options.model_name)
        except ValueError as e:
            raise self._error(r, str(e), user_input=True) from None
        served = next(m for m in listed if str(m.get("id")) == model)
        max_len = served.get("max_model_len")
        if isinstance(max_len, int) and max_len < self.spec.engine.max_model_len:
            raise self._error(r, f"serves max_model_len {max_len} < --max-model-len {self.spec.engine.max_model_len} "
                              f"(the dataset was checked against the latter; pass --max-model-len {max_len})",
                              user_input=True)
        self._bases[r] = dict(api.sampling_body(self.spec.generation), model=model)
        await self._probe(r)
        info = await self._read_back(r, served, version)
        try:  # open the pool's connections now, not on the first timed request
            await asyncio.gather(*(self._ping(r) for _ in range(self.inflight)))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise self._error(r, f"cannot open {self.inflight} connections: {_describe(e)}", user_input=False) from None
        return info

    async def _probe(self, r: int) -> None:
        """One 1-token completion: the server must answer with token ids, the prompt ids it answered and its own
        count of generated tokens (the checks every answer of the run gets)."""
        body = json.dumps(dict(self._bases[r], prompt=[0], max_tokens=1, min_tokens=1)).encode()
        try:
            async with self._http_post(f"{self.urls[r]}/v1/completions", data=body, headers=self._post_headers[r],
                                          timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                text = (await _read_capped(resp, api.MAX_REPLY_BYTES)).decode("utf-8", "replace")
                if resp.status != 200:
                    raise api.ReplyError(f"{self._status(r, resp)}: {fleet.redact_cut(text, self._keys, 300)}")
            data = json.loads(text)
            ids, _, _ = api.parse_completion(data)
            api.check_prompt(api.reply_prompt(data), [0], required=True)
            api.check_count(api.completion_tokens(data), len(ids))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, api.ReplyError) as e:
            raise self._error(r, f"probe completion failed: {_describe(e)}", user_input=False) from None
        if len(ids) != 1:
            raise self._error(r, f"probe completion returned {len(ids)} ids for max_tokens 1", user_input=False)

    async def _read_back(self, r: int, served: dict, version) -> dict:
        """The replica's record (``http_readback.replica_record``) from ``/metrics`` and ``/server_info``
        where the server offers them, with where it runs (``http_fleet.placement``: node, GPU, key variable)."""
        url = self.urls[r]
        got = []
        for path, as_json in (("/metrics", False), ("/server_info?config_format=json", True)):
            try:
                got.append(await self._get(r, path, as_json=as_json))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, api.ReplyError):
                got.append(None)
        try:
            info = readback.replica_record(r, url, served, version, got[0], got[1], self.spec.engine,
                                           self.servers[r] if self.servers else None)
        except api.ReplyError as e:
            raise self._error(r, f"read-back failed: {e}", user_input=False) from None
        given = self.options.servers[r] if self.options.servers else None
        return dict(info, **fleet.placement(given, url))

    async def _ping(self, r: int) -> None:
        async with self._http_get(f"{self.urls[r]}/health", headers=self._auth[r],
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            await _read_capped(resp, api.MAX_REPLY_BYTES)

    async def _start_workers(self) -> None:
        self._queues = [asyncio.Queue() for _ in range(self.replicas)]
        self._tasks = [asyncio.create_task(self._worker(r)) for r in range(self.replicas) for _ in range(self.inflight)]
        self._tasks.append(asyncio.create_task(self._monitor()))

    # -- requests -------------------------------------------------------------------------------
    def submit(self, replica: int, requests: Sequence[Request]) -> None:
        if self._stopped or self._dead[replica] or self._loop is None:
            raise TransportError(f"{self._name(replica)} is gone")
        try:
            self._loop.call_soon_threadsafe(self._enqueue, replica, list(requests))
        except RuntimeError:  # the loop was closed meanwhile
            raise TransportError(f"{self._name(replica)} is gone") from None

    def _enqueue(self, replica: int, requests: list[Request]) -> None:
        q = self._queues[replica]
        for req in requests:
            q.put_nowait(req)

    async def _worker(self, r: int) -> None:
        q = self._queues[r]
        while True:
            req = await q.get()
            try:
                c = await self._complete(r, req)
                with self._lock:
                    self.samples[r] += 1
                self.sink.on_results(r, [c])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure fails the run, naming the replica
                await self._failed(r, f"request {req.rid} failed: {_describe(e)}", e, rid=req.rid)
                return

    async def _send(self, r: int, body: bytes) -> aiohttp.ClientResponse:
        """POST a completion, once more if no connection could be used at all (a keep-alive
        connection the server had closed)."""
        try:
            return await self._http_post(f"{self.urls[r]}/v1/completions", data=body, headers=self._post_headers[r])
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            with self._lock:
                self.retries += 1
            return await self._http_post(f"{self.urls[r]}/v1/completions", data=body, headers=self._post_headers[r])

    async def _complete(self, r: int, req: Request) -> Completion:
        t0 = time.monotonic()
        resp = await self._send(r, api.request_body(self._bases[r], req.prompt, self.stream))
        try:
            if resp.status != 200:
                raise api.ReplyError(f"{self._status(r, resp)}: {await _text_capped(resp, 500, self._keys)}")
            if self.stream:
                ids, cached, t_first = await self._read_stream(r, req, resp)
            else:
                data = json.loads(await _read_capped(resp, api.MAX_REPLY_BYTES))
                ids, cached, reason = api.parse_completion(data)
                api.check_prompt(api.reply_prompt(data), req.prompt, required=True)
                api.check_finished(reason, len(ids), self.spec.generation.max_tokens)
                api.check_count(api.completion_tokens(data), len(ids))
                t_first = None
        finally:
            resp.release()
        return Completion(req.rid, np.asarray(ids, dtype=np.int32), cached, t0, t_first, time.monotonic())

    async def _read_stream(self, r: int, req: Request, resp: aiohttp.ClientResponse):
        ids: list[int] = []
        cached = t_first = reason = counted = reply = None
        most = getattr(req, "max_tokens", 0) or self.spec.generation.max_tokens
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                api.check_finished(reason, len(ids), self.spec.generation.max_tokens)
                api.check_count(counted, len(ids))
                return ids, cached, t_first
            data = json.loads(payload)
            new, c, why = api.parse_chunk(data)
            api.check_prompt(api.reply_prompt(data), req.prompt, required=False)  # before a first token goes out
            reply = api.check_stream_id(reply, data)
            counted = n if (n := api.completion_tokens(data)) is not None else counted
            if new and reason is not None:
                raise api.ReplyError(f"ids after the answer ended (finish_reason {reason!r}): {new[:8]}")
            cached = c if c is not None else cached
            reason = why or reason
            if new and t_first is None:
                t_first = time.monotonic()
                if self.spec.stream:
                    self.sink.on_first(r, [FirstToken(req.rid, int(new[0]))])
            ids += new
            if len(ids) > most:  # refused as they come: a server that streams for ever fails at once
                raise api.ReplyError(f"the stream sent {len(ids)} ids, more than max_tokens {most}")
        raise api.ReplyError(f"the stream ended before [DONE] after {len(ids)} ids")

    # -- failures -------------------------------------------------------------------------------
    async def _monitor(self) -> None:
        """Every ``health_interval_s``: each live replica must answer ``/health`` with 200."""
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            for r, url in enumerate(self.urls):
                if self._dead[r]:
                    continue
                try:
                    async with self._http_get(f"{url}/health", headers=self._auth[r],
                                                 timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                        if resp.status != 200:
                            raise api.ReplyError(self._status(r, resp))
                except (aiohttp.ClientError, asyncio.TimeoutError, api.ReplyError) as e:
                    why = (f"no answer within {HEALTH_TIMEOUT_S:g} s (a stopped or overloaded server)"
                           if isinstance(e, asyncio.TimeoutError) else _describe(e))
                    await self._failed(r, f"failed its health check ({url}/health): {why}", e)

    async def _failed(self, r: int, what: str, e: BaseException, rid: Optional[int] = None) -> None:
        """Fail the run for replica ``r`` (``rid``: the request that failed, named with its sample by the
        dispatcher); for a server started here whose connection broke, wait up to 3 s for its process to end
        and report how it ended instead."""
        server = self.servers[r] if self.servers else None
        if server is not None and isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError)):
            for _ in range(30):
                if server.proc.poll() is not None:
                    self._fatal(r, server.exit_message())
                    return
                await asyncio.sleep(0.1)
        self._fatal(r, f"{self._name(r)} {what}", rid)

    def _fatal(self, r: int, message: str, rid: Optional[int] = None) -> None:
        with self._lock:
            self._dead[r] = True
        self._report_fatal(r, fleet.redact(message, self._keys), tail_log=log, rid=rid)

    # -- record and stop ------------------------------------------------------------------------
    def stats(self) -> dict:
        """``engines``: each replica's record with its ``samples`` (completions delivered); ``http``:
        client facts (requests in flight per replica, streaming, retried sends); ``dispatch_chunk``."""
        with self._lock:
            counts, retries = list(self.samples), self.retries
        return {"engines": [dict(r.info, samples=n) for r, n in zip(self.records, counts)],
                "http": {"max_inflight_per_replica": self.inflight, "stream": self.stream, "retried_sends": retries,
                         "urls": list(self.urls), "exposure": list(self.exposure), "fleet": self.options.fleet,
                         "agreement": self.agreement},
                "dispatch_chunk": self.options.dispatch_chunk}

    async def _close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def stop(self) -> None:
        """Cancel every request, close the client, end every server started here. Idempotent; a later call ends
        the servers that an earlier one, cut short by a stop signal, left (``servers.end`` skips ended ones)."""
        first = self._mark_stopped()
        try:
            if first:
                self._close_client()
        finally:  # also when a stop signal cut the close short: the servers must not outlive the run
            self._end_servers()

    def _close_client(self) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), loop).result(10)
            except Exception as e:  # noqa: BLE001 - stopping goes on
                log.debug("vllm-http client close: %r", e)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)
        if loop is not None and not loop.is_running():
            loop.close()

    def _end_servers(self) -> None:
        """End every server started here, in parallel (``servers.end``: SIGTERM, then SIGKILL)."""
        enders = [threading.Thread(target=servers.end, args=(s,), daemon=True) for s in self.servers]
        for th in enders:
            th.start()
        for th in enders:
            th.join(30)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``, at most ``limit`` bytes (``ReplyError`` past it: a server that never ends its reply
    must not fill the harness's memory)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise api.ReplyError(f"reply of {declared:,} bytes, more than the {limit:,} an answer can need")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise api.ReplyError(f"reply longer than the {limit:,} bytes an answer can need (the server kept sending)")
    return bytes(body)


async def _text_capped(resp: aiohttp.ClientResponse, chars: int, keys=()) -> str:
    """The first ``chars`` characters of an error reply's body (read no further than that needs), every one of
    ``keys`` in it hidden (``http_fleet.redact_cut``)."""
    return fleet.redact_cut((await resp.content.read(4 * chars)).decode("utf-8", "replace"), keys, chars)
