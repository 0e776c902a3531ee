"""MLPerf scenarios of the harness and how LoadGen 6.0.17 runs each one.

LoadGen has four scenarios (``mlperf_loadgen.TestScenario``: SingleStream, MultiStream, Server,
Offline) and no "Interactive" one. MLPerf's Interactive scenario of Llama 3.1 8B is a LoadGen
**Server** run with the model key ``llama3_1-8b-interactive``, whose mlperf.conf lines set the
tighter token latencies (verified on the 6.0.17 wheel with an empty user.conf, ``FromConfig``):

==================  ===========  ==========================  ============  ============  ==========
harness scenario    LoadGen      model key                   ttft_latency  tpot_latency  percentile
==================  ===========  ==========================  ============  ============  ==========
Offline             Offline      llama3_1-8b (or -edge)      (not used)    (not used)    —
Server              Server       llama3_1-8b                 2,000 ms      100 ms        99 %
Interactive         Server       llama3_1-8b-interactive     500 ms        30 ms         99 %
==================  ===========  ==========================  ============  ============  ==========

All three get ``use_token_latencies = 1``, ``performance_sample_count_override = 13368``,
``sample_concatenate_permutation = 1`` and ``min_duration = 600000`` from mlperf.conf; Server and
Interactive issue one sample per query at Poisson arrivals of ``target_qps`` (queries/s, a
``*.Server.target_qps`` line: LoadGen looks ``target_qps`` up under ``Server`` for both) and count
TTFT from each query's scheduled time. The submission tree names the folders ``Offline``,
``Server`` and ``Interactive`` under the one benchmark ``llama3.1-8b`` (submission checker
``constants.py``); a closed datacenter submission needs Offline plus Server or Interactive.

Any other spelling (``server``, ``interactive``, ``llama3_1-8b-Interactive``) or pairing (the
``-interactive`` key with ``--scenario Server``, the ``-edge`` key with a streaming scenario) is
refused by :func:`resolve_scenario` before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sut.constants import DEFAULT_MODEL_KEY, EDGE_MODEL_KEY, INTERACTIVE_MODEL_KEY, MODEL_KEYS, SCENARIO_MODEL_KEYS
from sut.errors import ScenarioError

#: Scenarios ``python -m sut run --scenario`` accepts, spelt as LoadGen and the submission checker spell them.
HARNESS_SCENARIOS = ("Offline", "Server", "Interactive")
#: Scenarios in which every sample's first token goes to LoadGen through ``FirstTokenComplete``.
STREAMING_SCENARIOS = ("Server", "Interactive")

#: harness scenario -> (LoadGen scenario, default model key, model keys allowed with it)
_TABLE = {
    "Offline": ("Offline", SCENARIO_MODEL_KEYS["Offline"], (DEFAULT_MODEL_KEY, EDGE_MODEL_KEY)),
    "Server": ("Server", SCENARIO_MODEL_KEYS["Server"], (DEFAULT_MODEL_KEY,)),
    "Interactive": ("Server", SCENARIO_MODEL_KEYS["Interactive"], (INTERACTIVE_MODEL_KEY,)),
}

#: Every (model key, LoadGen scenario) a harness run can have: the runs one user.conf may hold lines for.
LOADGEN_RUNS = tuple(dict.fromkeys((key, lg) for lg, _, keys in _TABLE.values() for key in keys))


def loadgen_scenario(scenario: str) -> Optional[str]:
    """The LoadGen scenario a harness scenario runs as (``Interactive`` -> ``Server``); None for another name."""
    return _TABLE[scenario][0] if scenario in _TABLE else None


#: Latency limits (p99, ms) of the streaming scenarios (mlperf.conf ``<key>.Server.ttft_latency`` /
#: ``tpot_latency``; the checker requires strictly less).
LATENCY_LIMITS_MS = {"Server": {"ttft": 2000, "tpot": 100}, "Interactive": {"ttft": 500, "tpot": 30}}

#: Backends that cannot report a first token, with the reason (``--sut NAME`` in a streaming scenario exits 2).
NO_FIRST_TOKEN = {
    "flame": ("Flame 0.6 (flamepy 0.6.0) has no first-token event: a task returns only when its whole batch is "
              "done, so the SUT cannot call LoadGen's FirstTokenComplete when a sample's first token is made, and "
              "TTFT would be the whole batch's latency. Run Server/Interactive with --sut vllm; --sut flame runs "
              "Offline only"),
}


@dataclass(frozen=True)
class Scenario:
    """One resolved scenario.

    Attributes:
        name: the harness / submission-tree name (``Offline``, ``Server``, ``Interactive``).
        loadgen: the LoadGen ``TestScenario`` name and the scenario given to ``FromConfig`` and
            used for the user.conf check (``Offline`` or ``Server``).
        model_key: the LoadGen model key (mlperf.conf), e.g. ``llama3_1-8b-interactive``.
    """

    name: str
    loadgen: str
    model_key: str

    @property
    def streaming(self) -> bool:
        """Whether LoadGen needs a ``FirstTokenComplete`` for every sample before its completion."""
        return self.name in STREAMING_SCENARIOS


def default_model_key(scenario: str) -> str:
    """The model key a scenario runs with when none is given (``Interactive`` → the -interactive key)."""
    return SCENARIO_MODEL_KEYS.get(scenario, DEFAULT_MODEL_KEY)


def resolve_scenario(scenario: str, model_key: Optional[str] = None) -> Scenario:
    """Check a scenario name and model key as given on the command line; return the resolved pair.

    Raises ``ScenarioError`` for a name LoadGen or the checker would not read (case matters:
    ``server`` is refused with the right spelling), or a model key that does not go with the
    scenario (``llama3_1-8b-interactive`` is only for ``--scenario Interactive``, ``-edge`` only
    for Offline here).
    """
    if scenario not in _TABLE:
        close = [s for s in HARNESS_SCENARIOS if s.lower() == str(scenario).lower()]
        hint = f" (names are case-sensitive: {close[0]!r})" if close else ""
        raise ScenarioError(f"scenario {scenario!r} is not one of {', '.join(HARNESS_SCENARIOS)}{hint}")
    lg_scenario, default_key, allowed = _TABLE[scenario]
    key = model_key or default_key
    if key not in allowed:
        if key == INTERACTIVE_MODEL_KEY:
            why = ("the -interactive key is MLPerf's Interactive scenario (a LoadGen Server run with 500/30 ms "
                   "limits): use --scenario Interactive")
        elif key == DEFAULT_MODEL_KEY and scenario == "Interactive":
            why = f"Interactive runs with the model key {INTERACTIVE_MODEL_KEY} (the default; leave --model-key out)"
        elif key == EDGE_MODEL_KEY:
            why = "the edge benchmark has no Server or Interactive scenario (edge: SingleStream and Offline)"
        else:
            why = f"LoadGen model keys of this benchmark: {', '.join(MODEL_KEYS)}"
        raise ScenarioError(f"model key {key!r} does not go with scenario {scenario!r}: {why}")
    return Scenario(name=scenario, loadgen=lg_scenario, model_key=key)


def check_backend(sut: str, scenario: Scenario) -> None:
    """Refuse a backend that cannot stream first tokens in a streaming scenario (``ScenarioError``)."""
    if scenario.streaming and sut in NO_FIRST_TOKEN:
        raise ScenarioError(f"--sut {sut} cannot run the {scenario.name} scenario: {NO_FIRST_TOKEN[sut]}")
