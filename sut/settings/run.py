"""``RunSettings``: the settings of one LoadGen run (``python -m sut run``'s run flags, a preset's ``[run]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sut.constants import COMPLIANCE_TESTS, MAX_STALL_TIMEOUT_S, MODEL_KEYS, STALL_TIMEOUT_S, TEST06_AUDIT_CONFIG
from sut.scenarios import resolve_scenario

MODES = ("performance", "accuracy")

#: ``--quick`` (``RunSettings.quick``): LoadGen's min duration (s) and min query count unless set, and the
#: most performance samples a quick performance run loads (``performance_sample_cap``). LoadGen 6.0.17's
#: Largest ``--min-query-count``: LoadGen keeps it in a 64-bit count; beyond the Server schedule cap
#: (``sut.settings.loadgen.SERVER_MAX_QUERIES``) a run could never finish its queries anyway.
MAX_QUERY_COUNT = 10**9
#: Largest ``--target-qps`` (and ``--min-duration-s``) a run takes: a target of 1e7 already grew the harness past
#: 6 GB in 20 s (``sut.settings.loadgen``).
MAX_TARGET_QPS = 1e7
#: Offline query holds max(min_query_count, 1.1 x min duration x target_qps) samples rounded UP to a
#: multiple of the performance sample count (mlperf.conf's equal issue, ``sample_concatenate_permutation``;
#: Server's query count likewise), so without a cap a quick run issued the whole dataset at least (64 samples
#: of the demo set, 13,368 of cnn_eval.json); with 8, about 10 s of work at user.conf's target_qps
#: (measured: 40 samples at target_qps 3, 376 at 34).
QUICK_MIN_DURATION_S = 10.0
QUICK_MIN_QUERY_COUNT = 1
QUICK_PERFORMANCE_SAMPLES = 8


@dataclass(frozen=True)
class RunSettings:
    """Settings of one LoadGen run.

    Attributes:
        sut: registered backend name (``vllm``, ``flame``).
        dataset: cnn_eval-format JSON file.
        output_dir: base folder; each run gets its own sub-folder.
        mode: ``performance`` or ``accuracy``.
        scenario: ``Offline``, ``Server`` or ``Interactive`` (``sut/scenarios.py``: Interactive is a
            LoadGen Server run with the model key ``llama3_1-8b-interactive``).
        model_key: LoadGen model key (MLPerf mlperf.conf); None = the scenario's (``llama3_1-8b``,
            Interactive ``llama3_1-8b-interactive``); a key that does not go with the scenario is refused.
        user_conf: user.conf path, read once through ``FromConfig``.
        max_samples: use only the first N records (not compliant).
        quick: a short dev run (not compliant): ``min_duration_s`` / ``min_query_count`` default to
            ``QUICK_MIN_DURATION_S`` / ``QUICK_MIN_QUERY_COUNT``, and a performance run loads at most
            ``QUICK_PERFORMANCE_SAMPLES`` performance samples (``performance_sample_cap``).
        min_duration_s / min_query_count / target_qps: overrides after user.conf (not compliant,
            except ``target_qps`` which is marked so because it belongs in user.conf).
        tokenizer: tokenizer for the accuracy gate (default: the model folder).
        accuracy_gate: run the ROUGE + length gate after an accuracy-mode run.
        audit_config: LoadGen audit config (e.g. TEST06's ``audit.config``); None = never read one.
        compliance_test: ``TEST06`` runs MLPerf's TEST06: the shipped audit config (unless
            ``audit_config`` names another), then the TEST06 checks on the sampled accuracy log
            (``sut/record/test06.py``); the result goes to ``<run>/TEST06/`` and ``run.json``, and a
            failed check fails the run.
        enable_trace: LoadGen trace log (large; off by default).
        stall_timeout_s: fail if no sample completes for this long while samples are outstanding (``--stall-timeout-s``;
            default 300 s: on a GPU a sample completes every few ms to s, a Flame batch of 64 in seconds; a stopped or
            silent engine or server is the cause when none does for minutes; raise it for a device that slow).
        run_name: sub-folder name; default ``<time>-<sut>-<scenario>-<mode>``.
        engine_console: vLLM's own output (local engine workers' stdout/stderr) on the console
            (``--verbose``) instead of ``<run>/engine-N.log``.
        preset: the preset TOML these settings came from (``--config``), copied into the run folder as
            ``preset.toml`` next to ``user.conf``; recorded only (the merged settings are in ``run.json``).
        tuned_on: the accelerator a preset was tuned on (its ``[run] tuned_on``, e.g. ``"H100 80GB HBM3"``); a run
            whose engines report a device name without it is warned (console and run.json ``warnings``): its
            targets were found on another card. None: no claim.
    """

    sut: str
    dataset: str
    output_dir: str = "results"
    mode: str = "performance"
    scenario: str = "Offline"
    model_key: Optional[str] = None
    user_conf: str = "user.conf"
    max_samples: Optional[int] = None
    quick: bool = False
    min_duration_s: Optional[float] = None
    min_query_count: Optional[int] = None
    target_qps: Optional[float] = None
    tokenizer: Optional[str] = None
    accuracy_gate: bool = True
    audit_config: Optional[str] = None
    compliance_test: Optional[str] = None
    enable_trace: bool = False
    stall_timeout_s: float = STALL_TIMEOUT_S
    run_name: Optional[str] = None
    progress: bool = True
    engine_console: bool = False
    preset: Optional[str] = None
    tuned_on: Optional[str] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("dataset", "output_dir", "user_conf", "audit_config", "tokenizer"):  # "" would mean "."
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a path, got an empty string")
        if self.model_key is not None and self.model_key not in MODEL_KEYS:
            raise ValueError(f"model_key must be one of {MODEL_KEYS} (spelt exactly so), got {self.model_key!r}")
        # ScenarioError (a ValueError) names the right spelling or pairing; the key is then the scenario's
        object.__setattr__(self, "model_key", resolve_scenario(self.scenario, self.model_key).model_key)
        if self.quick:  # values given (flags, a preset) win
            for name, value in (("min_duration_s", QUICK_MIN_DURATION_S), ("min_query_count", QUICK_MIN_QUERY_COUNT)):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
        if self.compliance_test is not None:
            if self.compliance_test not in COMPLIANCE_TESTS:
                raise ValueError(f"compliance_test must be one of {COMPLIANCE_TESTS}, got {self.compliance_test!r}")
            if self.mode != "performance":
                raise ValueError(f"{self.compliance_test} is a performance-mode run (its audit config sets mode 2); "
                                 f"got mode {self.mode!r}")
            if self.audit_config and Path(self.audit_config).resolve() != TEST06_AUDIT_CONFIG.resolve():
                raise ValueError(f"--compliance-test {self.compliance_test} uses {TEST06_AUDIT_CONFIG}; do not also "
                                 f"pass --audit-config ({self.audit_config})")
        if self.audit_config and self.mode != "performance":
            raise ValueError("an audit config sets LoadGen's mode itself (TEST06: performance with a sampled accuracy "
                             f"log); run it with --mode performance, got {self.mode!r}")
        if self.run_name is not None:
            check_folder_name(self.run_name)
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples (--max-samples) must be >= 1, got {self.max_samples}")
        if self.min_query_count is not None and not 1 <= self.min_query_count <= MAX_QUERY_COUNT:
            raise ValueError(f"min_query_count (--min-query-count) must be in [1, {MAX_QUERY_COUNT:,}], got "
                             f"{self.min_query_count}")
        for name in ("min_duration_s", "target_qps"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and 0 < v <= MAX_TARGET_QPS):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a number in (0, 1e7], got {v}")
        if not (math.isfinite(self.stall_timeout_s) and 0 < self.stall_timeout_s <= MAX_STALL_TIMEOUT_S):
            raise ValueError(f"stall_timeout_s (--stall-timeout-s) must be a number of seconds in (0, "
                             f"{MAX_STALL_TIMEOUT_S:g}], got {self.stall_timeout_s}")

    @property
    def performance_sample_cap(self) -> Optional[int]:
        """The most performance samples LoadGen may load (``performance_sample_count_override``): for a
        quick performance run ``QUICK_PERFORMANCE_SAMPLES``, else None (mlperf.conf's count, at most the
        dataset). An accuracy run issues every sample whatever the count."""
        return QUICK_PERFORMANCE_SAMPLES if self.quick and self.mode == "performance" else None


def check_folder_name(name: str, what: str = "run_name") -> str:
    """``name`` if it is a plain folder name (a run folder's, inside ``--output-dir``), else ``ValueError`` naming
    ``what``: no '/', not empty, '.' or '..', no NUL, no leading or trailing spaces."""
    if name in ("", ".", "..") or "/" in name or "\0" in name or name != name.strip():
        raise ValueError(f"{what} must be a plain folder name inside --output-dir (no '/', not '.' or '..', no "
                         f"leading or trailing spaces), got {name!r}")
    return name
