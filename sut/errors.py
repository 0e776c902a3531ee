"""Every error class that ends a command, each carrying its exit code (a leaf: imports nothing of the project).

Exit codes (``python -m sut ...``, ``python -m sut.locality``, ``python -m sut.flame``; ``python -m accuracy``
uses the same numbers for its own ``AccuracyInputError``):

* 0: done (a command may also return 1 itself for a verdict, e.g. a failed accuracy gate);
* 1: the run or check failed (:class:`RunFailed` and its kin);
* 2: bad input, found before anything starts (:class:`BadInput`, :class:`InputError`, :class:`DatasetError`,
  :class:`ScenarioError`, :class:`ComplianceError`; ``accuracy.errors.AccuracyInputError``);
* 130: stopped by Ctrl-C or SIGTERM (``KeyboardInterrupt``; also any failure a stop signal caused).

``sut.exits.exit_code`` reads the ``exit_code`` class attribute along an exception's MRO (the most
specific class wins: an :class:`InputError` is a :class:`RunFailed` and exits 2), so a class of any module
joins the map by setting ``exit_code``.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
#: Exit code of a command stopped by Ctrl-C (SIGINT) or SIGTERM (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130


class BadInput(SystemExit):
    """Bad command-line input: ``run_main`` prints the message to stderr as is; exit code 2.

    A ``SystemExit``, so that it still exits 2 where no ``run_main`` catches it.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        super().__init__(EXIT_BAD_INPUT)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RunFailed(RuntimeError):
    """The run cannot produce a trustworthy result (engine death, lost or doubled sample, Ctrl-C)."""

    exit_code = EXIT_FAILED


class InputError(RunFailed):
    """A file the user named is missing or invalid (user.conf, audit config); the CLI exits with 2."""

    exit_code = EXIT_BAD_INPUT


class TransportError(RunFailed):
    """A transport could not start, or a replica is gone (the message names it)."""

    exit_code = EXIT_FAILED


class ServerInputError(InputError, TransportError):
    """A server URL the user gave does not answer, or serves another model (the CLI exits 2)."""

    exit_code = EXIT_BAD_INPUT


class EngineError(RuntimeError):
    """An engine failed to start, died, or was configured against the rules (the message names the engine)."""

    exit_code = EXIT_FAILED


class DatasetError(ValueError):
    """A dataset file or record is unusable. ``str()`` names file, record index and field."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, path: str | os.PathLike, message: str, index: int | None = None, field_name: str | None = None):
        self.path, self.index, self.field = str(path), index, field_name
        where = str(path)
        if index is not None:
            where += f": record {index}"
        if field_name is not None:
            where += f", field '{field_name}'"
        super().__init__(f"{where}: {message}")


class ScenarioError(ValueError):
    """A scenario or model key that LoadGen would not read as meant; the message names the fix."""

    exit_code = EXIT_BAD_INPUT


class ComplianceError(Exception):
    """A compliance input (accuracy log, run folder, package request) is unusable; the message names it."""

    exit_code = EXIT_BAD_INPUT
