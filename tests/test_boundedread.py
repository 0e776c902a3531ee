"""accuracy.boundedread: the one reader of user-given files that must be regular and bounded."""

from __future__ import annotations

import os

import pytest

from accuracy.boundedread import (
    FOLDER,
    MISSING,
    NOT_REGULAR,
    NUL_IN_PATH,
    TOO_LARGE,
    BoundedReadError,
    read_regular,
)


def _fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("make, problem, phrase", [
    (lambda t: t / "absent.json", MISSING, "not found"),
    (lambda t: t, FOLDER, "is a folder"),
    (_fifo, NOT_REGULAR, "FIFO"),  # refused from its stat: opening it would block
    (lambda t: "/dev/zero", NOT_REGULAR, "device"),
    (lambda t: str(t / "a\0b"), NUL_IN_PATH, "NUL"),
])
def test_refused_before_read(tmp_path, make, problem, phrase):
    with pytest.raises(BoundedReadError) as ei:
        read_regular(make(tmp_path), 1 << 10)
    assert ei.value.problem == problem and phrase in str(ei.value)


def test_size_limit_is_inclusive(tmp_path):
    p = tmp_path / "f.json"
    p.write_bytes(b"x" * 10)
    assert read_regular(p, 10) == b"x" * 10
    with pytest.raises(BoundedReadError) as ei:
        read_regular(p, 9)
    assert ei.value.problem == TOO_LARGE and ei.value.detail == "10" and "10 bytes" in str(ei.value)
