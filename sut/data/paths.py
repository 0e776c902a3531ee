"""Paths a command will write: checked before anything starts, and the folders making them would add (so that a
command that fails can remove what it made)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from sut.errors import InputError


def check_output_path(path, flag: str, folder: bool = False) -> None:
    """``InputError`` (exit 2, before anything is written) naming ``flag`` when ``path`` cannot be written: an
    empty path (it would be the current folder), a folder where a file is due (or a file where a folder is due),
    a missing parent that cannot be made (a file on the way), an existing path that is no regular file (a FIFO, a
    device), or no write permission (on ``path`` when it exists, else on its nearest existing folder)."""
    if not str(path).strip():  # Path("") is the current folder: a file or run folders would land in it
        raise InputError(f"{flag} {str(path)!r}: an empty path; name a {'folder' if folder else 'file'}")
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise InputError(f"{flag} {path} is a file, not a folder")
    if not folder and p.is_dir():
        raise InputError(f"{flag} {path} is a folder, not a file")
    if not folder and p.exists() and not p.is_file():  # a FIFO blocks the write, a device cannot be synced
        raise InputError(f"{flag} {path} is not a regular file (a device, FIFO or socket)")
    top = first_missing(p)
    near = p if top is None else top.parent  # the nearest folder (or file) that exists
    if top is not None and not near.is_dir():
        raise InputError(f"{flag} {path}: {near} is a file, not a folder, so {path} cannot be made")
    if not os.access(near, os.W_OK):
        raise InputError(f"{flag} {path}: {near} is not writable")


def first_missing(path: str | os.PathLike) -> Optional[Path]:
    """The outermost folder of ``path`` (absolute) that does not exist yet, ``path`` itself included: what
    ``mkdir(parents=True)`` of it adds; None when it exists."""
    p, top = Path(path).absolute(), None
    while not p.exists() and p != p.parent:
        top, p = p, p.parent
    return top
