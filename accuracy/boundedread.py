"""Reading an input file that must be a regular file of bounded size, checked before it is opened.

Every reader of a user-given file (the dataset, an accuracy log, a reference file, ``--system-json``, the
``run.json`` beside an accuracy log) reads it through :func:`read_regular`: a FIFO, device (``/dev/zero``),
socket or folder is refused from its ``stat`` (never opened, so a FIFO cannot block the command), the size is
checked on the ``stat`` and the read takes at most ``limit + 1`` bytes (a file that grows meanwhile cannot take
more memory). The caller turns :class:`BoundedReadError` into its own message: ``problem`` says what is wrong,
``detail`` adds the number or the OS's words. A leaf: the standard library only.

Usage::

    try:
        raw = read_regular(path, 1 << 20)
    except BoundedReadError as e:
        raise MyInputError(f"{path}: {e}") from None   # str(e): a phrase such as "is a folder"
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: ``BoundedReadError.problem`` values.
MISSING, FOLDER, NOT_REGULAR, TOO_LARGE, GREW, NUL_IN_PATH, PERMISSION, UNREADABLE = (
    "missing", "folder", "not_regular", "too_large", "grew", "nul_in_path", "permission", "unreadable")


class BoundedReadError(Exception):
    """Why :func:`read_regular` read nothing.

    Attributes:
        path: the file (a ``Path``).
        problem: one of ``MISSING``, ``FOLDER``, ``NOT_REGULAR``, ``TOO_LARGE``, ``GREW``, ``NUL_IN_PATH``,
            ``PERMISSION``, ``UNREADABLE``.
        detail: the size in bytes (``TOO_LARGE``), the limit (``GREW``), the OS's words (``UNREADABLE``), else ``""``.
    """

    _PHRASES = {MISSING: "not found", FOLDER: "is a folder", NOT_REGULAR: "is not a regular file (a device, FIFO "
                "or socket)", TOO_LARGE: "is {detail} bytes, more than the limit", GREW: "grew past the {detail}-byte "
                "limit while it was read", NUL_IN_PATH: "holds a NUL byte in its path; no file has such a name",
                PERMISSION: "permission denied", UNREADABLE: "cannot be read: {detail}"}

    def __init__(self, path: Path, problem: str, detail: str = ""):
        self.path, self.problem, self.detail = path, problem, detail
        super().__init__(self._PHRASES[problem].format(detail=detail))


def _checked_stat(path: Path, limit: int) -> None:
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise BoundedReadError(path, FOLDER)
    if not stat.S_ISREG(st.st_mode):
        raise BoundedReadError(path, NOT_REGULAR)
    if st.st_size > limit:
        raise BoundedReadError(path, TOO_LARGE, f"{st.st_size:,}")


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path`` of at most ``limit`` bytes.

    Raises:
        BoundedReadError: a NUL in the path, missing, a folder, a FIFO / device / socket, larger than ``limit``
            on its ``stat`` or when read, permission denied, or another ``OSError`` (its ``strerror`` in
            ``detail``).
    """
    path = Path(path)
    if "\0" in str(path):  # os.stat raises ValueError "embedded null byte" (a path from a hand-edited record)
        raise BoundedReadError(path, NUL_IN_PATH)
    try:
        _checked_stat(path, limit)
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise BoundedReadError(path, MISSING) from None
    except PermissionError:
        raise BoundedReadError(path, PERMISSION) from None
    except IsADirectoryError:  # replaced by a folder between the stat and the open
        raise BoundedReadError(path, FOLDER) from None
    except OSError as e:
        raise BoundedReadError(path, UNREADABLE, str(e.strerror or e)) from None
    if len(raw) > limit:
        raise BoundedReadError(path, GREW, f"{limit:,}")
    return raw
