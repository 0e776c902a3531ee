"""One ``python -m sut run`` in a fresh process, and its ``run.json`` (shared by the comparison scripts).

A fresh process per run: LoadGen's ``FromConfig`` may run only once per process. A run past its time limit is
stopped as Ctrl-C stops it (SIGTERM: the harness stops the servers / engines it started and records the run
``failed``, "interrupted"), then, ``TIMEOUT_GRACE_S`` later, killed with its whole process group (SIGKILL).
The run has a session of its own, so a Ctrl-C or SIGTERM meant for the calling script does not reach it: the
script must turn SIGTERM into ``KeyboardInterrupt`` (``sut.exits.stop_on_sigterm_like_ctrl_c``, as
find_qps.py and bench_suts.py do), and ``run_with_timeout`` then stops the run the same way.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sut.constants import REPO

log = logging.getLogger(__name__)

#: Seconds a run past its time limit has, after SIGTERM, to stop its servers / engines and record itself before
#: its process group is killed (SIGKILL). 60 s: an engine's own shutdown takes seconds; the harness's drain
#: wait after a stop is ``sut.run.loadgen_watch.STREAMING_DRAIN_S`` (10 s) when the Server schedule has ended.
TIMEOUT_GRACE_S = 60.0

#: Seconds between two "still running" lines of a run (``run_once``): a run takes minutes and shows no bar.
HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class RunOutcome:
    """``rc``: exit code (None: timed out); ``record``: the run's run.json (None: no run folder);
    ``folder``: the run folder; ``stderr``: its last 2,000 characters (after a time-out, ending with a
    line that says so)."""

    rc: Optional[int]
    record: Optional[dict]
    folder: Optional[Path]
    stderr: str


def run_with_timeout(cmd: list[str], timeout_s: float, grace_s: Optional[float] = None,
                     heartbeat_s: Optional[float] = None, label: str = "run") -> tuple[Optional[int], str]:
    """Run ``cmd`` from the repo root in a process group of its own: ``(exit code, stderr)``; exit code None
    when it ran past ``timeout_s`` seconds and was stopped (SIGTERM, then SIGKILL to the whole process group
    ``grace_s`` seconds later, default ``TIMEOUT_GRACE_S``); stderr then ends with the time-out line. Every
    ``heartbeat_s`` seconds (None: never) it logs that ``label`` still runs, with the run's last log line."""
    grace_s = TIMEOUT_GRACE_S if grace_s is None else grace_s
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a left-behind grandchild cannot block reading
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True)
        t0, note = time.monotonic(), ""
        try:
            while True:
                left = t0 + timeout_s - time.monotonic()
                try:
                    rc = proc.wait(timeout=max(0.0, min(left, heartbeat_s or left)))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 >= timeout_s:
                        how = _stop(proc, grace_s)
                        rc, note = None, f"\ntimed out after {timeout_s:g} s: {how}\n"
                        break
                    log.info("%s: still running after %.0f s (%s)", label, time.monotonic() - t0, _last_line(err))
        except BaseException:  # Ctrl-C / SIGTERM of this script: its own session does not get the terminal's
            log.warning("stopping the running try (pid %d): up to %g s for its engine to shut down, then SIGKILL "
                        "(Ctrl-C again to kill it now)", proc.pid, grace_s)
            _stop(proc, grace_s)
            raise
        err.seek(0)
        return rc, err.read() + note


def _last_line(err) -> str:
    """The last non-empty line the run has written to ``err`` so far (its end only), or a note that there is none."""
    size = os.fstat(err.fileno()).st_size  # bytes; read with pread: the child writes at its own offset
    tail = os.pread(err.fileno(), 4000, max(0, size - 4000)).decode("utf-8", "replace")
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return f"last line: {lines[-1][:160]}" if lines else "nothing logged yet"


def _stop(proc: subprocess.Popen, grace_s: float) -> str:
    """SIGTERM ``proc``, wait ``grace_s`` seconds, then SIGKILL its whole process group; says which ended it."""
    proc.send_signal(signal.SIGTERM)
    how = f"killed (SIGKILL) {grace_s:g} s after SIGTERM"
    try:
        proc.wait(timeout=grace_s)
        how = "stopped (SIGTERM)"
    except subprocess.TimeoutExpired:
        pass
    finally:  # a second Ctrl-C during the grace still takes the whole group down
        _kill_group(proc.pid)
        proc.wait()
    return how


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the process group ``pgid`` (none left: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_once(run_args: list[str], out: Path, name: str, timeout_s: float,
             heartbeat_s: Optional[float] = HEARTBEAT_S) -> RunOutcome:
    """``python -m sut run RUN_ARGS --output-dir OUT --run-name NAME --no-progress`` from the repo root, stopped
    after ``timeout_s`` seconds (``run_with_timeout``, a line every ``heartbeat_s`` seconds while it runs); a
    run.json a killed run left ``running`` is recorded ``failed`` with the time-out."""
    cmd = [sys.executable, "-m", "sut", "run", *run_args, "--output-dir", str(out), "--run-name", name, "--no-progress"]
    try:
        rc, err = run_with_timeout(cmd, timeout_s, heartbeat_s=heartbeat_s, label=name)
    except BaseException as e:  # Ctrl-C / SIGTERM of this script: the run was stopped, maybe killed mid-drain
        _record_if_running(out, name, e)
        raise
    folder, rec = _record_if_running(out, name, TimeoutError(err.strip().splitlines()[-1]) if rc is None else None)
    return RunOutcome(rc, rec, folder, err[-2000:])


def _record_if_running(out: Path, name: str, cause: Optional[BaseException]) -> tuple[Optional[Path], Optional[dict]]:
    """``(run folder, its run.json)`` of run ``name`` in ``out`` (None, None: no folder yet); a run.json the killed
    run left ``running`` is recorded ``failed`` with ``cause`` (a time-out, or "interrupted" for a Ctrl-C / SIGTERM
    whose grace ran out while the run waited for LoadGen's schedule)."""
    folder = next(Path(out).glob(name + "*"), None)
    rec = json.loads((folder / "run.json").read_text()) if folder and (folder / "run.json").is_file() else None
    if cause is not None and rec is not None and rec.get("status") == "running":
        from sut.run.harness import record_failure

        record_failure(folder, rec, cause)
    return folder, rec


def split_run_args(argv: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """``(script args, run args)``: everything after the first ``--`` goes to ``python -m sut run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def cpu_noise_note(records) -> Optional[str]:
    """The note printed under ratios measured on a CPU: ``records`` are run.json dicts (None entries skipped); a
    note when any of them ran its engines on a CPU (``devices[].kind``), else None. On the 2-core machines of this
    project's CI the same SUT's tokens/s varied 0.90-1.01 between runs (docs/benchmarks.md), so CPU ratios only show
    that a path works; ratios worth quoting come from one GPU."""
    kinds = {(d or {}).get("kind") for r in records if isinstance(r, dict) for d in (r.get("devices") or [])}
    if "cpu" not in kinds:
        return None
    return (f"note: measured on a CPU ({os.cpu_count()} cores): run-to-run noise there is several % (0.90-1.01 seen "
            "on 2 cores), so these ratios only show that each path works; quote ratios measured on one GPU")

