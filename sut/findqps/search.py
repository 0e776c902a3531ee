"""The target_qps search of ``python -m sut find-qps``, without running anything: ``Try`` (one short run's
verdict), ``search`` (bracket then bisect on VALID/INVALID), ``TryLog`` (the JSONL record ``--resume`` reads)
and ``Budget`` (``--budget-s``)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Optional

from accuracy.jsontext import JSONLinesError, read_jsonl
from sut.errors import RunFailed
from sut.settings.run import MAX_TARGET_QPS

log = logging.getLogger("find_qps")
#: New tries a search makes at most unless told otherwise (``--max-runs``).
DEFAULT_MAX_RUNS = 8


class AboveCap(RunFailed):
    """The next qps the search would try is above ``MAX_TARGET_QPS`` (the most a run takes): the search cannot go
    on, not even resumed (exit 1). ``qps``: that next rate; ``best``: the highest that holds so far (or None)."""

    def __init__(self, qps: float, best: Optional[float]):
        super().__init__(f"the next target_qps, {qps:g} queries/s, is above the {MAX_TARGET_QPS:g} cap of a run's "
                         f"target_qps, so the search cannot go on (resumed neither); highest VALID "
                         + ("none" if best is None else f"{best:g} queries/s"))
        self.qps, self.best = qps, best


@dataclass(frozen=True)
class Try:
    """One short run: ``qps`` asked, LoadGen's ``validity`` (``VALID``/``INVALID``/None = the run failed),
    its p99s (ms), output tokens/s, how long the try took (``wall_s``, engine start included: one-process
    mode, the first try of a session only) and ``queue_growing``: the harness saw the TTFT backlog grow through
    the try fast enough to pass the TTFT limit within LoadGen's 600 s (``sut.record.latency_trend``; None: not
    judged, e.g. a log written before it existed)."""

    qps: float
    validity: Optional[str]
    ttft_p99_ms: Optional[float] = None
    tpot_p99_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    folder: str = ""
    note: str = ""
    wall_s: Optional[float] = None
    queue_growing: Optional[bool] = None

    @property
    def valid(self) -> bool:
        return self.validity == "VALID"

    @property
    def growing(self) -> bool:
        """VALID by LoadGen, but its queue was growing (shown as GROWING)."""
        return self.valid and bool(self.queue_growing)

    def holds(self, allow_growth: bool = False) -> bool:
        """VALID, and (unless ``allow_growth``) its queue was not growing: a target a full-length run can keep."""
        return self.valid and (allow_growth or not self.growing)


def bounds(tries: Iterable[Try], allow_growth: bool = False) -> tuple[Optional[float], Optional[float]]:
    """``(highest qps that holds, lowest qps that does not)``: a VALID try whose queue was growing bounds from
    above like an INVALID one unless ``allow_growth`` (``Try.holds``); a failed try (validity None) bounds
    nothing: a crash or a time-out is no LoadGen verdict."""
    tries = [t for t in tries if t.validity is not None]
    good = [t.qps for t in tries if t.holds(allow_growth)]
    bad = [t.qps for t in tries if not t.holds(allow_growth)]
    return (max(good) if good else None), (min(bad) if bad else None)


def next_qps(lo: Optional[float], hi: Optional[float], start: Optional[float], factor: float,
             rel_tol: float) -> Optional[float]:
    """The next qps to try from the bounds, or None when ``hi / lo - 1 <= rel_tol`` (done; also when a noisy
    VALID lies above an INVALID). No bounds: ``start``; only INVALID: shrink; only VALID: grow."""
    if lo is None and hi is None:
        return start
    if lo is None:
        return hi / factor
    if hi is None:
        return lo * factor
    return None if hi / lo - 1 <= rel_tol else (lo + hi) / 2


#: Largest ``--factor``: a search grows x100 a try at most (1e308 jumped past the target_qps cap after one try, or
#: to 1e-308 after an INVALID first one).
MAX_FACTOR = 100.0

#: Smallest ``--rel-tol``: qps are shown with 6 significant digits (``%g``); bounds this close still differ there.
MIN_REL_TOL = 1e-4


def check_search_args(start: Optional[float], factor: float, rel_tol: float, max_runs: int, prior: list) -> None:
    """``ValueError`` naming the first search argument that cannot work (``search``'s): a missing ``start``
    without earlier tries, ``start`` not in (0, ``MAX_TARGET_QPS``], ``rel_tol`` not a finite number >= ``MIN_REL_TOL``,
    ``factor`` not in (1, ``MAX_FACTOR``], ``max_runs`` < 0 (or 0 without earlier tries)."""
    import math

    if start is None and not prior:
        raise ValueError("--start is needed without earlier tries (--resume FILE)")
    if max_runs == 0 and not prior:
        raise ValueError("--max-runs 0 without earlier tries (--resume FILE) would make no try at all")
    for name, v, ok in (("--start", start, start is None or start > 0),
                        ("--factor", factor, 1 < factor <= MAX_FACTOR), ("--rel-tol", rel_tol, rel_tol > 0),
                        ("--max-runs", max_runs, max_runs >= 0)):
        if v is not None and (not math.isfinite(v) or not ok):
            raise ValueError(f"{name} {v:g}: must be " + {"--start": "a number > 0",
                                                          "--factor": f"a number in (1, {MAX_FACTOR:g}]",
                                                          "--rel-tol": "a number > 0", "--max-runs": ">= 0"}[name])
    if start is not None and start > MAX_TARGET_QPS:
        raise ValueError(f"--start {start:g}: above the {MAX_TARGET_QPS:g} cap of a run's target_qps")
    if rel_tol < MIN_REL_TOL:
        raise ValueError(f"--rel-tol {rel_tol:g}: below {MIN_REL_TOL:g}: finer bounds are below the 6 digits a "
                         "target_qps is shown with (the user.conf line could round up to an INVALID try's), and "
                         "float bisection ends up trying one qps again and again")


def search(run: Callable[[float], Try], start: Optional[float], factor: float = 2.0, rel_tol: float = 0.05,
           max_runs: int = DEFAULT_MAX_RUNS, prior: Iterable[Try] = (), may_start: Callable[[float], bool] = lambda q: True,
           allow_growth: bool = False) -> tuple[Optional[float], list[Try]]:
    """Highest qps that holds (VALID, queue not growing unless ``allow_growth``: ``bounds``) and every try
    (``prior`` first, then the new ones, in order).

    ``run(qps)`` makes one try. Starting from the bounds of ``prior`` (or at ``start`` without any):
    grow by ``factor`` while VALID (shrink while INVALID) to bracket the boundary, then bisect until
    ``hi / lo - 1 <= rel_tol``; at most ``max_runs`` new tries, and none once ``may_start()`` says no, nor
    after a try that failed (validity None: no verdict, so the same qps would come next). Returns
    ``(None, tries)`` when no try was VALID. Raises ``ValueError`` for bad arguments (``start`` may be None
    only when ``prior`` holds tries), ``AboveCap`` when the next qps is above ``MAX_TARGET_QPS``.
    """
    tries = list(prior)
    check_search_args(start, factor, rel_tol, max_runs, tries)
    if start is None and tries:  # used only while no try bounds: the earlier tries all failed, so the last again
        start = tries[-1].qps
    lo, hi = bounds(tries, allow_growth)
    for _ in range(max_runs):
        q = next_qps(lo, hi, start, factor, rel_tol)
        if q is not None and q > MAX_TARGET_QPS:
            raise AboveCap(q, lo)
        if q is None or not may_start(q):
            break
        tries.append(run(q))
        if tries[-1].validity is None:
            break
        lo, hi = bounds(tries, allow_growth)
    return lo, tries


#: How every line ``TryLog.append`` writes begins (``asdict(Try)``: ``qps`` first).
TRY_LINE_START = b'{"qps": '


class TryLog:
    """The JSONL record of a search's tries (one object a line: the Try's fields + ``settings`` + ``finished``).

    ``settings`` (scenario, min duration, min query count, run arguments) is written with every try; earlier
    tries are only usable under the same settings. Raises ``ValueError`` naming file, line and field.
    ``seed``: another log (``--resume A --log B``) whose lines are copied in first (``seed()``: before the first
    append, and before this log is named as holding every try), so that this log alone holds the whole search."""

    def __init__(self, path: Path, settings: dict, seed: Optional[Path] = None):
        self.path, self.settings, self.seed_path = Path(path), settings, seed

    def seed(self) -> None:
        """Copy the seed log's lines into this log when it is missing or empty (else, or without one, nothing)."""
        if self.seed_path is not None and not (self.path.is_file() and self.path.stat().st_size):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(Path(self.seed_path).read_bytes())

    def read(self) -> list[Try]:
        """The tries recorded in the file. An unterminated last line that is not JSON (a write cut off,
        ``accuracy.jsontext.read_jsonl``) is skipped with a warning; any other bad line, or a try made with
        other settings, raises ``ValueError`` naming file and line."""
        tries, names = [], {f.name for f in fields(Try)}
        for n, rec in self._records():
            try:
                t = _checked_try(Try(**{k: v for k, v in rec.items() if k in names}))
                made_with = rec.get("settings", {})
                if not isinstance(made_with, dict):
                    raise ValueError(f"settings is {made_with!r}, not an object")
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"{self.path} line {n}: not a try record ({e})") from None
            for k, v in self.settings.items():
                if made_with.get(k) != v:
                    raise ValueError(f"{self.path} line {n}: made with {k} {made_with.get(k)!r}, this "
                                     f"search uses {v!r}; use the same settings or a new --log file")
            tries.append(t)
        return tries

    def _records(self) -> list:
        """``(line, record)`` of the file (``read_jsonl``); ``ValueError`` naming the line for one that is not JSON,
        or a last line without newline that is no try record cut off while written (it would be trimmed: a file
        that is not a try log, e.g. a dataset given by mistake, would lose it)."""
        try:
            jl = read_jsonl(self.path)
        except JSONLinesError as e:
            raise ValueError(f"{self.path} line {e.line}: not a try record ({e.reason})") from None
        if jl.cut_line is not None:
            with open(self.path, "rb") as f:
                cut = f.read().rsplit(b"\n", 1)[-1]
            if not (cut.startswith(TRY_LINE_START) or TRY_LINE_START.startswith(cut)):
                raise ValueError(f"{self.path} line {jl.cut_line}: not a try record, nor one cut off while written "
                                 f"(those start with {TRY_LINE_START.decode()}): not a find-qps try log")
            log.warning("%s line %d: an unfinished record (cut off while written), skipped", self.path, jl.cut_line)
        return jl.records

    def check_appendable(self) -> None:
        """``ValueError`` naming file and line when the file exists with lines that are no try records (appending
        trims a last line without newline: a file given by mistake would lose data)."""
        if self.path.is_file() and self.path.stat().st_size:
            for n, rec in self._records():
                if not (isinstance(rec, dict) and "qps" in rec and "settings" in rec):
                    raise ValueError(f"{self.path} line {n}: not a try record: not a find-qps try log")

    def append(self, t: Try) -> None:
        """Append ``t`` as one line and fsync it, so that it survives the process being killed next."""
        self.seed()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():  # drop an unterminated line left by a cut-off write
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.seek(0)
                    keep = f.read().rfind(b"\n") + 1
                    f.truncate(keep)
            line = dict(asdict(t), settings=self.settings, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            f.write((json.dumps(line) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def _checked_try(t: Try) -> Try:
    """``t`` when its fields have their types (``qps`` a number in (0, ``MAX_TARGET_QPS``]; the p99s, tokens/s and
    ``wall_s`` numbers >= 0 or null; ``validity`` VALID, INVALID or null; ``queue_growing`` a bool or null), else
    ``ValueError`` naming the field."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if not number(t.qps) or not 0 < t.qps <= MAX_TARGET_QPS:
        raise ValueError(f"qps {t.qps!r} is not a number in (0, {MAX_TARGET_QPS:g}] (the cap of a run's target_qps)")
    for name in ("ttft_p99_ms", "tpot_p99_ms", "tokens_per_s", "wall_s"):
        v = getattr(t, name)
        if v is not None and not number(v):
            raise ValueError(f"{name} {v!r} is not a number >= 0 or null")
    if t.validity not in ("VALID", "INVALID", None):
        raise ValueError(f"validity {t.validity!r} is not VALID, INVALID or null")
    if t.queue_growing not in (True, False, None):
        raise ValueError(f"queue_growing {t.queue_growing!r} is not true, false or null")
    return t


class Budget:
    """``may_start(q)``: True while one more try at ``q`` queries/s, as long as the estimate, ends within
    ``seconds`` of the start (None: no limit). The estimate: from the tries of this process that did not start
    engines; before one, the last try that did (``note(t, startup=True)``: one-process mode's first try, which
    later tries do not pay for); before any, the ``earlier`` (recorded) tries. The estimate is the longest of them
    or, when some ran at ``q`` or faster, the wall time of the one nearest above (or at) ``q`` scaled by ``its qps / q``,
    whichever is longer (a try issues at least ``--min-query-count`` queries: at half the rate it can take twice
    as long)."""

    def __init__(self, seconds: Optional[float], earlier: Iterable[Try] = (), clock=time.monotonic):
        self.seconds, self.clock, self.t0 = seconds, clock, clock()
        self._seed = [(t.wall_s, t.qps) for t in earlier if t.wall_s]
        self._startup: list[tuple[float, float]] = []
        self._pace: list[tuple[float, float]] = []

    def note(self, t: Try, startup: bool = False) -> Try:
        """Record ``t``'s ``wall_s`` and qps (its time included starting the engines: ``startup``); returns ``t``."""
        if startup:
            self._startup = [(t.wall_s or 0.0, t.qps)]
        else:
            self._pace.append((t.wall_s or 0.0, t.qps))
        return t

    def estimate(self, q: Optional[float] = None) -> float:
        """Seconds the next try (at ``q`` queries/s; None: unscaled) is expected to take (class docstring)."""
        tries = self._pace or self._startup or self._seed
        longest = max([wall for wall, _ in tries] or [0.0])
        above = [(qps, wall) for wall, qps in tries if q and qps >= q]
        if not above:
            return longest
        qps, wall = min(above)
        return max(longest, wall * qps / q)

    def may_start(self, q: Optional[float] = None) -> bool:
        used, need = self.clock() - self.t0, self.estimate(q)
        if self.seconds is None or used + need <= self.seconds:
            return True
        log.warning("no time for another try (%.0f s of %.0f s used, a try%s takes ~%.0f s)", used, self.seconds,
                    f" at {q:g} queries/s" if q else "", need)
        return False
