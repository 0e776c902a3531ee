"""The wrapper every entry point runs its command in: exit codes, Ctrl-C / SIGTERM handling.

The exit codes and the error classes that carry them live in :mod:`sut.errors` (0 done, 1 failed, 2 bad input,
130 stopped); :func:`exit_code` reads an exception's ``exit_code`` class attribute.

Usage::

    from sut.errors import BadInput
    from sut.exits import run_main, stop_on_sigterm_like_ctrl_c

    def _main(argv) -> int:
        a = build_parser().parse_args(argv)          # argparse's own errors still exit 2
        if not a.model:
            raise BadInput("error: --model is required")   # printed as is to stderr, exit 2
        stop_on_sigterm_like_ctrl_c()                # SIGINT and SIGTERM raise KeyboardInterrupt
        ...                                          # raise RunFailed / InputError / ...: mapped
        return 0

    def main(argv=None) -> int:
        return run_main(_main, argv, messages={"failed": "run failed: {}"})

Exceptions without an ``exit_code`` (programming errors) propagate with their traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable, Mapping, Optional

from sut.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, BadInput

log = logging.getLogger("sut")


class ShortUsageParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose command-line errors are two lines, not the whole usage (``python -m
    sut.locality run``'s usage runs to ~57 lines): ``PROG: error: MESSAGE`` and a pointer to ``PROG --help``;
    exit 2 (``EXIT_BAD_INPUT``). Sub-commands made with ``add_subparsers`` get the same class; an unknown flag after
    a sub-command (argparse reports it from the top parser) names that sub-command's PROG and help."""

    def error(self, message: str, prog: Optional[str] = None):
        prog = prog or self.prog
        for action in self._actions:  # a missing sub-command: name the ones there are
            if isinstance(action, argparse._SubParsersAction) and message.endswith(f"required: {action.dest}"):
                message += f" (one of: {', '.join(action.choices)})"
        self.exit(EXIT_BAD_INPUT, f"{prog}: error: {message}\n({prog} --help lists every option)\n")

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}", self._chosen(ns).prog)
        return ns

    def _chosen(self, ns) -> argparse.ArgumentParser:
        """The deepest sub-command parser ``ns`` chose (``add_subparsers(dest=...)``), else this parser."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # add_subparsers' action (a private name, the same since Python 3.2)
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if isinstance(sub, ShortUsageParser):
                    return sub._chosen(ns)
        return self


#: How each kind of exit is logged; ``{}`` is the exception's message. ``stopped``: a failure while a
#: stop signal was being handled (exit 130).
DEFAULT_MESSAGES = {"failed": "{}", "bad_input": "{}", "interrupted": "interrupted ({})", "stopped": "stopped: {}"}


#: What every command imports at start (pyproject.toml's dependencies): checked before the first import of the
#: project's modules, so that a command run outside the environment says how to enter it. nltk and rouge_score
#: (the accuracy gate), flamepy (Flame SUTs) and vLLM (engines) are imported where they are used and say so
#: there: a GPU host's bundle (scripts/bench/gpu_bundle.sh) runs performance and locality work without the gate's
#: modules.
REQUIRED_MODULES = ("numpy", "mlperf_loadgen", "transformers")


def require_environment(modules=REQUIRED_MODULES) -> None:
    """Exit 2 with how to activate the project's environment when one of ``modules`` is not installed in this
    Python (``python -m sut ...`` run with the system's ``python3``), instead of a ``ModuleNotFoundError``
    traceback from deep inside an import. Uses ``importlib.util.find_spec``: nothing is imported."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed for {sys.executable}: run the harness from its environment "
              "(made by `bash scripts/setup.sh` in the repository, then `. .venv/bin/activate`, or call "
              "`.venv/bin/python -m ...`)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def exit_code(exc: BaseException) -> Optional[int]:
    """The exit code for ``exc``: 130 for ``KeyboardInterrupt``, else the ``exit_code`` attribute of the most
    specific class along its MRO that sets one (:mod:`sut.errors`), or None when none does."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    for cls in type(exc).__mro__:
        code = cls.__dict__.get("exit_code")
        if isinstance(code, int):
            return code
    return None


_interrupted = threading.Event()  # a stop signal arrived in this process
_again = threading.Event()  # a second one: stop waiting for work of others (a Flame session's running tasks)


def interrupted() -> bool:
    """Whether a stop signal (SIGINT, SIGTERM) arrived since ``stop_on_sigterm_like_ctrl_c``."""
    return _interrupted.is_set()


def stopped_again() -> bool:
    """Whether a second stop signal arrived: the shutdown goes on, but no longer waits for what only others can
    end (``sut.flame.session``: Flame 0.6 has no task cancel, so closing a session waits for its running tasks)."""
    return _again.is_set()


_held: list[str] = []  # stops_held: depth markers; _deferred: the stop signal that came meanwhile
_deferred: list[str] = []


@contextlib.contextmanager
def stops_held():
    """Within this block (main thread) a stop signal is recorded, not raised; it is raised as ``KeyboardInterrupt``
    when the block ends. For a blocking gRPC call: gRPC runs Python signal handlers while it waits, and an exception
    raised there leaves the call's state locked, so the channel's clean-up (at ``close`` or garbage collection) then
    waited for ever (``python -m sut.flame cluster`` hung after a Ctrl-C during its start). Give the call a deadline:
    the signal waits for it. Off the main thread (where no handler runs) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held.append("held")
    try:
        yield
    finally:
        _held.pop()
        if not _held and _deferred:
            raise KeyboardInterrupt(_deferred.pop())


def _raise_interrupt(signum, _frame):
    name = "SIGINT, Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if _interrupted.is_set():  # a second stop signal must not cut the clean shutdown short
        _again.set()
        log.warning("already stopping (%s again): ending engines; a Flame session still waiting for its running "
                    "tasks is left open (the message says how to close it); SIGKILL forces the rest", name)
        return
    _interrupted.set()
    interrupt_unless_held(name)


def interrupt_unless_held(message: str) -> None:
    """For a signal handler: ``raise KeyboardInterrupt(message)``, or inside ``stops_held`` keep it for the block's
    end."""
    if _held:
        if not _deferred:
            log.warning("stopping (%s) once the step under way has ended", message)
        _deferred.append(message)
        return
    raise KeyboardInterrupt(message)


def stop_on_sigterm_like_ctrl_c() -> None:
    """Make SIGINT and SIGTERM raise ``KeyboardInterrupt("SIGINT, Ctrl-C" | "SIGTERM")`` in the main
    thread, so that both take Ctrl-C's clean path (engines ended, Flame session closed, the run
    recorded as failed). A second signal during that shutdown is only logged.

    SIGINT is installed explicitly: a process that a script starts in the background inherits SIGINT
    as *ignored*, Python then leaves it ignored, and Ctrl-C-style stops would do nothing.
    """
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)


_left_running: list[str] = []  # threads this process cannot stop (leave_without_cleanup)


def leave_without_cleanup(what: str) -> None:
    """Say that ``what`` still runs and cannot be stopped: LoadGen's ``StartTest`` thread after a failed or
    stopped Server / Interactive run (LoadGen 6.0.17 has no abort; its schedule runs to min duration).
    ``run_main`` then ends the process with ``os._exit`` once its command has returned or raised (run
    record written, engines stopped), so that LoadGen's C++ objects are never destroyed under that thread
    (a normal interpreter exit there ends in "terminate called without an active exception", exit 134, or
    a segfault)."""
    _left_running.append(what)


def run_main(fn: Callable[..., int], *args, messages: Optional[Mapping[str, str]] = None,
             logger: Optional[logging.Logger] = None) -> int:
    """Call ``fn(*args)`` and return its exit code; a mapped exception becomes its exit code and one
    error line (``messages`` overrides ``DEFAULT_MESSAGES`` per kind; ``logger`` defaults to ``sut``).

    ``BadInput`` is printed to stderr as is, another exception of exit code 2 (``InputError``) as one
    "error: ..." line there too; ``SystemExit`` (argparse) and unmapped exceptions
    propagate. After ``leave_without_cleanup`` the process ends here instead, with that code
    (``os._exit`` after the log handlers and stdout/stderr are flushed): nothing after it runs.
    """
    out = logger or log
    try:
        code = _run(fn, args, {**DEFAULT_MESSAGES, **(messages or {})}, out)
    except BaseException as e:  # noqa: BLE001 - unmapped (a bug, OSError, SystemExit): re-raised unless
        if not _left_running:  # LoadGen's thread still runs, when a normal exit would crash under it
            raise
        out.exception("unexpected error after a failed run")
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    if _left_running:
        out.warning("%s still runs (it cannot be stopped); exiting with code %d without waiting for it",
                    ", ".join(_left_running), code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(fn: Callable[..., int], args: tuple, msgs: Mapping[str, str], out: logging.Logger) -> int:
    """``run_main``'s call of ``fn(*args)`` with the exit-code map."""
    try:
        return fn(*args)
    except BadInput as e:
        print(e.message, file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - mapped below, else re-raised
        code = exit_code(e)
        if code is None:
            raise
        if code == EXIT_INTERRUPTED:
            out.error(msgs["interrupted"].format(e.args[0] if e.args else "SIGINT, Ctrl-C"))
        elif _interrupted.is_set():  # whatever the stop made fail (e.g. an engine start cut short)
            out.error(msgs["stopped"].format(e))
            return EXIT_INTERRUPTED
        elif code == EXIT_BAD_INPUT:  # as BadInput's: one "error:" line on stderr, nothing has started
            text = msgs["bad_input"].format(e)
            print(text if text.startswith("error:") else f"error: {text}", file=sys.stderr)
        else:
            out.error(msgs["failed"].format(e))
        return code
