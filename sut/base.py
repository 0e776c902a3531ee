"""The SUT contract, the registry of SUT backends, and the ledger that answers every sample once.

A backend implements four methods (``start``, ``issue_queries``, ``flush_queries``, ``stop``)
and registers itself by name with :func:`register_sut`; the run command looks it up with
:func:`get_sut`. Every backend hands its results to a :class:`SampleLedger`, which owns the
rule "every issued sample is answered exactly once, or the run fails loudly".
"""

from __future__ import annotations

import abc
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from sut.dataset import Dataset
from sut.engine import EngineSettings, GenerationSettings
from sut.response import complete_samples, cut_at_first_eos

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot produce a trustworthy result (engine death, lost or doubled sample, Ctrl-C)."""


class InputError(RunFailed):
    """A file the user named is missing or invalid (user.conf, audit config); the CLI exits with 2."""


@dataclass
class SUTContext:
    """What every backend gets: the dataset, engine and sampling settings, backend options."""

    dataset: Dataset
    engine: EngineSettings
    generation: GenerationSettings
    options: dict = field(default_factory=dict)
    progress: bool = True


class SampleLedger:
    """Tracks issued samples until LoadGen has their response; answers each exactly once.

    ``issue`` gives each issued LoadGen sample its own request id (equal-issue repeats of one
    QSL index are separate requests). ``complete`` cuts outputs at the first EOS and sends
    them to LoadGen; a request id that is unknown or already answered is a fatal error.
    ``fail`` records the first fatal error and answers every outstanding sample with an empty
    response so that LoadGen's ``StartTest`` returns; the run is then reported as failed.
    """

    def __init__(self, eos_ids: Iterable[int], progress: bool = True, complete_fn: Callable = complete_samples):
        self.eos_ids = tuple(eos_ids)
        self._complete_fn = complete_fn
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._outstanding: dict[int, tuple[int, int]] = {}  # request id -> (loadgen sample id, qsl index)
        self.issued = 0
        self.completed = 0
        self.output_tokens = 0
        self.error: Optional[str] = None
        self.first_issue_t: Optional[float] = None
        self.last_complete_t: Optional[float] = None
        self.idle = threading.Event()
        self.idle.set()
        self._bar = None
        self._progress = progress

    def issue(self, samples: Sequence) -> list[tuple[int, int]]:
        """Register LoadGen ``QuerySample`` objects; return ``(request id, qsl index)`` pairs."""
        out = []
        with self._lock:
            if self.first_issue_t is None:
                self.first_issue_t = time.monotonic()
            for s in samples:
                rid = next(self._ids)
                self._outstanding[rid] = (s.id, s.index)
                out.append((rid, s.index))
            self.issued += len(out)
            if out:
                self.idle.clear()
            self._update_bar(0)
        return out

    def complete(self, results: Sequence[tuple[int, np.ndarray]]) -> None:
        """Send ``(request id, generated ids)`` results to LoadGen (cut at the first EOS)."""
        send = []
        with self._lock:
            if self.error is not None:
                return
            for rid, ids in results:
                entry = self._outstanding.pop(rid, None)
                if entry is None:
                    self._fail_locked(f"request {rid} was answered twice or never issued")
                    return
                cut = cut_at_first_eos(ids, self.eos_ids)
                send.append((entry[0], cut))
                self.output_tokens += len(cut)
        self._complete_fn(send)
        with self._lock:
            self.completed += len(send)
            self.last_complete_t = time.monotonic()
            self._update_bar(len(send))
            if not self._outstanding:
                self.idle.set()

    def fail(self, message: str) -> None:
        """Record a fatal error and release LoadGen by answering all outstanding samples empty."""
        with self._lock:
            self._fail_locked(message)

    def _fail_locked(self, message: str) -> None:
        if self.error is None:
            self.error = message
            log.error("RUN FAILED: %s", message)
        pending = list(self._outstanding.values())
        self._outstanding.clear()
        if pending:
            log.error("answering %d outstanding sample(s) with empty responses so LoadGen can stop; "
                      "the run is marked failed", len(pending))
            self._complete_fn([(sid, np.zeros(0, np.int32)) for sid, _ in pending])
        self.idle.set()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    # -- progress bar ---------------------------------------------------------------------
    def _update_bar(self, n: int) -> None:
        if not self._progress:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=0, unit="sample", desc="completed", dynamic_ncols=True, mininterval=1.0)
        if self._bar.total != self.issued:
            self._bar.total = self.issued
            self._bar.refresh()
        if n:
            self._bar.update(n)
            if self.first_issue_t is not None:
                dt = max(time.monotonic() - self.first_issue_t, 1e-9)
                self._bar.set_postfix_str(f"{self.output_tokens / dt:,.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class SystemUnderTest(abc.ABC):
    """A LoadGen system-under-test backend.

    Life cycle: ``start()`` (load models; may take minutes) → LoadGen calls
    ``issue_queries``/``flush_queries`` → ``stop()`` (always called, also after failures).
    """

    name: str = ""

    def __init__(self, ctx: SUTContext):
        self.ctx = ctx
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
