"""Engine logs: where an engine worker's console output goes, and its last lines in error messages.

vLLM writes its own logs, warnings and tracebacks (e.g. the harmless "Chat template warmup failed ...
Tokenizer not available" of an engine started without a tokenizer) to the worker's stdout/stderr.
``redirect_output`` (called in the worker before vLLM is imported) points file descriptors 1 and 2,
inherited by vLLM's own child processes, at ``log_dir/engine-N.log``; ``with_log_tail`` puts the
last ``ENGINE_LOG_TAIL_LINES`` lines of that log into a start failure's or a death's message;
``split_log_tail`` takes them out again for a caller that prints them once itself.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

from sut.errors import EngineError

ENGINE_LOG_TAIL_LINES = 20


def engine_log_path(log_dir: str | os.PathLike, index: int | str) -> Path:
    """``log_dir/engine-<index>.log``: where engine ``index`` writes its console output."""
    return Path(log_dir) / f"engine-{index}.log"


def start_log(path: str | os.PathLike, name: str, about: str) -> Path:
    """Append the header line ``"<name> <about>, <date time>"`` to the log at ``path``; raises
    ``EngineError`` ("<name>: cannot write its log ...") if it cannot be written."""
    path = Path(path)
    try:
        with open(path, "a") as fh:
            fh.write(f"{name} {about}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    except OSError as e:
        raise EngineError(f"{name}: cannot write its log {path}: {e.strerror}") from None
    return path


def log_tail(path: Optional[Path], lines: int = ENGINE_LOG_TAIL_LINES, max_chars: int = 400) -> str:
    """The last ``lines`` non-empty lines of ``path`` (each cut to ``max_chars``); '' if none or unreadable."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - lines * max_chars * 2))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln[:max_chars] for ln in text.splitlines() if ln.strip()][-lines:]
    return "\n".join(kept)


def with_log_tail(msg: str, path: Optional[Path]) -> str:
    """``msg`` with the last lines of the log at ``path`` (when there is one) after its first line, so
    the console shows why an engine died and still ends with the worker's own traceback, if any;
    ``msg`` itself is then appended to the log, which thus holds the whole story."""
    if path is None:
        return msg
    tail = log_tail(path)
    try:
        with open(path, "a") as fh:
            fh.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    except OSError:
        pass
    first, _, rest = msg.partition("\n")
    out = f"{first}\n--- last lines of {path} ---\n{tail or '(empty)'}\n--- end of {path.name} ---"
    return f"{out}\n{rest}" if rest else out


#: The pointers to the log that replace a log-tail block: the tail logged above (``split_log_tail``), or not shown
#: at all (``drop_log_tail``).
_POINTERS = ("the last lines of its log are above; all of it: ", "its log: ")


def split_log_tail(msg: str, pointer: str = _POINTERS[0]) -> tuple[str, str]:
    """Undo ``with_log_tail`` for the console: ``(msg with its log-tail block replaced by a pointer to
    the log, the block)``; ``(msg, "")`` when ``msg`` has no block. A caller that logs the block once
    passes the short message on, so that the tail is not printed again with every report of it."""
    m = _TAIL_BLOCK.search(msg)
    if m is None:
        return msg, ""
    return f"{msg[:m.start()]} ({pointer}{m['path']}){msg[m.end():]}", m.group(0).lstrip("\n")


def drop_log_tail(msg: str) -> str:
    """``msg`` with its log-tail block (``with_log_tail``) replaced by ``(its log: PATH)``, nothing logged: for a
    loss that was planned (a replica killed on purpose), whose log tail tells nothing new."""
    return split_log_tail(msg, _POINTERS[1])[0]


def without_log_pointer(line: str) -> str:
    """``line`` without the pointer to the log (``split_log_tail`` / ``drop_log_tail``) that ends it, for a table
    cell; a path may hold ")", so only a pointer that runs to the end of the line is taken."""
    return _LOG_POINTER.sub("", line)


def log_tail_once(message: str, logger) -> str:
    """Log ``message``'s log-tail block (``with_log_tail``) once with ``logger.error``, at once, and return
    the message with the block replaced by a pointer to the log (``split_log_tail``): what a transport
    puts in its ``FatalEvent``, which the run reports again at its end."""
    short, tail = split_log_tail(message)
    if tail:
        logger.error("%s\n%s", message.partition("\n")[0], tail)
    return short


_LOG_POINTER = re.compile(r"\s*\((?:" + "|".join(map(re.escape, _POINTERS)) + r").*\)$")
_TAIL_BLOCK = re.compile(r"\n--- last lines of (?P<path>[^\n]+) ---\n.*?\n--- end of [^\n]+ ---", re.S)


def redirect_output(path: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, inherited by vLLM's own
    child processes) at ``path``, appending, line-buffered."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):  # not a TextIOWrapper (e.g. replaced by a test runner)
            pass
