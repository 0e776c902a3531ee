"""Which code made a result: this repository's commit, from git or from a ``git archive`` of it.

A checkout answers ``git rev-parse HEAD`` (and whether tracked files differ from it). A tree unpacked from
``git archive`` (how ``scripts/bench/gpu_runs.sh`` ships the code to a GPU host, where there is no ``.git``)
has ``sut/record/COMMIT`` filled in by git's ``export-subst`` attribute (``.gitattributes``); in a checkout
that file holds the unexpanded placeholder and is ignored.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Optional

_REPO = Path(__file__).resolve().parents[2]
_ARCHIVED = Path(__file__).with_name("COMMIT")
_SHA = re.compile(r"[0-9a-f]{40}")


def harness_commit(repo: Path = _REPO, archived: Path = _ARCHIVED) -> dict:
    """``{"harness_commit": sha or None, "harness_uncommitted_changes": bool or None}``: git's answer in a
    checkout; else the commit ``git archive`` wrote into ``archived`` (changes unknown: None); else Nones."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip() if out.returncode == 0 else ""
        if _SHA.fullmatch(commit):
            dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return {"harness_commit": commit, "harness_uncommitted_changes": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"harness_commit": _archived_commit(archived), "harness_uncommitted_changes": None}


def _archived_commit(path: Path) -> Optional[str]:
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return text if _SHA.fullmatch(text) else None
