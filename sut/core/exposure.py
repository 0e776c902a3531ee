"""Whether a server the harness talks to is on this host's loopback, and the warning when it is not.

A Flame control plane (v0.6.0: no authentication; whoever reaches its frontend can run commands on its executor
hosts) or a ``vllm serve`` server (no authentication unless started with ``--api-key``) reached over the network
carries prompts and outputs across it, and may be open to others. The harness cannot see how a server is
fenced; it says what it can see: the URL's host is loopback or not, the scheme is TLS (https) or not.

``exposure(url, what, risk, tls_fences=...)`` -> the record (``{"url", "loopback", "tls", "warning"}``, ``warning`` None
when there is nothing to say), which the transports put in run.json and log as a warning.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional
from urllib.parse import urlsplit

#: Seconds a host name may take to resolve before it counts as not loopback.
RESOLVE_TIMEOUT_S = 2.0


def is_loopback_host(host: Optional[str]) -> bool:
    """True for ``localhost`` (and ``*.localhost``), a loopback IP (127.0.0.0/8, ::1, ::ffff:127.x), or a name
    every address of which is loopback; False for anything else, an empty host, or a name that does not resolve."""
    if not host:
        return False
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return _is_loopback_ip(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback_ip(i[4][0]) for i in infos)


def _is_loopback_ip(text: str) -> bool:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def exposure(url: str, what: str, risk: str, tls_fences: bool = True) -> dict:
    """``{"url", "loopback", "tls", "warning"}`` for ``url``. ``warning`` is None for a loopback host and, where
    ``tls_fences``, for https; else it names ``what`` (e.g. "Flame endpoint"), says how the traffic crosses the
    network, then ``risk`` (who can do what there), then what to do."""
    parts = urlsplit(url or "")
    loopback = is_loopback_host(parts.hostname)
    tls = parts.scheme in ("https", "grpcs")
    warning = None
    if not loopback and not (tls and tls_fences):
        how = "encrypted (https)" if tls else "unencrypted (plain http)"
        warning = (f"{what} {url} is not on this host's loopback: prompts and outputs cross the network {how}, and "
                   f"{risk}; keep it on a private network or behind a firewall")
    return {"url": url, "loopback": loopback, "tls": tls, "warning": warning}
