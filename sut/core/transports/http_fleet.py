"""A ``vllm serve`` fleet: which servers (``--fleet FILE`` or ``--server-url``), where they run, their API keys,
and whether they run the same engine.

Fleet file (TOML, read with ``tomllib``)::

    api_key_env = "FLEET_KEY"            # optional: the default for every server (a variable's NAME)

    [[server]]                           # one table per server = one replica
    url = "http://10.0.0.5:8000"         # required: http(s)://host:port (a trailing /v1 is dropped)
    node = "gpu-a"                       # required: the host's name, as you call it
    gpu = "GPU-5c2a..."                  # optional: a GPU UUID, or an index / label ("0")
    api_key_env = "GPU_A_KEY"            # optional: overrides the default

``load_fleet`` refuses (``ValueError`` naming the file, the server entry by index and URL, and the field) an
unknown key, a value of the wrong type, an empty or duplicate URL, a URL that is not http(s), no ``[[server]]``
table, and an ``api_key_env`` that is not a variable name or names a variable that is unset or empty. With
``--server-url`` each URL is one ``FleetServer`` whose node is the URL's host.

API keys: a server's key is the value of its ``api_key_env`` variable, read when the harness talks to the server
(``api_key``), sent as ``Authorization: Bearer <key>`` on every request to that server (``auth_headers``) and
never written anywhere: records hold the variable's name and ``"api_key": "set"`` (``placement``).

Agreement: ``fleet_agreement`` compares what every replica reported (``http_readback.replica_record``) on the
fields that change results (``COMPARED``); a field a replica does not report is unknown there and not compared.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Optional
from urllib.parse import urlsplit

#: What a 401 / 403 reply means to the harness (``vllm serve --api-key`` answers 401 on ``/v1/*`` without it).
KEY_REFUSED = "API key refused or missing"
_BAD_KEY = ("the key holds a line break, a control character, a character outside ASCII or a space at an end "
            "(an HTTP header cannot carry it)")
#: What ``api_key_env`` holds, for a message on a variable that is not set (a key given in its place looks like one).
KEY_ENV_IS_A_NAME = "api_key_env holds the NAME of the environment variable that holds the key, not the key"
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What a key may hold: visible ASCII and inner spaces (an HTTP header value; a line break or a character outside
#: ASCII could not be sent, and the HTTP libraries echo such a header, key included, in their error).
_KEY_TEXT = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")
_SERVER_KEYS = ("url", "node", "gpu", "api_key_env")
_TOP_KEYS = ("server", "api_key_env")


@dataclass(frozen=True)
class FleetServer:
    """One server of the fleet = one replica. ``url``: its base URL (normalized as ``--server-url``); ``node``:
    the host it runs on (the fleet file's name, else the URL's host); ``gpu``: the GPU as the fleet file names it
    (UUID, index or label; None: not said); ``api_key_env``: the NAME of the environment variable holding its API
    key (None: no key)."""

    url: str
    node: str
    gpu: Optional[str] = None
    api_key_env: Optional[str] = None


#: Why a server refused a request that carried no key (a ``--server-url`` server, or a fleet entry without one).
NO_KEY_SENT = "--server-url sends no key: give the servers in a --fleet file with api_key_env"


def status_text(status: int, key_sent: bool = True, location: Optional[str] = None) -> str:
    """``"HTTP 401: API key refused or missing"`` for 401 / 403 (with ``NO_KEY_SENT`` when not ``key_sent``), a
    redirect (3xx but 304) as refused, naming its ``location`` (the ``Location`` header), else ``"HTTP <status>"``."""
    if status in (401, 403):
        return f"HTTP {status}: {KEY_REFUSED}" + ("" if key_sent else f" ({NO_KEY_SENT})")
    if 300 <= status < 400 and status != 304:
        where = shown_url(location) if location else "a URL it does not name"
        return (f"HTTP {status} redirect to {where} refused (the API key must not follow a redirect): "
                "give the final URL")
    return f"HTTP {status}"


def servers_from_urls(urls) -> tuple[FleetServer, ...]:
    """One ``FleetServer`` per (already normalized) URL, its node the URL's host, no GPU, no key."""
    return tuple(FleetServer(u, urlsplit(u).hostname or u) for u in urls)


def shown_url(url: str) -> str:
    """``url`` as messages show it: credentials (``user:password@``) as ``***@``."""
    head, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{head}{sep}***@{netloc.rpartition('@')[2]}{slash}{path}" if "@" in netloc else url


def _bad(path, where: str, field: str, what: str) -> ValueError:
    return ValueError(f"fleet file {path}: {where}: field '{field}': {what}")


def _string(path, where: str, entry: dict, field: str, required: bool) -> Optional[str]:
    """``entry[field]`` as a non-empty string (None when absent and not ``required``); ``ValueError`` otherwise."""
    if field not in entry:
        if required:
            raise _bad(path, where, field, "missing (required)")
        return None
    val = entry[field]
    if not isinstance(val, str):
        raise _bad(path, where, field, f"must be a string, got {type(val).__name__} (write it in quotes)")
    if not val.strip():
        raise _bad(path, where, field, "empty")
    return val.strip()


def _check_key_env(path, where: str, name: Optional[str]) -> None:
    """``ValueError`` when ``name`` is no variable name or names an unset or empty variable (the name is
    printed only when it looks like one: a key pasted in its place is not echoed)."""
    if name is None:
        return
    if not _VAR_NAME.fullmatch(name):
        raise _bad(path, where, "api_key_env", "not an environment variable name (give the NAME of the variable "
                                                "that holds the key, never the key itself)")
    if not os.environ.get(name):
        raise _bad(path, where, "api_key_env", f"environment variable {name} is not set or empty ({KEY_ENV_IS_A_NAME})")
    if not _KEY_TEXT.fullmatch(os.environ[name]):
        raise _bad(path, where, "api_key_env", f"environment variable {name}: {_BAD_KEY}")


def _server(path, i: int, entry, default_env: Optional[str], url_of) -> FleetServer:
    """Entry ``i`` of the file as a ``FleetServer`` (``url_of``: the ``--server-url`` normalizer)."""
    where = f"server {i}"
    if not isinstance(entry, dict):
        raise ValueError(f"fleet file {path}: {where}: must be a [[server]] table, got {type(entry).__name__}")
    raw = _string(path, where, entry, "url", required=True)
    where = f"server {i} ({shown_url(raw)})"
    try:
        urls = url_of(raw)
    except ValueError as e:
        raise _bad(path, where, "url", str(e).removeprefix("server URL ")) from None
    if len(urls) != 1:
        raise _bad(path, where, "url", "one URL per [[server]] table")
    url = urls[0]
    unknown = sorted(set(entry) - set(_SERVER_KEYS))
    if unknown:
        raise _bad(path, where, unknown[0], f"unknown key (known: {', '.join(_SERVER_KEYS)})")
    node = _string(path, where, entry, "node", required=True)
    gpu = _string(path, where, entry, "gpu", required=False)
    key_env = _string(path, where, entry, "api_key_env", required=False) or default_env
    _check_key_env(path, where, key_env)
    return FleetServer(url, node, gpu, key_env)


def load_fleet(path: str, url_of) -> tuple[FleetServer, ...]:
    """The servers of fleet file ``path`` (module docstring), in file order. ``url_of(text) -> (url,)``
    normalizes and checks one URL (``http_options.url_list``). ``ValueError`` naming the file, the server
    entry (index and URL) and the field."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block, /dev/zero read until memory ends
        raise ValueError(f"fleet file {path}: not a regular file")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"fleet file {path}: cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"fleet file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"fleet file {path}: not valid TOML: {e}") from None
    unknown = sorted(set(doc) - set(_TOP_KEYS))
    if unknown:
        raise ValueError(f"fleet file {path}: field '{unknown[0]}': unknown top-level key (known: "
                         f"{', '.join(_TOP_KEYS)}; each server is a [[server]] table)")
    default_env = _string(path, "top level", doc, "api_key_env", required=False)
    entries = doc.get("server")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"fleet file {path}: field 'server': no [[server]] table (one per server)")
    out: list[FleetServer] = []
    for i, entry in enumerate(entries):
        s = _server(path, i, entry, default_env, url_of)
        twin = next((j for j, o in enumerate(out) if o.url.lower() == s.url.lower()), None)
        if twin is not None:
            raise _bad(path, f"server {i} ({s.url})", "url", f"the same URL as server {twin}: each server is one "
                                                              "replica, give it once")
        out.append(s)
    return tuple(out)


def api_key(server: Optional[FleetServer]) -> Optional[str]:
    """The API key of ``server``: the value of its ``api_key_env`` variable, None when it names none.
    ``ValueError`` (naming the variable, never a value) when the variable is unset or empty now."""
    if server is None or server.api_key_env is None:
        return None
    key = os.environ.get(server.api_key_env)
    if not key:
        raise ValueError(f"server {server.url}: environment variable {server.api_key_env} (its api_key_env) is not "
                         f"set or empty ({KEY_ENV_IS_A_NAME})")
    if not _KEY_TEXT.fullmatch(key):
        raise ValueError(f"server {server.url}: environment variable {server.api_key_env} (its api_key_env): {_BAD_KEY}")
    return key


#: What stands for a key in a message (a server's error reply may quote the request's ``Authorization``).
HIDDEN_KEY = "<api key hidden>"


def redact(text: str, keys) -> str:
    """``text`` with every one of ``keys`` (None and empty ones skipped) replaced by ``HIDDEN_KEY``."""
    for key in sorted({k for k in keys if k}, key=len, reverse=True):
        text = text.replace(key, HIDDEN_KEY)
    return text


def redact_cut(text: str, keys, chars: int) -> str:
    """``redact`` of ``text``, cut to ``chars`` characters; the beginning of a key that the cut left at the end (4
    characters or more) is hidden too."""
    text = redact(text, keys)[:chars]
    for key in {k for k in keys if k}:
        for n in range(min(len(key), len(text)), 3, -1):
            if text.endswith(key[:n]):
                return text[:-n] + HIDDEN_KEY
    return text


def auth_headers(key: Optional[str]) -> dict:
    """``{"Authorization": "Bearer <key>"}``, or ``{}`` without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def placement(server: Optional[FleetServer], url: str) -> dict:
    """What a replica's record says of where it runs and its key: ``node`` (the URL's host without a fleet
    entry), ``gpu``, ``api_key_env`` (a name) and ``api_key`` (``"set"`` or None) - never a key's value."""
    s = server if server is not None else (servers_from_urls([url])[0] if url else None)
    if s is None:
        return {"node": None, "gpu": None, "api_key_env": None, "api_key": None}
    return {"node": s.node, "gpu": s.gpu, "api_key_env": s.api_key_env,
            "api_key": "set" if s.api_key_env else None}


def _model_name(info: dict) -> Optional[str]:
    model = (info.get("engine_args") or {}).get("model")
    return PurePosixPath(str(model).rstrip("/")).name if model else None


def _quantization(info: dict) -> Optional[str]:
    """The quantization method; ``"none"`` where a source that reports it (launch arguments, ``/server_info``)
    gave none; None (unknown) where no source reports it."""
    args, sources = info.get("engine_args") or {}, info.get("engine_args_from") or ()
    if args.get("quantization"):
        return str(args["quantization"])
    return "none" if {"launch args", "/server_info"} & set(sources) else None


#: The fields compared between replicas -> how each is read from a replica's record (None: unknown).
COMPARED = {
    "model": _model_name,
    "max_model_len": lambda i: (i.get("engine_args") or {}).get("max_model_len"),
    "dtype": lambda i: (i.get("engine_args") or {}).get("dtype"),
    "quantization": _quantization,
    "kv_cache_dtype": lambda i: (i.get("engine_args") or {}).get("kv_cache_dtype"),
    "vllm_version": lambda i: i.get("vllm_version"),
    "enable_prefix_caching": lambda i: i.get("enable_prefix_caching"),
    "block_size": lambda i: (i.get("engine_args") or {}).get("block_size"),
}


def fleet_agreement(infos: list[dict]) -> dict:
    """``{"agreed": {field: value or None}, "unknown": {field: [urls]}}`` over the replicas' records ``infos``
    (each with ``url``) for every field of ``COMPARED``; ``ValueError`` naming the field, each server's URL
    and value when two replicas report different values (a replica that reports none is left out)."""
    agreed, unknown = {}, {}
    for name, read in COMPARED.items():
        seen = [(i.get("url"), read(i)) for i in infos]
        known = [(u, v) for u, v in seen if v is not None]
        if len({str(v) for _, v in known}) > 1:
            said = ", ".join(f"{u} ({name} {v})" for u, v in known)
            raise ValueError(f"the servers differ in {name}: {said}; every replica of a run must run the same "
                             "engine (start every server with the same model and flags)")
        agreed[name] = known[0][1] if known else None
        missing = [u for u, v in seen if v is None]
        if missing:
            unknown[name] = missing
    return {"agreed": agreed, "unknown": unknown}
