"""``--quick``: a short dev run, also in Offline (sut/settings/run.py QUICK_*, sut/settings/loadgen.py).

LoadGen's one Offline query holds max(min_query_count, 1.1 x min duration x target_qps) samples rounded UP to
a multiple of the performance sample count, so a quick run that loads every sample of the dataset issues the
whole dataset at least; a quick run loads at most ``QUICK_PERFORMANCE_SAMPLES``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env

from sut import cli
from sut.errors import BadInput
from sut.settings.from_args import settings_from_args
from sut.settings.run import QUICK_PERFORMANCE_SAMPLES, RunSettings

#: LoadGen settings from mlperf.conf + user.conf (FromConfig: once per process), then one Offline test over a
#: SUT that answers at once; prints the performance sample count, the sizes of the queries issued, the reasons.
SNIPPET = """
import json, sys, tempfile
import mlperf_loadgen as lg
from sut.settings.run import RunSettings
from sut.settings.loadgen import loadgen_test_settings
kw, size = json.loads(sys.argv[1])
ts, reasons = loadgen_test_settings(RunSettings(**kw), size)
sizes = []
def issue(qs):
    sizes.append(len(qs))
    lg.QuerySamplesComplete([lg.QuerySampleResponse(q.id, 0, 0) for q in qs])
sut = lg.ConstructSUT(issue, lambda: None)
qsl = lg.ConstructQSL(size, ts.performance_sample_count_override, lambda s: None, lambda s: None)
log = lg.LogSettings()
log.log_output.outdir = tempfile.mkdtemp()
lg.StartTestWithLogSettings(sut, qsl, ts, log)
print(json.dumps({"psc": ts.performance_sample_count_override, "queries": sizes, "reasons": reasons}))
"""


def _offline_run(size: int, **kw) -> dict:
    base = dict(sut="vllm", dataset="x.json", user_conf=str(CPU_CONF))  # target_qps 3 samples/s
    out = subprocess.run([sys.executable, "-c", SNIPPET, json.dumps([{**base, **kw}, size])], capture_output=True,
                         text=True, env=sut_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_quick_fills_duration_and_query_count_unless_given():
    rs = RunSettings(sut="vllm", dataset="x.json", quick=True)
    assert (rs.min_duration_s, rs.min_query_count) == (10.0, 1)
    assert rs.performance_sample_cap == QUICK_PERFORMANCE_SAMPLES
    given = RunSettings(sut="vllm", dataset="x.json", quick=True, min_duration_s=30, min_query_count=5)
    assert (given.min_duration_s, given.min_query_count) == (30, 5)
    assert RunSettings(sut="vllm", dataset="x.json", quick=True, mode="accuracy").performance_sample_cap is None
    assert RunSettings(sut="vllm", dataset="x.json").performance_sample_cap is None


def test_the_quick_flag_and_a_preset_reach_run_settings(tmp_path):
    a = cli.build_parser().parse_args(["run", "--dataset", "x.json", "--model", str(TINY_MODEL), "--quick",
                                       "--min-duration-s", "20"])
    rs = settings_from_args(a)[0]
    assert rs.quick and rs.min_duration_s == 20 and rs.min_query_count == 1
    preset = tmp_path / "p.toml"
    preset.write_text('[run]\nquick = true\ndataset = "x.json"\n')
    rs = settings_from_args(cli.build_parser().parse_args(["run", "--config", str(preset), "--model",
                                                                str(TINY_MODEL)]))[0]
    assert rs.quick and rs.min_duration_s == 10.0 and rs.preset == str(preset)
    preset.write_text('[run]\npreset = "other.toml"\ndataset = "x.json"\n')
    with pytest.raises(BadInput, match=r"\[run\] preset is not a preset key"):
        settings_from_args(cli.build_parser().parse_args(["run", "--config", str(preset), "--model", str(TINY_MODEL)]))


def test_a_quick_offline_run_issues_about_10_s_of_samples_not_the_whole_dataset():
    plain = _offline_run(64, min_duration_s=10, min_query_count=1)  # what --quick did before: all 64, rounded up
    assert plain["queries"] == [64] and plain["psc"] == 64
    quick = _offline_run(64, quick=True)
    assert quick["psc"] == QUICK_PERFORMANCE_SAMPLES
    # 1.1 x 10 s x 3 samples/s = 33, rounded up to a multiple of 8
    assert quick["queries"] == [40], quick
    assert any("--quick" in r and f"{QUICK_PERFORMANCE_SAMPLES}" in r for r in quick["reasons"]), quick["reasons"]


def test_a_dataset_smaller_than_the_quick_cap_keeps_its_own_count():
    run = _offline_run(5, quick=True)
    assert run["psc"] == 5 and run["queries"] == [35]  # 33 rounded up to a multiple of 5
