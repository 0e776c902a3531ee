"""The systems a locality run compares, each a transport of the dispatch core with its options.

* ``standalone``: vLLM engines of this host, one per device slot (``local`` transport, the
  in-process workers of ``--sut vllm``); with ``--http``, ``vllm serve`` replicas started here (the
  study's standalone path: OpenAI-compatible servers; ``http`` transport); with ``--server-url
  URL...``, servers that already run (then engines cannot be fresh per pair: the record says so).
* ``flame``: the ``flame`` transport, one Flame session per replica pinned to device slot r, with
  the study's settings (``../shared/research/study.md`` §6) as defaults for this entry point: batch
  limit 128 (``batch_size``), batch-formation window 10 ms (``batch_window_ms``), zlib payloads
  (``compress``), frozen start-up heap (``gc_freeze``); the service submits every request of a batch
  at once on one event loop (its only mode).

Both systems get the same replica count (the device slots of ``sut.engine.plan_engines``), so
replica r runs on the same device (GPU UUID) on both; ``sut.locality.pairs`` checks it against
the replicas' own records. Options: each system's transport ``options_cls`` (a frozen dataclass),
built from the defaults below plus ``--system-option SYSTEM.KEY=VALUE`` through
``sut.engine.settings_from_mapping`` (values typed, unknown keys refused). ``SYSTEMS`` may be
extended (tests register systems over the fake transport).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from sut.core.transport import Transport, TransportSpec, make_transport, transport_class
from sut.engine import settings_from_mapping
from sut.settings.flags import json_or_str


@dataclass(frozen=True)
class SystemSpec:
    """How one system is built.

    Attributes:
        transport: the transport name (``sut.core.transport.TRANSPORTS`` or a registered one).
        defaults: option defaults of this entry point (fields the options class lacks are skipped).
        replicas_field: the option that sets the replica count (None: the transport plans it itself).
        fresh: every case gets freshly started engines (False: engines that were already running).
        check: called with the parsed options before anything starts; raises ``ValueError`` naming
            what the user must fix (e.g. no Flame control plane to talk to).
    """

    transport: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    replicas_field: Optional[str] = None
    fresh: bool = True
    check: Optional[Callable[[Any], None]] = None


def check_flame(options) -> None:
    """The Flame system needs a control plane that answers (``ValueError`` saying how to get one)."""
    from sut.errors import RunFailed
    from sut.flame.endpoint import check_control_plane

    try:
        check_control_plane(getattr(options, "endpoint", None))
    except RunFailed as e:
        msg = str(e).replace("(docs/flame.md)", "(docs/flame.md, docs/locality.md)")
        if msg == str(e):
            msg += " (a cluster on this host: `python -m sut.flame cluster`, docs/locality.md)"
        raise ValueError(f"system flame: {msg}") from None


#: The study's Flame settings for this entry point (study.md §6: batch limit 128, 10 ms window, zlib, gc.freeze).
FLAME_STUDY_DEFAULTS = {"batch_size": 128, "batch_window_ms": 10.0, "compress": True, "gc_freeze": True}

SYSTEMS: dict[str, SystemSpec] = {
    "standalone": SystemSpec("local"),
    "flame": SystemSpec("flame", FLAME_STUDY_DEFAULTS, replicas_field="engines", check=check_flame),
}


@dataclass(frozen=True)
class System:
    """A resolved system: its name, spec and parsed options object (the transport's ``options_cls``)."""

    name: str
    spec: SystemSpec
    options: Any

    @property
    def transport(self) -> str:
        return self.spec.transport

    def record(self) -> dict:
        opts = dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else self.options
        return {"transport": self.transport, "fresh_engines": self.spec.fresh, "options": opts}


def parse_system_options(items: Sequence[str]) -> dict[str, dict]:
    """``["flame.batch_size=64", ...]`` -> ``{"flame": {"batch_size": 64}}`` (values JSON-parsed,
    else kept as strings). ``ValueError`` for an item that is not ``SYSTEM.KEY=VALUE``."""
    out: dict[str, dict] = {}
    for item in items:
        head, eq, raw = item.partition("=")
        system, dot, key = head.partition(".")
        if not (eq and dot and system and key):
            raise ValueError(f"--system-option {item!r}: expected SYSTEM.KEY=VALUE, e.g. flame.batch_size=64")
        out.setdefault(system, {})[key] = json_or_str(raw)
    return out


def _standalone_spec(http: bool, urls: Sequence[str]) -> SystemSpec:
    if urls:
        return SystemSpec("http", {"urls": tuple(urls)}, fresh=False)
    return SystemSpec("http") if http else SYSTEMS["standalone"]


def resolve_systems(names: Sequence[str], replicas: int, overrides: Mapping[str, Mapping] = (),
                    http: bool = False, urls: Sequence[str] = ()) -> list[System]:
    """The named systems with parsed options, checked before anything starts.

    Args:
        names: system names (``SYSTEMS`` keys), distinct.
        replicas: replica count of every system (device slots of the engine plan).
        overrides: ``{system: {option: value}}`` (``parse_system_options``).
        http / urls: the standalone system runs ``vllm serve`` replicas (started here / given).

    Raises:
        ValueError: an unknown or repeated system, an option override for a system not run, an
            unknown or ill-typed option, a system whose transport is not available here (named,
            with the import error), or one whose ``check`` fails (Flame: no control plane answers).
    """
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system {unknown[0]!r}; known: {', '.join(SYSTEMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"systems must be distinct, got {list(names)}")
    stray = sorted(set(dict(overrides)) - set(names))
    if stray:
        raise ValueError(f"--system-option for {stray[0]!r}, which is not among --systems {' '.join(names)}")
    out = []
    for name in names:
        spec = _standalone_spec(http, urls) if name == "standalone" else SYSTEMS[name]
        try:
            cls = transport_class(spec.transport)
        except (ImportError, KeyError) as e:
            why = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise ValueError(f"system {name}: its transport {spec.transport!r} is not available here ({why})") from None
        values = dict(spec.defaults)
        if spec.replicas_field:
            values[spec.replicas_field] = replicas
        values.update(dict(overrides).get(name, {}))
        opts = None
        if cls.options_cls is not None:
            names_ = {f.name for f in dataclasses.fields(cls.options_cls)}
            values = {k: v for k, v in values.items() if k in names_ or k in dict(overrides).get(name, {})}
            try:
                opts = settings_from_mapping(cls.options_cls, values)
            except (TypeError, ValueError) as e:
                raise ValueError(f"system {name}: {e}") from None
        if spec.check is not None:
            spec.check(opts)
        out.append(System(name, spec, opts))
    return out


def build_transport(system: System, spec: TransportSpec) -> Transport:
    """A new (not started) transport of ``system`` for ``spec`` (its ``options`` replaced by the
    system's); prefix caching allowed and per-request detail on: this entry point only."""
    spec = dataclasses.replace(spec, options=system.options, allow_prefix_caching=True, detail=True)
    return make_transport(system.transport, spec)
