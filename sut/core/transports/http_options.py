"""Options of the ``http`` transport (``--sut vllm-http``): ``HttpOptions``.

Fields with their own ``python -m sut run`` flag declare it in their metadata (``sut.cli_flags``); the
others are ``--option KEY=VALUE``. ``urls`` takes a list or one comma-separated string and is kept as
a tuple of base URLs (scheme and host checked, trailing ``/`` and ``/v1`` dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union
from urllib.parse import urlsplit


def _url_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (str, list, tuple)):
        raise ValueError(f"HttpOptions.urls: expected URL strings (a list or a comma-separated string), got {value!r}")
    items = value.split(",") if isinstance(value, str) else list(value)
    if (isinstance(value, str) or items) and not any(isinstance(u, str) and u.strip() for u in items):
        raise ValueError("HttpOptions.urls: empty (an unset variable?); leave --server-url out to start servers here")
    out = []
    for u in items:
        if not isinstance(u, str):
            raise ValueError(f"HttpOptions.urls: {u!r} is not a URL string")
        u = u.strip().rstrip("/")
        if not u:
            continue
        if u.endswith("/v1"):
            u = u[:-3]
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"HttpOptions.urls: {u!r} is not an http(s)://host:port URL")
        out.append(u)
    return tuple(out)


@dataclass(frozen=True)
class HttpOptions:
    """Options of the ``http`` transport (``--sut vllm-http``; module docstring).

    ``urls``: base URLs of running servers (a list, or one comma-separated string; a trailing ``/v1``
    is dropped); empty: start one server per GPU (one on CPU) here. ``model_name``: the served model id
    to request (default: the one that is ``--model``). ``max_inflight_per_replica``: requests in flight
    per replica (default 2 x ``max_num_seqs``). ``server_start_timeout_s``: how long a started server
    may take to answer ``/health``. ``server_command``: the command that starts one server, flags
    appended (default ``python -m vllm.entrypoints.launchers.api_server.entry``; e.g. ``vllm serve``).
    ``health_interval_s``: seconds between ``/health`` checks of every replica during the run.
    ``allow_unconfirmed_prefix_caching``: run even where a server's prefix-caching setting cannot be
    read back (the run is then not compliant). ``allow_prefix_caching``, ``dispatch_chunk``,
    ``first_token_weight``: as for ``--sut vllm`` (``sut.core.loadgen_sut``).
    """

    urls: Optional[Union[str, tuple[str, ...]]] = field(default=None, metadata={
        "flag": "--server-url", "metavar": "URLS",
        "help": "base URL(s) of running vLLM OpenAI-compatible servers (comma-separated, one replica each, e.g. "
                "http://10.0.0.5:8000); none: start one `vllm serve` per GPU (one on CPU) on 127.0.0.1"})
    model_name: Optional[str] = field(default=None, metadata={
        "flag": "--served-model-name", "help": "served model id to request (default: the one that is --model)"})
    max_inflight_per_replica: Optional[int] = field(default=None, metadata={
        "flag": "--max-inflight-per-replica", "help": "requests in flight per server; the rest wait in the client "
                                                     "(default 2 x --max-num-seqs)"})
    server_start_timeout_s: float = field(default=900.0, metadata={
        "flag": "--server-start-timeout-s", "help": "seconds a server started here may take to answer /health"})
    server_command: str = ""
    health_interval_s: float = 2.0
    allow_unconfirmed_prefix_caching: bool = field(default=False, metadata={
        "flag": "--allow-unconfirmed-prefix-caching",
        "help": "run although a server's prefix-caching setting cannot be read back (the run is then NOT compliant)"})
    allow_prefix_caching: bool = False
    dispatch_chunk: int = 512
    first_token_weight: float = 8.0

    def __post_init__(self):
        object.__setattr__(self, "urls", _url_list(self.urls))
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica < 1:
            raise ValueError(f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}")
        for name in ("server_start_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dispatch_chunk < 1:
            raise ValueError(f"dispatch_chunk must be >= 1, got {self.dispatch_chunk}")
        if not 0 <= self.first_token_weight <= 1e6:
            raise ValueError(f"first_token_weight must be in [0, 1e6], got {self.first_token_weight}")
