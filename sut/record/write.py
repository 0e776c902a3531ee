"""The run record (``run.json``) of a LoadGen run: its first version and what the run adds to it.

``initial_record`` is what is on disk before any engine starts (settings, options, model, dataset,
versions, host); ``streaming_latency_record`` adds the harness's own TTFT/TPOT, trend and ``latency.png``
to LoadGen's results (``sut.record.loadgen_log``); ``write_record`` replaces ``run.json`` atomically
(``run.json.tmp``, then a rename; the temporary file is removed when the write fails). A full file system must
not leave a run "running": ``reserve_record_space`` sets :data:`RECORD_RESERVE_BYTES` aside in the run folder
when it is made, and ``write_final_record`` frees them to write the record again when a write fails for want of
space (``ENOSPC``, ``EDQUOT``). The checks
after a finished run write their own parts: ``sut.record.test06.test06_record``, ``sut.record.gate``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import hashlib
import importlib.metadata as md
import json
import logging
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from sut import __version__
from sut.constants import MIN_DURATION_MS, TESTED_VLLM
from sut.data.dataset import Dataset
from sut.record.latency_figure import write_latency_figure
from sut.record.loadgen_log import token_latencies
from sut.record.provenance import harness_commit
from sut.scenarios import LATENCY_LIMITS_MS, resolve_scenario

log = logging.getLogger("sut.run.harness")

def version(dist: str) -> Optional[str]:
    for name in (dist, dist + "-cpu"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None



def untested_vllm(engine_versions) -> Optional[str]:
    """A warning naming the vLLM versions among ``engine_versions`` (strings, e.g. ``"0.26.0"`` or
    ``"0.32.0+cpu"``; None entries skipped) outside ``sut.constants.TESTED_VLLM``, or None when all are inside."""
    def release(v: str) -> tuple:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])

    untested = sorted({v for v in engine_versions if v and not any(
        release(lo) <= release(v) < release(hi) for lo, hi in TESTED_VLLM)})
    if not untested:
        return None
    tested = ", ".join(f"{lo} <= v < {hi}" for lo, hi in TESTED_VLLM)
    return (f"vLLM {', '.join(untested)} is outside the versions this harness was tested with ({tested}): "
            "the run goes on; check its figures against a tested version")


def other_card(tuned_on: Optional[str], devices) -> Optional[str]:
    """A warning when ``devices`` (run.json ``devices``: dicts with ``name``) hold a device whose name does not
    contain ``tuned_on`` (case-insensitive; the preset's ``[run] tuned_on``), or whose name is unknown (a server
    given by URL reports none: ``kind`` ``"remote"``), else None."""
    if not tuned_on:
        return None
    named = [d for d in devices if isinstance(d, dict)]
    other = sorted({str(d["name"]) for d in named if d.get("name") and tuned_on.lower() not in str(d["name"]).lower()})
    unnamed = [d for d in named if not d.get("name")]
    if unnamed:
        why = ("servers given by URL report none" if all(d.get("kind") == "remote" for d in unnamed)
               else "the engines report none")
        other.append(f"an unknown card ({why})")
    if not other:
        return None
    return (f"the preset was tuned on {tuned_on}, this run's engines are on {', '.join(other)}: its engine settings "
            "and user.conf targets may not fit this card (find the targets again: python -m sut find-qps)")


def unread_weights(engines) -> Optional[str]:
    """A warning naming the engines (run.json ``engines``: dicts with ``engine_args``, ``url``) that did not report
    how their weights were loaded (no ``engine_args.load_format``: a server given by URL tells it only in vLLM's dev
    mode, ``/server_info``), else None."""
    unread = [str(e.get("url") or f"engine {e.get('engine')}") for e in engines
              if isinstance(e, dict) and "load_format" not in (e.get("engine_args") or {})]
    if not unread:
        return None
    return (f"the weights of {', '.join(unread)} are not read back (a server given by URL reports its load format "
            "only with VLLM_SERVER_DEV_MODE=1): this run's figures are only as real as the weights those servers "
            "loaded; an accuracy run checks them")


def streaming_latency_record(scenario: str, timed: bool, results: dict, ledger, run_dir: Path) -> dict:
    """``run.json`` ``latency`` of a Server / Interactive run (``token_latencies``) from LoadGen's ``results`` and
    the streaming ``ledger``'s own figures, with the TTFT trend projected to LoadGen's 600 s against the
    scenario's TTFT limit; for a ``timed`` (performance) run also ``latency.png`` in ``run_dir``
    (``sut.record.latency_figure``; ``figure``: its name, None when not drawn). An accuracy run is not timed: no limit,
    no trend verdict, no figure."""
    limits = LATENCY_LIMITS_MS.get(scenario) or {}
    a = ledger.latency_arrays()
    harness = ledger.latency_summary(MIN_DURATION_MS / 1e3, limits.get("ttft") if timed else None, a)
    out = token_latencies(scenario, results, harness)
    if timed:
        title = (f"{scenario}, target_qps {results.get('effective_target_qps')}: {results.get('result_validity')} "
                 "(harness latencies)")
        fig = write_latency_figure(run_dir / "latency.png", title, (a["issued"], a["ttft"]), (a["issued"], a["tpot"]),
                                   limits, harness.get("ttft_trend"))
        out["figure"] = fig.name if fig else None
    return out


def host_info() -> dict:
    """OS, CPU model and NVIDIA driver of this host (for ``systems/<system>.json``); None where unknown."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"os": os_name(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu_driver": driver}


def os_name() -> str:
    """The distribution as MLPerf system descriptions name it (``/etc/os-release`` ``PRETTY_NAME``, e.g. "Debian
    GNU/Linux 12 (bookworm)") with the kernel release; ``platform.platform()`` where there is no os-release."""
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    return f"{pretty} (kernel {platform.release()})" if pretty else platform.platform()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()




#: Bytes set aside in each run folder (:data:`RESERVE_NAME`) from its start until the run's last record is
#: written, freed to write that record when the file system is full. The largest ``run.json`` seen is ~49 KB
#: (a Flame run on one H200); the write needs it twice over for a moment (``run.json.tmp`` beside
#: ``run.json``): 1 MiB leaves ten times that.
RECORD_RESERVE_BYTES = 1 << 20
#: The reserve file in the run folder.
RESERVE_NAME = ".run.json.reserve"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(e: BaseException) -> bool:
    """Whether ``e`` is a write that failed for want of space (``ENOSPC``, ``EDQUOT``)."""
    return isinstance(e, OSError) and e.errno in _NO_SPACE


def write_record(run_dir: Path, record: dict) -> None:
    """Replace ``<run_dir>/run.json`` with ``record`` (JSON) atomically: written to ``run.json.tmp``, then
    renamed. ``OSError`` when the write fails (the old ``run.json`` stays; ``run.json.tmp`` is removed)."""
    tmp = run_dir / "run.json.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=2, default=str))
        os.replace(tmp, run_dir / "run.json")
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def reserve_record_space(run_dir: Path) -> None:
    """Allocate :data:`RECORD_RESERVE_BYTES` in ``<run_dir>/.run.json.reserve`` (real blocks, not a sparse file).
    ``OSError`` (the partial file removed) when the file system has not that much free."""
    path = run_dir / RESERVE_NAME
    try:
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, RECORD_RESERVE_BYTES)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                f.write(b"\0" * RECORD_RESERVE_BYTES)  # a file system without fallocate
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def release_record_space(run_dir: Path) -> None:
    """Remove the run folder's reserve (nothing when there is none)."""
    try:
        (run_dir / RESERVE_NAME).unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot remove %s: %s", run_dir / RESERVE_NAME, e)


def write_final_record(run_dir: Path, record: dict) -> None:
    """:func:`write_record`; when it fails for want of space, the reserve is freed and it is written again.
    ``OSError`` when that fails too."""
    try:
        write_record(run_dir, record)
    except OSError as e:
        if not no_space(e):
            raise
        log.warning("no space left writing %s; freeing the space set aside for it", run_dir / "run.json")
        release_record_space(run_dir)
        write_record(run_dir, record)


def options_record(options) -> dict:
    """``run.json`` ``options``: the fields of the backend's options object (None: ``{}``)."""
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return dataclasses.asdict(options)
    return dict(options)


def initial_record(rs, es, gen, options, model, dataset: Dataset, reasons: list, command: Optional[str],
                   audit_config: Optional[str], run_dir: Path) -> dict:
    """``run.json`` as written before the SUT starts (``status`` "running").

    ``rs`` / ``es`` / ``gen``: run, engine and generation settings; ``options``: the backend's
    options object; ``model``: ``sut.engine.ModelInfo``; ``reasons``: why the run is not compliant.
    """
    return {
        "record_version": 1,
        "status": "running",
        "kind": "mlperf-loadgen",
        "sut": rs.sut,
        "scenario": rs.scenario,
        "loadgen_scenario": resolve_scenario(rs.scenario, rs.model_key).loadgen,
        "mode": rs.mode,
        "model_key": rs.model_key,
        "compliance": {"compliant": not reasons, "reasons": reasons},
        "run_settings": dataclasses.asdict(rs),
        "engine_settings": dataclasses.asdict(es),
        "generation": dataclasses.asdict(gen),
        "options": options_record(options),
        "model": {"path": model.path, "config_sha256": model.config_sha256, "vocab_size": model.vocab_size,
                  "eos_token_ids": list(model.eos_token_ids)},
        "dataset": {"path": str(Path(rs.dataset).resolve()), "sha256": dataset.sha256, "samples": len(dataset),
                    "records_in_file": dataset.total_in_file, "prompt_tokens": dataset.length_stats()},
        "versions": {"project": __version__, "mlcommons-loadgen": version("mlcommons-loadgen"),
                     "python": platform.python_version(), "flamepy": version("flamepy"), **harness_commit()},
        "host": platform.node(),
        "host_info": host_info(),
        "command": command,
        "audit_config": ({"path": str(Path(audit_config).resolve()), "sha256": file_sha256(Path(audit_config))}
                         if audit_config else None),
        "started": now_iso(),
        "output_dir": str(run_dir),
    }


def now_iso() -> str:
    """Local time with its offset, to the second (``started`` / ``finished``)."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")
