"""``python -m sut package``: the run folders' LoadGen logs must say what their ``run.json`` says.

``run.json`` is the harness's summary of a run and can be edited; the tree ships LoadGen's own logs, which the
submission checker reads. Before a run is laid out, :func:`check_logs_agree` re-reads its
``mlperf_log_detail.txt`` (``sut.record.loadgen_log.parse_loadgen_detail``) and refuses (``ComplianceError``) a run whose

- LoadGen scenario (``effective_scenario``) is not the one ``run.json`` gives (``loadgen_scenario``, else the
  LoadGen scenario of ``scenario``: Interactive is a LoadGen Server run);
- TTFT / TPOT limits (``requested_server_ttft_latency`` / ``..._tpot_latency``, ns) are looser than the limits of
  the scenario ``run.json`` gives (``sut.scenarios.LATENCY_LIMITS_MS``: a Server run relabelled Interactive);
- performance result (``result_validity``, which must be there) is not ``run.json``'s ``validity`` (performance
  runs only);

and, for the accuracy run, whose ``mlperf_log_accuracy.json`` does not hold exactly one response per issued
sample (``ledger.issued`` of ``run.json``; LoadGen's AccuracyOnly mode issues every sample once), holds a
different number of samples than the gate scored (``gen_num`` of ``accuracy.json``) or is not the file the gate
scored (``inputs.accuracy_log_sha256``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sut.errors import ComplianceError
from sut.record.loadgen_log import parse_loadgen_detail
from sut.scenarios import LATENCY_LIMITS_MS, loadgen_scenario


def check_logs_agree(folder: Path, rec: dict, role: str) -> None:
    """Refuse a run whose LoadGen detail log disagrees with ``rec`` (its ``run.json``); see the module docstring.
    ``role``: ``performance``, ``accuracy`` or ``TEST06`` (messages; the result check is for performance only)."""
    detail = parse_loadgen_detail(folder / "mlperf_log_detail.txt")
    where = f"{role} run {folder}"
    scenario = rec.get("scenario") or "Offline"
    want = rec.get("loadgen_scenario") or loadgen_scenario(scenario)
    got = detail.get("effective_scenario")
    if got is not None and want is not None and got != want:
        raise ComplianceError(f"{where}: run.json says scenario {scenario} (LoadGen {want}), but its "
                              f"mlperf_log_detail.txt ran LoadGen's {got}")
    limits = LATENCY_LIMITS_MS.get(scenario)
    for name in ("ttft", "tpot") if limits else ():
        ns = detail.get(f"requested_server_{name}_latency")
        if isinstance(ns, (int, float)) and ns > limits[name] * 1e6:
            raise ComplianceError(f"{where}: run.json says {scenario}, but its mlperf_log_detail.txt ran with a "
                                  f"{name.upper()} limit of {ns / 1e6:g} ms ({scenario}'s is {limits[name]} ms)")
    if role == "performance" and detail.get("result_validity") != rec.get("validity"):
        said = repr(detail["result_validity"]) if "result_validity" in detail else "nothing (no result_validity line)"
        raise ComplianceError(f"{where}: run.json says {rec.get('validity')!r}, but its mlperf_log_detail.txt says "
                              f"{said}")


def check_accuracy_log_complete(folder: Path, rec: dict, entries: list) -> None:
    """Refuse an accuracy run whose log (``entries``, ``accuracy.loadgen_log.read_accuracy_log``) is not one response
    per issued sample, or not the samples its ``accuracy.json`` scored."""
    where = f"accuracy run {folder}: mlperf_log_accuracy.json"
    idx = [e.qsl_idx for e in entries]
    dup = len(idx) - len(set(idx))
    if dup:
        raise ComplianceError(f"{where} holds {dup} repeated sample(s) (an AccuracyOnly run answers each sample once)")
    issued = (rec.get("ledger") or {}).get("issued")
    if isinstance(issued, int) and issued != len(idx):
        raise ComplianceError(f"{where} holds {len(idx)} responses, run.json's ledger says {issued} samples were issued")
    gate = _gate_json(folder / "accuracy.json")
    scored = (gate.get("scores") or {}).get("gen_num") if isinstance(gate.get("scores"), dict) else None
    if isinstance(scored, int) and scored != len(idx):
        raise ComplianceError(f"{where} holds {len(idx)} responses, accuracy.json scored {scored}: re-score the run "
                              "with python -m accuracy")
    want = (gate.get("inputs") or {}).get("accuracy_log_sha256") if isinstance(gate.get("inputs"), dict) else None
    if isinstance(want, str) and hashlib.sha256((folder / "mlperf_log_accuracy.json").read_bytes()).hexdigest() != want:
        raise ComplianceError(f"{where} is not the log its accuracy.json scored (sha256 {want[:12]}... recorded): "
                              "it changed after the gate; re-score the run with python -m accuracy")


def _gate_json(path: Path) -> dict:
    """The gate's ``accuracy.json`` ({} when there is none or it cannot be read as a JSON object)."""
    try:
        gate = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return gate if isinstance(gate, dict) else {}


def gate_input_problems(gate: dict) -> list[str]:
    """What a passed gate result (``gate``: the run's ``accuracy.json``) says about its own inputs: a problem when it
    recorded no sha256 of the log it scored (a result from before 2026-12-02; ``check_accuracy_log_complete``
    compares a recorded one) or scored against a reference other than the official targets (``python -m accuracy
    --reference FILE``, e.g. one made with ``--write-reference`` from a run)."""
    from accuracy.constants import REFERENCES

    inputs = gate.get("inputs") if isinstance(gate.get("inputs"), dict) else {}
    ref = (gate.get("reference") or {}).get("name") if isinstance(gate.get("reference"), dict) else None
    problems = [] if ref in REFERENCES else [
        f"accuracy run: the gate passed against the reference {ref!r}, not the official targets "
        f"({', '.join(REFERENCES)}): score it with python -m accuracy --reference auto"]
    if not isinstance(inputs.get("accuracy_log_sha256"), str):
        problems.append("accuracy run: accuracy.json records no sha256 of the log it scored (scored before "
                        "2026-12-02): re-score it with python -m accuracy")
    return problems
