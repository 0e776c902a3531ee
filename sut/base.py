"""The SUT contract and the registry of SUT backends.

A backend implements four methods (``start``, ``issue_queries``, ``flush_queries``, ``stop``)
and registers itself by name with :func:`register_sut`; the run command looks it up with
:func:`get_sut`. Every backend hands its results to a :class:`SampleLedger` (``sut.ledger``),
which owns the rule "every issued sample is answered exactly once, or the run fails loudly" and
makes every LoadGen ``QuerySamplesComplete`` call; backends never call LoadGen themselves. In the
Server and Interactive scenarios the ledger is a :class:`~sut.streaming_ledger.StreamingLedger`,
which also makes every ``FirstTokenComplete`` call (``ledger.first_tokens``) on the same thread.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from sut.dataset import Dataset
from sut.engine import EngineSettings, GenerationSettings
from sut.ledger import SampleLedger
from sut.scenarios import STREAMING_SCENARIOS
from sut.streaming_ledger import StreamingLedger

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot produce a trustworthy result (engine death, lost or doubled sample, Ctrl-C)."""


class InputError(RunFailed):
    """A file the user named is missing or invalid (user.conf, audit config); the CLI exits with 2."""


@dataclass
class SUTContext:
    """What every backend gets: the dataset, engine and sampling settings, backend options,
    ``engine_log_dir``: where local engine workers write vLLM's own output (``engine-N.log``; None =
    the console), and ``scenario`` (``Offline``, ``Server``, ``Interactive``: the last two stream
    first tokens)."""

    dataset: Dataset
    engine: EngineSettings
    generation: GenerationSettings
    options: dict = field(default_factory=dict)
    progress: bool = True
    run_dir: Optional[str] = None  # the run folder (backends may keep their own logs there)
    engine_log_dir: Optional[str] = None
    scenario: str = "Offline"


class SystemUnderTest(abc.ABC):
    """A LoadGen system-under-test backend.

    Life cycle: ``start()`` (load models; may take minutes) → LoadGen calls
    ``issue_queries``/``flush_queries`` → ``stop()`` (always called, also after failures).
    """

    name: str = ""

    def __init__(self, ctx: SUTContext):
        self.ctx = ctx
        if ctx.scenario in STREAMING_SCENARIOS:
            self.ledger = StreamingLedger(ctx.generation.eos_token_ids, progress=ctx.progress)
        else:
            self.ledger = SampleLedger(ctx.generation.eos_token_ids, progress=ctx.progress)

    @abc.abstractmethod
    def start(self) -> dict:
        """Start the backend; return facts for the run record (engines, devices, read-back args).

        Raises:
            RunFailed / EngineError: the backend could not start.
        """

    @abc.abstractmethod
    def issue_queries(self, samples: Sequence) -> None:
        """LoadGen callback: take ``QuerySample`` objects (``.id``, ``.index``). Must not block."""

    def flush_queries(self) -> None:
        """LoadGen callback after the last query was issued. Nothing to do for Offline."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut every process down. Must be safe to call twice and after a failure."""

    def record(self) -> dict:
        """Backend-specific fields for ``run.json`` (called after ``stop``)."""
        return {}

    @classmethod
    def check_options(cls, options: dict):
        """Validate backend options before anything starts (the harness calls it first; a backend's
        ``__init__`` may call it too and use what it returns, e.g. its options dataclass).

        Raises ``InputError`` naming the option for an unknown key or a bad value. The default
        accepts no options.
        """
        if options:
            raise InputError(f"--sut {cls.name}: unknown option(s) {', '.join(sorted(options))}; it takes none")

    @classmethod
    def check_engine(cls, engine: EngineSettings) -> None:
        """Refuse engine settings that cannot run on this host before anything starts (the harness
        calls it before the run folder is made), raising ``InputError``. The default checks nothing:
        a remote backend's engines run elsewhere."""


_REGISTRY: dict[str, type[SystemUnderTest]] = {}

#: Built-in backends and the module that registers each. Only the requested one is imported, so
#: a host without flamepy's extra dependencies can still run the standalone SUT.
BUILTIN_BACKENDS = {"vllm": "sut.standalone", "flame": "sut.flame.client"}


def register_sut(name: str) -> Callable[[type[SystemUnderTest]], type[SystemUnderTest]]:
    """Class decorator: make a backend available as ``--sut NAME``."""

    def deco(cls: type[SystemUnderTest]) -> type[SystemUnderTest]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_sut(name: str) -> type[SystemUnderTest]:
    """The backend class registered as ``name`` (importing its module on first use).

    Raises ``KeyError`` listing the known names.
    """
    if name not in _REGISTRY and name in BUILTIN_BACKENDS:
        import importlib

        importlib.import_module(BUILTIN_BACKENDS[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown SUT {name!r}; known: {', '.join(sut_names())}") from None


def sut_names() -> list[str]:
    """Names of the built-in and registered backends."""
    return sorted(set(BUILTIN_BACKENDS) | set(_REGISTRY))
