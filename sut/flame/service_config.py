"""The session's common data: what the flame transport tells every service of one replica session.

Small JSON (``make_common_data`` writes it, ``ServiceConfig.from_bytes`` reads it): the engine and
sampling settings (every service builds the same engine as the local transport), the replica's
engine ``slot`` (replica r is pinned to slot r of ``sut.engine.plan_engines`` on the executor host),
the payload mode, where seats and logs go, and the two extension points (``engine_factory``,
``service_hooks``: ``"module:callable"`` strings, see ``sut.flame.options.FlameOptions``).
``digest`` is a hash of the whole document: a forwarder attaches only to an engine host of the same
session and settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from typing import Callable, Optional

from sut.constants import STALL_TIMEOUT_S
from sut.engine import EngineSettings, GenerationSettings, settings_from_mapping

PROTOCOL = 2


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """A parsed session common data document (see the module docstring)."""

    engine: EngineSettings
    generation: GenerationSettings
    slot: int = 0  # engine slot (= replica index) this session's executors serve
    payload: str = "tokens"  # tokens | indices
    compress: bool = True
    gc_freeze: bool = True
    detail: bool = False  # the engine measures first-token times too (the synthetic-locality entry point)
    dataset: Optional[dict] = None  # {"path", "sha256", "max_samples"} (indices mode)
    lock_dir: Optional[str] = None
    engine_start_timeout_s: float = 1800.0
    slot_wait_s: float = 300.0  # how long to wait for a slot whose engine host serves another session
    engine_stall_s: float = STALL_TIMEOUT_S  # end an engine that answers nothing this long with requests outstanding
    allow_prefix_caching: bool = False
    log_dir: Optional[str] = None  # the client's run folder/flame-service: output goes there on the client's host
    client_host: Optional[str] = None
    engine_factory: Optional[str] = None
    engine_factory_args: dict = dataclasses.field(default_factory=dict)
    service_hooks: Optional[str] = None
    service_hooks_args: dict = dataclasses.field(default_factory=dict)
    digest: str = ""

    @classmethod
    def from_bytes(cls, data: Optional[bytes]) -> "ServiceConfig":
        """Parse common data; ``ValueError`` naming what is wrong (no data, not JSON, other protocol)."""
        if not data:
            raise ValueError("the session has no common data; create it with the flame transport")
        try:
            d = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"session common data is not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("protocol") != PROTOCOL:
            got = d.get("protocol") if isinstance(d, dict) else None
            raise ValueError(f"session protocol {got!r} != service protocol {PROTOCOL}; "
                             "client and service must run the same code version")
        if d.get("payload", "tokens") not in ("tokens", "indices"):
            raise ValueError(f"payload must be tokens or indices, got {d.get('payload')!r}")
        gen = dict(d["generation"], eos_token_ids=tuple(d["generation"].get("eos_token_ids") or ()))
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
        names = {f.name for f in dataclasses.fields(cls)} - {"engine", "generation", "digest"}
        rest = {k: v for k, v in d.items() if k in names and v is not None}
        return cls(engine=settings_from_mapping(EngineSettings, d["engine"]),
                   generation=settings_from_mapping(GenerationSettings, gen), digest=digest, **rest)


def make_common_data(engine: EngineSettings, generation: GenerationSettings, **extra) -> bytes:
    """The common data the transport sends (inverse of ``ServiceConfig.from_bytes``); ``extra`` are
    ``ServiceConfig`` fields (None values are left out)."""
    d = {"protocol": PROTOCOL, "engine": dataclasses.asdict(engine), "generation": dataclasses.asdict(generation)}
    d["generation"]["eos_token_ids"] = list(generation.eos_token_ids)
    d.update({k: v for k, v in extra.items() if v is not None})
    return json.dumps(d, sort_keys=True).encode()


def load_callable(spec: str) -> Callable:
    """Import ``"module:callable"``; ``ValueError`` naming the spec when it cannot be imported."""
    module, _, name = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r}: {e}") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj
