"""flame_standin: a test-only, in-process stand-in for the Flame v0.6.0 control plane.

It serves the real ``flame.v1.Frontend`` gRPC API (flamepy 0.6.0's own generated stubs) so that the real
``flamepy`` client talks to it, and it runs the application's real service processes (``flamepy.run``)
exactly one process per executor binding, over Unix sockets, like the executor manager does.

The product never imports this package. See docs/flame_standin.md for what it reproduces and what it
does NOT prove.

    from tests.flame_standin import StandinCluster, echo_app_attributes
    with StandinCluster(tmp_path) as cluster:
        conn = flamepy.connect(cluster.endpoint)
        conn.register_application("echo", echo_app_attributes(working_directory=str(tmp_path)))
        ...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

from ._cluster import StandinCluster
from ._store import (
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    SESSION_BIND_FAILED,
    SESSION_RETRY_LIMIT_REACHED,
    SUCCEED,
)

ECHO_SERVICE = Path(__file__).resolve().with_name("echo_service.py")


def echo_app_attributes(
    working_directory: Optional[str] = None,
    delay_release: Optional[int] = None,
    environments: Optional[Dict[str, str]] = None,
    python: Optional[str] = None,
    arguments: Optional[List[str]] = None,
    **extra,
) -> dict:
    """ApplicationAttributes (as a dict for ``Connection.register_application``) for the echo service."""
    envs = {"PYTHONUNBUFFERED": "1"}
    envs.update(environments or {})
    attrs = {
        "command": python or sys.executable,
        "arguments": list(arguments) if arguments is not None else [str(ECHO_SERVICE)],
        "environments": envs,
        "working_directory": working_directory,
        "delay_release": delay_release,
    }
    attrs.update(extra)
    return attrs


__all__ = [
    "StandinCluster",
    "echo_app_attributes",
    "ECHO_SERVICE",
    "PENDING",
    "RUNNING",
    "SUCCEED",
    "FAILED",
    "CANCELLED",
    "SESSION_BIND_FAILED",
    "SESSION_RETRY_LIMIT_REACHED",
]
