"""Seats: which service process of a host hosts an engine slot, and which ones forward to it.

A seat is an exclusive ``flock`` on ``<lock_dir>/<slot key>.seat<k>.lock``. Seat 0 of a slot makes
its holder the slot's engine host; seats 1, 2, ... are forwarders. The lock lasts as long as the
process (or until its file descriptor is closed), so a dead host frees seat 0 for a forwarder to
take over.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import re
from pathlib import Path
from typing import Optional

from sut.engine import EngineSlot


def slot_keys(slots: list[EngineSlot]) -> list[str]:
    """A stable file-name key per slot, e.g. ``cuda-0.e0`` or ``cpu-0-1.e0``."""
    seen: dict[str, int] = {}
    keys = []
    for s in slots:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{s.kind}-{s.device}")
        k = seen.get(base, 0)
        seen[base] = k + 1
        keys.append(f"{base}.e{k}")
    return keys


def try_flock(path: Path) -> Optional[int]:
    """Lock ``path`` exclusively without waiting: its fd (holding our pid), or None if another process holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def take_seat(lock_dir: Path, keys: list[str], start: int = 0) -> tuple[int, int, int]:
    """Lock the first free seat, trying seat k of every slot in ``keys`` before seat k+1.

    Returns ``(index into keys, seat, fd)``; the lock lasts until ``fd`` is closed or the process ends.
    """
    for k in itertools.count(start):
        for i, key in enumerate(keys):
            fd = try_flock(lock_dir / f"{key}.seat{k}.lock")
            if fd is not None:
                return i, k, fd
    raise AssertionError("unreachable")
