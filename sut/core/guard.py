"""The one prefix-caching guard of the project (MLPerf: cross-query KV reuse is prohibited).

Called twice per engine life, whatever the transport: before an engine is built
(``check_settings``: the requested setting) and once the engine is ready (``check_replicas``:
what the engine itself reports). A transport that cannot read the setting back reports ``None``;
``check_replicas`` refuses that too unless ``allow_unconfirmed`` (the ``vllm-http`` SUT's
``allow_unconfirmed_prefix_caching`` option, which marks the run not compliant).
"""

from __future__ import annotations

from typing import Iterable, Optional

from sut.messages import ReplicaRecord

PROHIBITED = "enable_prefix_caching=True is not allowed in an MLPerf run (cross-query KV reuse is prohibited)"


class PrefixCachingError(RuntimeError):
    """Prefix caching is (or may be) on where it must be off."""


def check_settings(enable_prefix_caching: bool, allowed: bool) -> None:
    """Before start: ``PrefixCachingError`` if the engine settings ask for prefix caching and it is not ``allowed``."""
    if enable_prefix_caching and not allowed:
        raise PrefixCachingError(PROHIBITED)


def refusal(on: Optional[bool], allowed: bool, allow_unconfirmed: bool = False) -> Optional[str]:
    """Whether an engine that reports prefix caching ``on`` (None: not read back) must be refused: ``"on"``,
    ``"unconfirmed"`` (unless ``allow_unconfirmed``), or None; nothing is refused when prefix caching is ``allowed``
    (the synthetic-locality experiment). The one rule behind every check of engines, before or after start."""
    if allowed or on is False:
        return None
    if on:
        return "on"
    return None if allow_unconfirmed else "unconfirmed"


def check_replicas(replicas: Iterable[ReplicaRecord], allowed: bool, allow_unconfirmed: bool = False) -> list[int]:
    """After start: refuse a replica that reports prefix caching on (unless ``allowed``), or whose
    setting could not be read back (unless ``allowed`` or ``allow_unconfirmed``).

    Returns the indices of unconfirmed replicas (accepted because of ``allow_unconfirmed``).
    Raises ``PrefixCachingError`` naming the first offending replica.
    """
    unconfirmed = []
    for r in replicas:
        why = refusal(r.enable_prefix_caching, allowed, allow_unconfirmed)
        if why == "on":
            raise PrefixCachingError(f"replica {r.index} reports enable_prefix_caching=True; refusing to run "
                                     "(cross-query KV reuse is prohibited in MLPerf runs)")
        if why == "unconfirmed":
            raise PrefixCachingError(f"replica {r.index}: prefix caching could not be confirmed off; refusing to "
                                     "run (pass the option allow_unconfirmed_prefix_caching=true to run anyway, "
                                     "marked not compliant)")
        if not allowed and r.enable_prefix_caching is None:
            unconfirmed.append(r.index)
    return unconfirmed
