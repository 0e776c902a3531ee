"""``python -m sut bench-harness``: its JSON shape over every case (real LoadGen, small sizes: no timing is
asserted), and a case that loses exactly-once fails the command."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, sut_env

#: The command's --quick path with smaller cases (the shape does not depend on the sizes).
_SMALL = """
import sys
from sut.run import bench_harness as b
b.QUICK = b.Sizes(offline_samples=2000, server_queries=1000, fixed_s=0.3, rounds=1)
{patch}
from sut.cli import main
sys.exit(main(["bench-harness", "--quick", "--json", sys.argv[1]]))
"""

_KEYS = {"scenario", "replicas", "first_tokens", "kind", "samples_per_s", "cpu_us_per_sample", "ratio_to_loadgen",
         "ttft_p99_ms"}


def _run(tmp_path, patch: str = ""):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-c", _SMALL.format(patch=patch), str(out)], cwd=REPO, env=sut_env(),
                       capture_output=True, text=True, timeout=600)
    return p, out


def test_every_case_is_measured_and_written_in_the_json_shape(tmp_path):
    p, out = _run(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert all(_KEYS <= set(c) for c in cases), cases
    got = {(c["kind"], c["scenario"], c["replicas"], c.get("replies"), c.get("target_qps")) for c in cases}
    want = {("loadgen", "Offline", None, None, None), ("loadgen", "Server", None, None, None)}
    want |= {("harness", s, n, r, None) for s in ("Offline", "Server") for n in (1, 8) for r in ("instant", "step")}
    want |= {(k, "Server", n, r, q) for q in (1300.0, 5000.0)
             for k, n, r in (("loadgen", None, None), ("harness", 8, "instant"))}
    assert got == want
    for c in cases:
        assert c["samples_per_s"] > 0 and c["cpu_us_per_sample"] > 0, c
        assert c["first_tokens"] == (c["scenario"] == "Server")
        assert (c["ttft_p99_ms"] is None) == (c["scenario"] == "Offline"), c
        assert c["ratio_to_loadgen"] == (1.0 if c["kind"] == "loadgen" else c["ratio_to_loadgen"]) > 0
        if c["kind"] == "harness" and c.get("target_qps"):
            assert c["ttft_p99_added_ms"] is not None
    assert "CPU µs/sample" in p.stdout and "Server @ 5,000 q/s, harness 8 x instant" in p.stdout


def test_an_answer_given_twice_fails_the_command(tmp_path):
    patch = """
from sut.core.transports.sim import SimTransport
_deliver = SimTransport._deliver
def twice(self, r, firsts, done):
    return _deliver(self, r, firsts, done) + _deliver(self, r, [], done)
SimTransport._deliver = twice
"""
    p, out = _run(tmp_path, patch)
    assert p.returncode == 1 and not out.exists(), p.stderr[-3000:]
    assert "answered twice" in p.stderr
