"""The one prefix-caching guard of the project (MLPerf: cross-query KV reuse is prohibited).

Called twice per engine life, whatever the transport: before an engine is built
(``check_settings``: the requested setting) and once the engine is ready (``check_replicas``:
what the engine itself reports). A transport that cannot read the setting back reports ``None``;
``check_replicas`` refuses that too unless ``allow_unconfirmed`` (the ``vllm-http`` SUT's
``allow_unconfirmed_prefix_caching`` option, which marks the run not compliant).
"""

from __future__ import annotations

from typing import Iterable

from sut.messages import ReplicaRecord

PROHIBITED = "enable_prefix_caching=True is not allowed in an MLPerf run (cross-query KV reuse is prohibited)"


class PrefixCachingError(RuntimeError):
    """Prefix caching is (or may be) on where it must be off."""


def check_settings(enable_prefix_caching: bool, allowed: bool) -> None:
    """Before start: ``PrefixCachingError`` if the engine settings ask for prefix caching and it is not ``allowed``."""
    if enable_prefix_caching and not allowed:
        raise PrefixCachingError(PROHIBITED)


def check_replicas(replicas: Iterable[ReplicaRecord], allowed: bool, allow_unconfirmed: bool = False) -> list[int]:
    """After start: refuse a replica that reports prefix caching on (unless ``allowed``), or whose
    setting could not be read back (unless ``allowed`` or ``allow_unconfirmed``).

    Returns the indices of unconfirmed replicas (accepted because of ``allow_unconfirmed``).
    Raises ``PrefixCachingError`` naming the first offending replica.
    """
    unconfirmed = []
    for r in replicas:
        on = r.enable_prefix_caching
        if allowed:
            continue
        if on:
            raise PrefixCachingError(f"replica {r.index} reports enable_prefix_caching=True; refusing to run "
                                     "(cross-query KV reuse is prohibited in MLPerf runs)")
        if on is None:
            if not allow_unconfirmed:
                raise PrefixCachingError(f"replica {r.index}: prefix caching could not be confirmed off; refusing to "
                                         "run (pass the option allow_unconfirmed_prefix_caching=true to run anyway, "
                                         "marked not compliant)")
            unconfirmed.append(r.index)
    return unconfirmed
