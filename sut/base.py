"""The SUT contract and the registry of SUT backends.

A backend implements four methods (``start``, ``issue_queries``, ``flush_queries``, ``stop``)
and registers itself by name with :func:`register_sut`; the run command looks it up with
:func:`get_sut`. Every backend hands its results to a :class:`SampleLedger` (``sut.ledger.sample``),
which owns the rule "every issued sample is answered exactly once, or the run fails loudly" and
makes every LoadGen ``QuerySamplesComplete`` call; backends never call LoadGen themselves. In the
Server and Interactive scenarios the ledger is a :class:`~sut.ledger.streaming.StreamingLedger`,
which also makes every ``FirstTokenComplete`` call (``ledger.first_tokens``) on the same thread.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sut.constants import STALL_TIMEOUT_S
from sut.data.dataset import Dataset
from sut.engine import EngineSettings, GenerationSettings, settings_from_mapping
from sut.errors import InputError
from sut.ledger.sample import SampleLedger
from sut.ledger.streaming import StreamingLedger
from sut.registry import Registry
from sut.scenarios import STREAMING_SCENARIOS

log = logging.getLogger(__name__)


@dataclass
class SUTContext:
    """What every backend gets: the dataset, engine and sampling settings, ``options``: the backend's
    options object (its ``options_cls`` instance, parsed once by ``check_options``; None for a backend
    without options), ``engine_log_dir``: where local engine workers write vLLM's own output
    (``engine-N.log``; None = the console), and ``scenario`` (``Offline``, ``Server``,
    ``Interactive``: the last two stream first tokens). Every answer is checked against ``generation`` (EOS ids,
    lengths) and ``vocab_size`` before the ledger gets it (``sut.core.answers``)."""

    dataset: Dataset
    engine: EngineSettings
    generation: GenerationSettings
    options: Any = None
    progress: bool = True
    run_dir: Optional[str] = None  # the run folder (backends may keep their own logs there)
    engine_log_dir: Optional[str] = None
    scenario: str = "Offline"
    first_request_id: int = 0  # the ledger's first request id (tests that follow each other over one transport)
    #: the model's vocabulary size (``config.json`` ``vocab_size``): every generated id must be below it (0: not checked)
    vocab_size: int = 0
    #: the run's stall limit (``--stall-timeout-s``): a backend whose remote side must give up on a hung engine by
    #: itself (the Flame services) uses it
    stall_timeout_s: float = STALL_TIMEOUT_S


class SystemUnderTest(abc.ABC):
    """A LoadGen system-under-test backend.

    Life cycle: ``start()`` (load models; may take minutes) → LoadGen calls
    ``issue_queries``/``flush_queries`` → ``stop()`` (always called, also after failures).
    """

    name: str = ""

    def __init__(self, ctx: SUTContext):
        self.ctx = ctx
        # answers are cut after their first EOS, unless the run ignores EOS (every generated id counts)
        eos = () if ctx.generation.ignore_eos else ctx.generation.eos_token_ids
        ledger = StreamingLedger if ctx.scenario in STREAMING_SCENARIOS else SampleLedger
        self.ledger = ledger(eos, progress=ctx.progress, first_id=ctx.first_request_id)

    @abc.abstractmethod
    def start(self) -> dict:
        """Start the backend; return facts for the run record (engines, devices, read-back args; optionally
        ``noncompliance_reasons``: a list of reasons learnt only now, which the harness adds to ``compliance``).

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

    def end_check(self) -> Optional[str]:
        """Called once LoadGen has ended well, before ``stop``: why the run's answers cannot stand (e.g. a server
        replaced behind its URL during the run), or None. Default: None."""
        return None

    def stall_detail(self) -> str:
        """Where the outstanding samples wait, for the stall error (e.g. per replica); "" when the backend cannot
        tell."""
        return ""

    @classmethod
    def options_cls(cls) -> Optional[type]:
        """The backend's frozen options dataclass (fields with ``metadata["flag"]`` become its CLI
        flags, ``sut.settings.flags``); None: the backend takes no options."""
        return None

    @classmethod
    def check_options(cls, options: Any) -> Any:
        """The backend options as an ``options_cls`` instance, checked before anything starts (the
        harness calls it once; the instance is what ``SUTContext.options`` holds and ``run.json``
        records). ``options``: an instance (returned as is), a mapping of field names (values
        already typed: ``sut.engine.settings_from_mapping``), or None (the defaults).

        Raises ``InputError`` naming the option for an unknown key or a bad value; a backend without
        ``options_cls`` accepts no options and returns None.
        """
        ocls = cls.options_cls()
        if ocls is None:
            if options:
                raise InputError(f"--sut {cls.name}: unknown option(s) {', '.join(sorted(options))}; it takes none")
            return None
        if isinstance(options, ocls):
            return options
        if dataclasses.is_dataclass(options):
            raise InputError(f"--sut {cls.name}: options must be {ocls.__name__}, got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(ocls)}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise InputError(f"--sut {cls.name}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return settings_from_mapping(ocls, dict(options or {}))
        except (ValueError, TypeError) as e:
            raise InputError(f"--sut {cls.name}: {e}") from None

    @classmethod
    def preflight(cls, options: Any, engine: EngineSettings) -> None:
        """Checks that need both the parsed options and the engine settings (e.g. a given server serves
        ``--model`` with a long enough context), run by the harness before the run folder exists.
        Raises ``InputError`` naming what is wrong. The default checks nothing."""

    @classmethod
    def noncompliance_reasons(cls, options: Any) -> list[str]:
        """Why a run with these options (the ``check_options`` instance) is not an MLPerf result, for
        ``run.json`` ``compliance.reasons`` (e.g. prefix caching that could not be confirmed off).
        The default: none. (``allow_prefix_caching`` is reported by the harness for every backend.)"""
        return []

    @classmethod
    def check_settings(cls, engine: EngineSettings) -> None:
        """Refuse engine settings this backend can never run, on any host (no I/O: called as the settings are
        built, before the options, whose server URLs may be contacted), raising ``InputError``. The default
        checks nothing."""

    @classmethod
    def check_engine(cls, engine: EngineSettings) -> None:
        """Refuse engine settings that cannot run on this host before anything starts (the harness
        calls it before the run folder is made), raising ``InputError``. The default checks nothing:
        a remote backend's engines run elsewhere."""


#: Built-in backends and the module that registers each, imported on first use (``python -m sut run``
#: imports each to build its flags; one that cannot be imported here, e.g. without flamepy, is left out).
BUILTIN_BACKENDS = {"vllm": "sut.standalone", "flame": "sut.flame.client", "vllm-http": "sut.http_sut"}

_REGISTRY: Registry[SystemUnderTest] = Registry("SUT", BUILTIN_BACKENDS)

#: Class decorator: make a backend available as ``--sut NAME``.
register_sut = _REGISTRY.register
#: The backend class registered as NAME (its module imported on first use); ``KeyError`` listing the known names.
get_sut = _REGISTRY.get
#: Names of the built-in and registered backends.
sut_names = _REGISTRY.names
