"""``--sut vllm-http``: the LoadGen SUT over the ``http`` transport (vLLM OpenAI-compatible servers).

It is ``TransportSUT`` (``sut.core.loadgen_sut``) with ``transport_name = "http"``
(``sut.core.transports.http``): servers given with ``--server-url URL[,URL...]`` or ``--fleet FILE``
(``sut.core.transports.http_fleet``: per server URL, node, GPU, API-key variable; one replica each),
or, without either, one ``vllm serve`` per GPU (one on a CPU host) started on 127.0.0.1 and ended with
the run. Routing as ``--sut vllm``: ``least_loaded`` (Offline), ``least_pending`` with streamed first
tokens (Server, Interactive).

Servers started here get the engine settings of ``--sut vllm`` as ``vllm serve`` flags, including
``--disable-log-stats`` (``vllm.LLM``'s default; ``--server-log-stats`` keeps vLLM's statistics on),
then the option ``server_args`` (extra flags; one the harness owns is refused, exit 2).

Prefix caching: a run is compliant only when every server confirms it off: a server started here gets
``--no-enable-prefix-caching`` and is read back from its launch arguments, and from ``/metrics`` where
that reports it (only with statistics on); a given URL is read back from ``/metrics`` (or
``/server_info``). Sources that disagree stop the run. A given server that reports it on, or whose
setting cannot be read back (its ``/metrics`` has no ``vllm:cache_config_info``: it runs with
``--disable-log-stats``), exits 2 before the run folder exists (``check_prefix_caching``, naming the URL and
the cause); a started one whose setting cannot be read back stops the run before LoadGen starts
(``sut.core.guard``). Either goes on with ``--allow-unconfirmed-prefix-caching`` (the option
``allow_unconfirmed_prefix_caching=true``), and then the run is not compliant (``noncompliance_reasons``).

Input checks before anything starts (exit 2 naming the URL, no run folder): every given URL must
answer ``/health`` over HTTP (``check_options``; a port that answers other bytes is named too), reach a
server no other given URL reaches (host names resolved: ``127.0.0.1:P`` and ``localhost:P`` are one
server, ``check_distinct``) and serve ``--model`` (or the option ``model_name``) with a context of at
least ``--max-model-len``, accept its API key (401 / 403: "API key refused or missing"), and every given
server is read back as the transport reads it (``read_back_server``): servers that differ in model,
max_model_len, dtype, quantization, kv-cache dtype, vLLM version, prefix caching or block size stop the
run naming the field and the servers (``check_fleet_agrees``; a field a server does not report is not
compared) (``preflight``); without URLs the servers' devices must exist
(``--device cuda`` without a GPU) and ``server_args`` / ``server_command`` may not give a flag the
harness sets (an engine setting's, also abbreviated: vLLM's parser takes unique prefixes). The
transport checks the same again when it connects.
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import logging
import resource
import socket
import time
from typing import Any, Optional
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import Request

from sut.base import register_sut
from sut.core.guard import refusal
from sut.core.loadgen_sut import TransportSUT
from sut.core.transports.http import HttpOptions
from sut.core.transports.http_api import MAX_REPLY_BYTES, ReplyError
from sut.core.transports.http_fleet import FleetServer, api_key, auth_headers, fleet_agreement, status_text
from sut.core.transports.http_readback import (
    CACHE_CONFIG_METRIC,
    FINISHED_METRIC,
    cache_config_labels,
    finished_requests,
    pick_model,
    replica_record,
)
from sut.core.transports.http_servers import OPENER, check_server_args, check_server_command, health_reply
from sut.engine import EngineSettings, check_step_budget, check_weights_present, plan_engines
from sut.errors import EngineError, InputError, ServerInputError

log = logging.getLogger("sut.http")

#: Seconds a given URL has to answer ``/health`` in ``check_options``.
REACH_TIMEOUT_S = 10.0

UNCONFIRMED_REASON = ("option allow_unconfirmed_prefix_caching=true: prefix caching may not be confirmed off on "
                      "every server (cross-query KV reuse must be off in MLPerf)")


def _not_http(e: http.client.HTTPException) -> str:
    """What a port that does not speak HTTP answered (``http.client``'s error; its text is the bytes, cut)."""
    return f"not an HTTP reply ({type(e).__name__}: {str(e)[:120]!r})"


def _headers(server: FleetServer) -> dict:
    """The ``Authorization`` header of ``server`` (``{}`` without a key); ``InputError`` when its variable is unset."""
    try:
        return auth_headers(api_key(server))
    except ValueError as e:
        raise InputError(f"--sut vllm-http: {e}") from None


def check_reachable(servers, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """``InputError`` naming the first server (``http_fleet.FleetServer``) whose ``/health`` does not answer 200
    within ``timeout_s`` (also a port that answers bytes other than HTTP)."""
    for server in servers:
        url = server.url
        headers = _headers(server)
        try:
            status, location = health_reply(url, timeout_s, headers)
        except (URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise InputError(f"--sut vllm-http: server {url} does not answer ({url}/health: {reason})") from None
        except http.client.HTTPException as e:
            raise InputError(f"--sut vllm-http: server {url} does not answer HTTP ({url}/health: {_not_http(e)}); "
                             "is it the port of a vLLM server?") from None
        if status != 200:
            raise InputError(f"--sut vllm-http: server {url} is not healthy ({url}/health: "
                             f"{status_text(status, bool(headers), location)})")


def _fetch(url: str, path: str, headers: dict, timeout_s: float, as_json: bool = True):
    """``GET url+path``: the decoded body, None on 404. ``InputError`` naming the URL otherwise (a 401 / 403:
    ``http_fleet.KEY_REFUSED``)."""
    try:
        with OPENER.open(Request(f"{url}{path}", headers=headers), timeout=timeout_s) as resp:
            body = _read_within(resp, MAX_REPLY_BYTES + 1, time.monotonic() + timeout_s, f"{url}{path}")
    except HTTPError as e:
        if e.code == 404:
            return None
        location = e.headers.get("Location") if e.headers is not None else None
        raise InputError(f"--sut vllm-http: server {url}: {url}{path}: {status_text(e.code, bool(headers), location)}"
                         ) from None
    except (URLError, OSError, ValueError) as e:
        raise InputError(f"--sut vllm-http: server {url}: {getattr(e, 'reason', e)}") from None
    except http.client.HTTPException as e:
        raise InputError(f"--sut vllm-http: server {url}: {url}{path}: {_not_http(e)}") from None
    if len(body) > MAX_REPLY_BYTES:
        raise InputError(f"--sut vllm-http: server {url}: {url}{path}: a reply longer than {MAX_REPLY_BYTES:,} bytes")
    text = body.decode("utf-8", "replace")
    try:
        return json.loads(text) if as_json else text
    except ValueError as e:
        raise InputError(f"--sut vllm-http: server {url}: {url}{path}: not JSON ({e})") from None


def _read_within(resp, most: int, deadline: float, where: str) -> bytes:
    """Up to ``most`` bytes of ``resp``'s body, all read by ``deadline`` (``time.monotonic()``): the socket timeout
    bounds each read, not the whole body, so a server that trickles a byte every few seconds would hold the check
    before the run for ever. ``TimeoutError`` (an ``OSError``) naming ``where`` past the deadline."""
    body = bytearray()
    while len(body) < most:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{where}: the reply did not arrive whole in time ({len(body):,} bytes so far)")
        chunk = resp.read1(min(1 << 16, most - len(body)))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def _optional(url: str, path: str, headers: dict, timeout_s: float, as_json: bool):
    """``_fetch`` of a source the server may lack: None on any failure."""
    try:
        return _fetch(url, path, headers, timeout_s, as_json)
    except InputError:
        return None


def _unread_cause(metrics) -> str:
    """Why a server's prefix caching could not be read back from its ``/metrics`` text (None: not offered)."""
    if metrics is None:
        return "it answers neither /metrics nor /server_info"
    try:
        labels = cache_config_labels(metrics)
    except ValueError:
        labels = None
    if not labels:
        return f"its /metrics has no {CACHE_CONFIG_METRIC}: start it without --disable-log-stats"
    return f"its {CACHE_CONFIG_METRIC} has no enable_prefix_caching label"


def check_prefix_caching(record: dict, metrics, allow_on: bool, allow_unread: bool) -> None:
    """``InputError`` naming the server when its ``record`` (``read_back_server``) reports prefix caching on (unless
    ``allow_on``: the option allow_prefix_caching) or unread (unless ``allow_on`` or ``allow_unread``: the
    option allow_unconfirmed_prefix_caching; ``metrics``: its ``/metrics`` text, for the cause)."""
    url = record.get("url")
    why = refusal(record.get("enable_prefix_caching"), allow_on, allow_unread)
    if why == "on":
        raise InputError(f"--sut vllm-http: server {url} reports enable_prefix_caching=True (cross-query KV reuse is "
                         "prohibited in MLPerf runs): start it with --no-enable-prefix-caching")
    if why == "unconfirmed":
        raise InputError(f"--sut vllm-http: server {url}: prefix caching could not be confirmed off: "
                         f"{_unread_cause(metrics)} (or pass --allow-unconfirmed-prefix-caching to run anyway, "
                         "marked not compliant)")


def read_back_server(r: int, server: FleetServer, engine: EngineSettings, model_name,
                     timeout_s: float = REACH_TIMEOUT_S, prefix_caching: tuple[bool, bool] = (True, True)) -> dict:
    """Replica ``r``'s record as the transport builds it (``http_readback.replica_record``, from ``/version``,
    ``/v1/models``, ``/metrics`` and ``/server_info`` where offered). ``InputError`` naming the URL unless
    ``/v1/models`` lists ``engine.model`` (``http_readback.pick_model``) with a ``max_model_len`` (where listed)
    of at least ``engine.max_model_len``, or when its key is refused, or its prefix caching is on or unread
    (``check_prefix_caching``; ``prefix_caching``: its ``(allow_on, allow_unread)``)."""
    url, headers = server.url, _headers(server)
    try:
        listed = (_fetch(url, "/v1/models", headers, timeout_s) or {}).get("data") or []
        served = next(m for m in listed if str(m.get("id")) == pick_model(listed, engine.model, model_name))
    except (ValueError, AttributeError, StopIteration) as e:
        raise InputError(f"--sut vllm-http: server {url}: {e}") from None
    version = _fetch(url, "/version", headers, timeout_s)
    max_len = served.get("max_model_len")
    if isinstance(max_len, int) and max_len < engine.max_model_len:
        raise InputError(f"--sut vllm-http: server {url} serves max_model_len {max_len} < --max-model-len "
                         f"{engine.max_model_len} (pass --max-model-len {max_len})")
    metrics = _optional(url, "/metrics", headers, timeout_s, as_json=False)
    info = _optional(url, "/server_info?config_format=json", headers, timeout_s, as_json=True)
    try:
        record = replica_record(r, url, served, version, metrics, info, engine)
    except ReplyError as e:
        raise InputError(f"--sut vllm-http: server {url}: read-back failed: {e}") from None
    check_prefix_caching(record, metrics, *prefix_caching)
    return record


def check_weights_marked(records: list[dict], engine: EngineSettings) -> None:
    """``InputError`` when a given server reports random weights (``engine_args.load_format`` ``dummy``, read from
    ``/server_info``) but the run does not say so (``--load-format dummy``, which marks it not compliant): its figures
    would otherwise pass for the model's."""
    dummy = [rec.get("url") for rec in records if (rec.get("engine_args") or {}).get("load_format") == "dummy"]
    if dummy and engine.load_format != "dummy":
        raise InputError(f"--sut vllm-http: server {', '.join(map(str, dummy))} loaded dummy (random) weights "
                         "(/server_info load_format): pass --load-format dummy so that the run is marked a throughput "
                         "figure, not the model under test")


def check_fleet_agrees(records: list[dict]) -> dict:
    """``http_fleet.fleet_agreement`` of the replicas' records; ``InputError`` naming the field and the servers
    when they differ."""
    try:
        return fleet_agreement(records)
    except ValueError as e:
        raise InputError(f"--sut vllm-http: {e}") from None


def _addresses(url: str) -> set[tuple[str, int]]:
    """The ``(IP address, port)`` pairs ``url``'s host resolves to (``getaddrinfo``; the scheme's port if none);
    ``InputError`` when the host does not resolve."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"--sut vllm-http: server {url}: host {parts.hostname!r} does not resolve: {e}") from None
    return {(info[4][0], port) for info in infos}


def check_distinct(urls, given: str = "--server-url") -> None:
    """``InputError`` naming both URLs when two given URLs reach one server: their hosts resolve to a common
    address, with the same port and path (each URL is one replica; one server twice would double its load).
    ``given``: where the URLs came from, for the message (``--server-url`` or ``fleet file PATH``)."""
    seen: list[tuple[str, set, str]] = []
    for url in urls:
        addrs, path = _addresses(url), urlsplit(url).path.rstrip("/")
        for other, other_addrs, other_path in seen:
            common = addrs & other_addrs
            if common and path == other_path:
                ip, port = sorted(common)[0]
                raise InputError(f"--sut vllm-http: {given} gives one server twice: {other} and {url} both reach "
                                 f"{ip}:{port} (each URL is one replica; give each server once)")
        seen.append((url, addrs, path))


#: Seconds a server's ``/metrics`` may take to count a finished request (vLLM updates its counters as the request's
#: last output is handled, about when the reply is sent).
COUNT_WAIT_S = 3.0


def check_one_process(servers, records: list[dict], timeout_s: float = REACH_TIMEOUT_S) -> None:
    """``InputError`` naming both URLs when two given servers are one process reached under two addresses (a server
    bound to 0.0.0.0 given as 127.0.0.1 and as the host's LAN address: ``check_distinct`` cannot see it): their
    records (``read_back_server``) read the same process start time, and a request sent to the first is counted in
    the second's ``/metrics`` (``vllm:request_success_total``). The start time alone (10 ms resolution) could be
    two servers started at once; where the count cannot be read, that is only warned."""
    for i, j in itertools.combinations(range(len(records)), 2):
        start = records[i].get("process_start_s")
        if start is None or start != records[j].get("process_start_s"):
            continue
        a, b = servers[i], servers[j]
        seen = _counts_request_to(b, a, records[i].get("served_model"), timeout_s)
        if seen is None:
            log.warning("--sut vllm-http: servers %s and %s started at the same time (process_start_time_seconds "
                        "%.2f) and %s has no %s_total to tell whether they are one server: give each server once",
                        a.url, b.url, start, b.url, FINISHED_METRIC)
        elif seen:
            raise InputError(f"--sut vllm-http: {a.url} and {b.url} are one server: the same process start time "
                             f"({start:.2f}), and a request sent to {a.url} was counted by {b.url}/metrics (each URL "
                             "is one replica; one server twice would double its load: give each server once)")


def _counts_request_to(b: FleetServer, a: FleetServer, model, timeout_s: float) -> Optional[bool]:
    """Whether server ``b``'s finished-request count rises within ``COUNT_WAIT_S`` after one 1-token completion
    sent to ``a``; None when ``b`` reports no such count."""
    before = finished_requests(_optional(b.url, "/metrics", _headers(b), timeout_s, as_json=False))
    if before is None:
        return None
    body = json.dumps({"model": model, "prompt": [0], "max_tokens": 1, "temperature": 0.0}).encode()
    headers = {**_headers(a), "Content-Type": "application/json"}
    try:
        with OPENER.open(Request(f"{a.url}/v1/completions", data=body, headers=headers), timeout=timeout_s) as resp:
            _read_within(resp, MAX_REPLY_BYTES + 1, time.monotonic() + timeout_s, f"{a.url}/v1/completions")
    except (URLError, OSError, ValueError, http.client.HTTPException) as e:
        raise InputError(f"--sut vllm-http: server {a.url}: a 1-token completion failed: "
                         f"{getattr(e, 'reason', e)}") from None
    deadline = time.monotonic() + COUNT_WAIT_S
    while time.monotonic() < deadline:
        now = finished_requests(_optional(b.url, "/metrics", _headers(b), timeout_s, as_json=False))
        if now is not None and now > before:
            return True
        time.sleep(0.2)
    return False


#: Files the harness keeps open besides its connections (logs, pipes, LoadGen's, a started server's).
OTHER_FILES = 256


def check_open_files(options: HttpOptions, engine: EngineSettings, replicas: int) -> None:
    """Make room for the connections the client opens before LoadGen starts (``max_inflight_per_replica``, default
    2 x ``max_num_seqs``, per replica) and ``OTHER_FILES``: the soft open-file limit (``ulimit -n``) of this process is
    raised up to its hard limit where it is lower (as ``vllm serve`` does for itself); ``InputError`` when even the
    hard limit is too low: the start would fail on "Too many open files" (or, with a huge value, never end) after
    the servers started."""
    inflight = options.max_inflight_per_replica or 2 * engine.max_num_seqs
    need = inflight * replicas + OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            log.info("--sut vllm-http: open-file limit raised from %d to %d for %d connection(s)", soft, need,
                     inflight * replicas)
            return
        except (ValueError, OSError) as e:
            log.warning("--sut vllm-http: could not raise the open-file limit to %d: %s", need, e)
    given = "--max-inflight-per-replica" if options.max_inflight_per_replica else "the default 2 x --max-num-seqs"
    raise InputError(f"--sut vllm-http: {inflight:,} connections per server ({given}) x {replicas} server(s) "
                     f"+ {OTHER_FILES} other files is more than this process may open (ulimit -n {soft:,}, hard limit "
                     f"{'unlimited' if hard == resource.RLIM_INFINITY else f'{hard:,}'}): lower "
                     "--max-inflight-per-replica or raise ulimit -n")


#: Engine settings that only a server's launch sets (``vllm serve`` flags); the harness itself uses the others
#: (model, max_model_len: the prompt-length check and the tokenizer).
SERVER_SIDE = ("dtype", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill",
               "gpu_memory_utilization", "kv_cache_dtype", "quantization", "load_format", "enforce_eager", "seed")


def server_side_settings(engine: EngineSettings) -> dict:
    """``{name: value}`` of the ``SERVER_SIDE`` settings of ``engine`` that differ from their defaults."""
    default = {f.name: f.default for f in dataclasses.fields(EngineSettings) if f.name in SERVER_SIDE}
    return {k: getattr(engine, k) for k in SERVER_SIDE if getattr(engine, k) != default[k]}


@register_sut("vllm-http")
class HttpSUT(TransportSUT):
    """LoadGen SUT over running (or started) vLLM OpenAI-compatible servers (module docstring)."""

    transport_name = "http"

    @classmethod
    def check_options(cls, options: Any) -> HttpOptions:
        """The options as ``HttpOptions`` (``InputError`` names a bad one); a mapping's URLs must answer
        (an ``HttpOptions`` instance is taken as already checked)."""
        checked = isinstance(options, HttpOptions)
        opts = super().check_options(options)
        if not checked and opts.servers:
            check_reachable(opts.servers)
        return opts

    @classmethod
    def preflight(cls, options: HttpOptions, engine: EngineSettings, confirm_prefix_caching: bool = True) -> None:
        """``InputError`` when two given URLs reach one server (``check_distinct``), a given server serves another
        model or a shorter context, refuses its API key, reports prefix caching on or cannot be read back
        (unless the options allow it, or not ``confirm_prefix_caching``: an experiment that allows it), or the
        given servers differ in a field that changes
        results (``read_back_server``, ``check_fleet_agrees``) or report dummy weights the run does not declare
        (``check_weights_marked``), or, without URLs,
        when the servers cannot be placed here (``plan_engines``), the model folder lacks the weights ``vllm
        serve`` would load (``check_weights_present``; not with a ``server_command``) or ``server_args`` gives a flag of
        the harness's settings, also abbreviated or in ``server_command`` (``http_servers.check_server_args``);
        also for what ``check_settings`` refuses."""
        cls.check_settings(engine)
        if not options.servers:
            try:
                check_server_args(options.server_args, engine, options.server_command)
                check_server_command(options.server_command)
                slots = plan_engines(engine)
                check_open_files(options, engine, len(slots))
                if not options.server_command:  # `vllm serve` started here: its default step budget and the folder's
                    check_step_budget(engine, slots, server=True)  # weights (a command of one's own may differ in
                    check_weights_present(engine)  # both: not checked)
            except (EngineError, ValueError) as e:
                raise InputError(f"--sut vllm-http: {e}") from None
            return
        check_open_files(options, engine, len(options.servers))
        check_distinct(options.server_urls, f"fleet file {options.fleet}" if options.fleet else "--server-url")
        allow_on = options.allow_prefix_caching or not confirm_prefix_caching
        allow = (allow_on, allow_on or options.allow_unconfirmed_prefix_caching)
        records = [read_back_server(r, s, engine, options.model_name, prefix_caching=allow)
                   for r, s in enumerate(options.servers)]
        check_one_process(options.servers, records)
        check_fleet_agrees(records)
        check_weights_marked(records, engine)
        ignored = server_side_settings(engine)
        ignored.pop("load_format", None)  # given servers: it declares their dummy weights (check_weights_marked)
        if ignored:
            log.warning("--sut vllm-http with server URLs: %s never reach servers that are already running (they keep "
                        "their own launch settings); run.json and package record what the servers report",
                        ", ".join(f"{k}={v}" for k, v in ignored.items()))

    @classmethod
    def check_settings(cls, engine: EngineSettings) -> None:
        """``InputError`` for ``admit_every_steps`` above 1: the harness's own engine loop (``sut.engine.worker``),
        which servers do not run. Called before the options are checked (no server is contacted first)."""
        if engine.admit_every_steps > 1:
            raise InputError(f"--sut vllm-http: --admit-every-steps {engine.admit_every_steps} is the harness's own "
                             "engine loop (--sut vllm, flame); `vllm serve` runs its own loop and has no such setting "
                             "(a preset's [engine.Server] or [engine] admit_every_steps sets it too: give "
                             "--admit-every-steps 1 to run that preset over HTTP)")

    @classmethod
    def noncompliance_reasons(cls, options: Any) -> list[str]:
        """A run that may go on with prefix caching unconfirmed is not an MLPerf result."""
        return [UNCONFIRMED_REASON] if getattr(options, "allow_unconfirmed_prefix_caching", False) else []


__all__ = ["HttpOptions", "HttpSUT", "ServerInputError", "check_distinct", "check_reachable"]
