"""One ``python -m sut run`` in a fresh process, and its ``run.json`` (shared by the comparison scripts).

A fresh process per run: LoadGen's ``FromConfig`` may run only once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RunOutcome:
    """``rc``: exit code (None: timed out); ``record``: the run's run.json (None: no run folder);
    ``folder``: the run folder; ``stderr``: its last 2,000 characters."""

    rc: Optional[int]
    record: Optional[dict]
    folder: Optional[Path]
    stderr: str


def run_once(run_args: list[str], out: Path, name: str, timeout_s: float) -> RunOutcome:
    """``python -m sut run RUN_ARGS --output-dir OUT --run-name NAME --no-progress`` from the repo root."""
    cmd = [sys.executable, "-m", "sut", "run", *run_args, "--output-dir", str(out), "--run-name", name, "--no-progress"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        rc, err = None, f"timed out after {timeout_s:.0f} s"
    folder = next(Path(out).glob(name + "*"), None)
    rec = json.loads((folder / "run.json").read_text()) if folder and (folder / "run.json").is_file() else None
    return RunOutcome(rc, rec, folder, err[-2000:])


def split_run_args(argv: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """``(script args, run args)``: everything after the first ``--`` goes to ``python -m sut run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
