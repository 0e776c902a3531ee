import dataclasses
import re
import subprocess
import sys

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env

from sut.base import get_sut, sut_names
from sut.engine import EngineSettings, GenerationSettings, plan_engines, read_model_info
from sut.errors import EngineError, RunFailed
from sut.settings import loadgen as loadgen_settings
from sut.settings.loadgen import loadgen_test_settings
from sut.settings.run import RunSettings

SNIPPET = """
import json, sys
from sut.settings.run import RunSettings
from sut.settings.loadgen import loadgen_test_settings
kw, size = json.loads(sys.argv[1])
ts, reasons = loadgen_test_settings(RunSettings(**kw), size)
fields = ["min_duration_ms", "min_query_count", "performance_sample_count_override", "sample_concatenate_permutation",
          "use_token_latencies", "offline_expected_qps", "qsl_rng_seed"]
out = {f: getattr(ts, f) for f in fields}
out.update(scenario=int(ts.scenario), mode=int(ts.mode), reasons=reasons)
print(json.dumps(out))
"""


def settings_in_fresh_process(size, **kw):
    """LoadGen loads mlperf.conf only on the first FromConfig of a process, so each case runs in its own."""
    import json
    import subprocess
    import sys

    from conftest import sut_env

    base = dict(sut="vllm", dataset="x.json", user_conf=str(REPO / "user.conf"))
    base.update(kw)
    out = subprocess.run([sys.executable, "-c", SNIPPET, json.dumps([base, size])], capture_output=True, text=True,
                         env=sut_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def rs(**kw):
    base = dict(sut="vllm", dataset="x.json", user_conf=str(REPO / "user.conf"))
    base.update(kw)
    return RunSettings(**base)


def test_official_settings_are_compliant_and_come_from_mlperf_conf():
    import mlperf_loadgen as lg

    ts = settings_in_fresh_process(13368)
    assert ts["reasons"] == []
    assert ts["scenario"] == int(lg.TestScenario.Offline) and ts["mode"] == int(lg.TestMode.PerformanceOnly)
    assert ts["min_duration_ms"] == 600000 and ts["min_query_count"] == 13368
    assert ts["performance_sample_count_override"] == 13368
    assert ts["sample_concatenate_permutation"] and ts["use_token_latencies"]
    assert ts["offline_expected_qps"] == 34  # shipped user.conf
    assert ts["qsl_rng_seed"] == 2085463073848966840  # mlperf.conf seed, not 0


@pytest.mark.parametrize("conf", sorted(p.name for p in (REPO / "loadgen_configs").glob("*.user.conf")))
def test_every_shipped_user_conf_is_compliant_and_read_by_loadgen(conf):
    """Each preset's user.conf sets only target_qps; LoadGen must read that value and keep the run compliant."""
    import re

    path = REPO / "loadgen_configs" / conf
    want = float(re.search(r"^llama3_1-8b\.Offline\.target_qps\s*=\s*([0-9.]+)", path.read_text(), re.M).group(1))
    ts = settings_in_fresh_process(13368, user_conf=str(path))
    assert ts["reasons"] == [] and ts["min_duration_ms"] == 600000
    assert ts["offline_expected_qps"] == want


def test_accuracy_mode_and_edge_key(tmp_path):
    import mlperf_loadgen as lg

    conf = tmp_path / "edge.conf"
    conf.write_text("llama3_1-8b-edge.Offline.target_qps = 20\n")
    ts = settings_in_fresh_process(5000, mode="accuracy", model_key="llama3_1-8b-edge", user_conf=str(conf))
    assert ts["mode"] == int(lg.TestMode.AccuracyOnly) and ts["performance_sample_count_override"] == 5000
    assert ts["reasons"] == []


def test_every_override_is_reported_non_compliant():
    ts = settings_in_fresh_process(64, min_duration_s=10, min_query_count=1, target_qps=3.5, max_samples=64)
    text = "; ".join(ts["reasons"])
    for word in ("64 samples", "min_duration overridden", "min_query_count overridden", "target_qps", "--max-samples"):
        assert word in text
    assert sum("min_duration" in r for r in ts["reasons"]) == 1  # the short duration is said once
    assert ts["min_duration_ms"] == 10000 and ts["performance_sample_count_override"] == 64
    assert ts["offline_expected_qps"] == 3.5


def test_from_config_only_once_per_process(monkeypatch):
    monkeypatch.setattr(loadgen_settings, "_FROM_CONFIG_CALLED", True)
    with pytest.raises(RunFailed, match="already called"):
        loadgen_test_settings(rs(), 13368)


def test_bad_user_conf_is_rejected(tmp_path):
    p = tmp_path / "user.conf"
    p.write_text("llama3_1-8b.Offline.target_qps = fast\n")
    import subprocess
    import sys

    from conftest import sut_env
    code = ("from sut.run.harness import RunSettings, loadgen_test_settings; import sys\n"
            "loadgen_test_settings(RunSettings(sut='vllm', dataset='x', user_conf=sys.argv[1]), 13368)")
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, env=sut_env(), cwd=REPO)
    assert out.returncode != 0 and f"{p}, line 1" in out.stderr and "value 'fast' is not a number" in out.stderr


def test_missing_user_conf(tmp_path, monkeypatch):
    monkeypatch.setattr(loadgen_settings, "_FROM_CONFIG_CALLED", False)
    with pytest.raises(RunFailed, match="not found"):
        loadgen_test_settings(rs(user_conf=str(tmp_path / "none.conf")), 13368)


@pytest.mark.parametrize("kw, msg", [
    ({"mode": "fast"}, "mode"), ({"scenario": "server"}, "scenario"), ({"model_key": "llama2-70b"}, "model_key"),
    ({"mode": "accuracy", "audit_config": "loadgen_configs/TEST06/audit.config"}, "audit config sets LoadGen's mode"),
    ({"min_duration_s": -5.0}, "min_duration_s"), ({"min_duration_s": float("nan")}, "min_duration_s"),
    ({"min_duration_s": 1e30}, "min_duration_s"), ({"target_qps": 0.0}, "target_qps"),
    ({"min_query_count": 0}, "min_query_count"), ({"max_samples": 0}, "max_samples"),
    ({"stall_timeout_s": float("inf")}, "stall_timeout_s"),
    ({"stall_timeout_s": 1e308}, r"stall_timeout_s \(--stall-timeout-s\) must be a number of seconds in \(0, 86400\]"),
])
def test_run_settings_validate(kw, msg):
    with pytest.raises(ValueError, match=msg):
        rs(**kw)


def test_preset_values_of_the_wrong_type_are_refused_by_name():
    from sut.engine import settings_from_mapping

    with pytest.raises(ValueError, match=r"RunSettings.max_samples must be an integer, got '4' \(str\)"):
        settings_from_mapping(RunSettings, {"sut": "vllm", "dataset": "x", "max_samples": "4"})
    with pytest.raises(ValueError, match="EngineSettings.enforce_eager must be true/false"):
        settings_from_mapping(EngineSettings, {"model": "m", "enforce_eager": "yes"})
    with pytest.raises(ValueError, match="max_num_seqs must be an integer"):
        settings_from_mapping(EngineSettings, {"model": "m", "max_num_seqs": True})
    ok = settings_from_mapping(RunSettings, {"sut": "vllm", "dataset": "x", "min_duration_s": 10, "target_qps": None})
    assert ok.min_duration_s == 10


def test_user_conf_that_weakens_mlperf_conf_is_reported(tmp_path):
    sneaky = tmp_path / "sneaky.conf"
    sneaky.write_text("llama3_1-8b.Offline.target_qps = 40\n*.Offline.performance_sample_count_override = 2\n"
                      "*.*.sample_concatenate_permutation = 0\nllama3_1-8b.*.min_query_count = 1\n"
                      "*.Offline.max_duration = 5000\n")
    ts = settings_in_fresh_process(13368, user_conf=str(sneaky))
    text = "; ".join(ts["reasons"])
    for key, old, new in (("performance_sample_count_override", 13368, 2), ("sample_concatenate_permutation", True, False),
                          ("min_query_count", 13368, 1), ("max_duration_ms", 0, 5000)):
        assert f"changes {key} from mlperf.conf's {old} to {new}" in text, text
    stricter = tmp_path / "stricter.conf"
    stricter.write_text("llama3_1-8b.Offline.target_qps = 40\n*.Offline.min_duration = 700000\n")
    assert settings_in_fresh_process(13368, user_conf=str(stricter))["reasons"] == []


def test_prefix_caching_is_refused_for_mlperf_runs():
    from sut.core.transport import TransportSpec, make_transport
    from sut.errors import TransportError

    es = EngineSettings(model=str(TINY_MODEL), enable_prefix_caching=True, device="cpu")
    t = make_transport("local", TransportSpec(engine=es, generation=GenerationSettings()))
    with pytest.raises(TransportError, match="not allowed"):
        t.start(sink=None)  # refused before any engine starts
    assert t.pool.engines[0].pid is None


def test_vllm_kwargs_always_pass_prefix_caching_explicitly():
    kw = EngineSettings(model="m").vllm_kwargs()
    assert kw["enable_prefix_caching"] is False and kw["skip_tokenizer_init"] is True


def test_gpu_plan_one_engine_per_visible_gpu_and_shared_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    slots = plan_engines(EngineSettings(model="m", engines_per_device=2, gpu_memory_utilization=0.9))
    assert [(s.kind, s.device) for s in slots] == [("cuda", "2"), ("cuda", "2"), ("cuda", "3"), ("cuda", "3")]
    assert dict(slots[2].env)["CUDA_VISIBLE_DEVICES"] == "3"
    assert EngineSettings(model="m", gpu_memory_utilization=0.9).vllm_kwargs(gpu_share=2)["gpu_memory_utilization"] == 0.45


def test_engines_sharing_a_gpu_start_one_after_the_other_unless_their_kv_cache_is_given(monkeypatch):
    """Memory profiling must see the previous engine's footprint; with the KV cache in bytes nothing is profiled."""
    from sut.engine.pool import EnginePool

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    es = EngineSettings(model="m", device="cuda", engines_per_device=2, gpu_memory_utilization=0.9)
    waves = [[(e.slot.index, e.slot.device) for e in w] for w in EnginePool(es, GenerationSettings())._waves()]
    assert waves == [[(0, "2"), (2, "3")], [(1, "2"), (3, "3")]]
    given = dataclasses.replace(es, kv_cache_memory_bytes=2**30)
    assert [[e.slot.index for e in w] for w in EnginePool(given, GenerationSettings())._waves()] == [[0, 1, 2, 3]]
    assert given.vllm_kwargs(gpu_share=2)["kv_cache_memory_bytes"] == 2**30
    assert "kv_cache_memory_bytes" not in es.vllm_kwargs()
    with pytest.raises(ValueError, match=r"engine setting kv_cache_memory_bytes must be >= 1 \(an integer\), got 0"):
        EngineSettings(model="m", kv_cache_memory_bytes=0)


def test_kv_bytes_per_block_is_vllms_full_attention_page_times_the_layers():
    """2 (K, V) x block size x KV heads x head size x element size x layers; the element size is the KV
    cache dtype's, ``auto`` the model's; None where vLLM's config lacks a part."""
    from types import SimpleNamespace as NS

    import torch

    from sut.engine.readback import kv_bytes_per_block

    mc = NS(dtype=torch.bfloat16, get_num_kv_heads=lambda pc: 8, get_head_size=lambda: 128,
            get_num_layers=lambda pc: 32)
    cfg = NS(model_config=mc, cache_config=NS(cache_dtype="auto", block_size=16), parallel_config=None)
    assert kv_bytes_per_block(cfg, torch) == 2 * 16 * 8 * 128 * 2 * 32 == 2**21  # Llama-3.1-8B, bf16: 2 MiB
    cfg.cache_config.cache_dtype = "fp8"
    assert kv_bytes_per_block(cfg, torch) == 2**20
    cfg.cache_config.cache_dtype = "no-such-dtype"
    assert kv_bytes_per_block(cfg, torch) is None
    assert kv_bytes_per_block(NS(model_config=NS(), cache_config=NS(cache_dtype="auto", block_size=16),
                                 parallel_config=None), torch) is None


def test_cpu_plan_splits_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3})
    slots = plan_engines(EngineSettings(model="m", device="cpu", engines_per_device=2))
    binds = [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in slots]
    assert binds == ["0-1", "2-3"]
    assert dict(slots[0].env)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(EngineError, match="cores"):
        plan_engines(EngineSettings(model="m", device="cpu", engines_per_device=5))


def test_cpu_kv_caches_larger_than_the_host_are_refused_before_any_engine(monkeypatch):
    """Before: cpu_kvcache_gib 100000 started the engine, which vLLM then refused ("less than requested")."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4 * 2 ** 18}[name])  # 4 GiB
    assert len(plan_engines(EngineSettings(model="m", device="cpu", engines_per_device=2, cpu_kvcache_gib=2))) == 2
    with pytest.raises(EngineError, match=r"2 CPU engine\(s\) x cpu_kvcache_gib 3 = 6.0 GiB of KV cache, more than "
                                          r"this host's 4.0 GiB of memory"):
        plan_engines(EngineSettings(model="m", device="cpu", engines_per_device=2, cpu_kvcache_gib=3))
    with pytest.raises(EngineError, match=r"kv_cache_memory_bytes 5368709120 = 5.0 GiB"):
        plan_engines(EngineSettings(model="m", device="cpu", kv_cache_memory_bytes=5 * 2 ** 30))


def test_max_num_seqs_above_vllms_default_step_budget_is_refused_before_any_engine(monkeypatch):
    """vLLM picks the per-step token budget from the device and entry point when it is unset, and refuses one
    below max_num_seqs only once the engine started: the harness refuses it first, on the budget of these slots."""
    import subprocess as sp

    from sut.engine import check_step_budget
    from sut.engine.devices import EngineSlot, default_step_tokens

    assert [default_step_tokens("cpu"), default_step_tokens("cpu", server=True)] == [4096, 2048]
    h100, a100, l4 = (81559, "NVIDIA H100 80GB HBM3"), (81920, "NVIDIA A100-SXM4-80GB"), (23034, "NVIDIA L4")
    assert [default_step_tokens("cuda", *g) for g in (h100, a100, l4)] == [16384, 8192, 8192]
    assert [default_step_tokens("cuda", *g, server=True) for g in (h100, a100, l4)] == [8192, 2048, 2048]
    assert default_step_tokens("cuda", 143771, "NVIDIA H200", server=True) == 8192  # 140 GiB: under 160
    assert default_step_tokens("cuda", 183359, "NVIDIA B200", server=True) == 16384
    cpu = [EngineSlot(0, "cpu", "0-1")]
    check_step_budget(EngineSettings(model="m", max_num_seqs=4096), cpu)
    with pytest.raises(EngineError, match="max_num_seqs 4097 with max_num_batched_tokens unset: .* 4,096 tokens"):
        check_step_budget(EngineSettings(model="m", max_num_seqs=4097), cpu)
    with pytest.raises(EngineError, match=r"2,048 tokens \(vllm serve on cpu\)"):
        check_step_budget(EngineSettings(model="m", max_num_seqs=4096), cpu, server=True)
    check_step_budget(EngineSettings(model="m", max_num_seqs=9000, max_num_batched_tokens=9000), cpu)  # given
    smi = "0, GPU-aaa, 81559, NVIDIA H100 80GB HBM3\n1, GPU-bbb, 23034, NVIDIA L4\n"
    monkeypatch.setattr(sp, "run", lambda *a, **k: sp.CompletedProcess(a, 0, stdout=smi))
    one, both = [EngineSlot(0, "cuda", "GPU-aaa")], [EngineSlot(0, "cuda", "0"), EngineSlot(1, "cuda", "1")]
    check_step_budget(EngineSettings(model="m", max_num_seqs=16384), one)
    with pytest.raises(EngineError, match="8,192 tokens"):  # the smallest card's budget counts
        check_step_budget(EngineSettings(model="m", max_num_seqs=9000), both)
    check_step_budget(EngineSettings(model="m", max_num_seqs=99999), [EngineSlot(0, "cuda", "MIG-x")])  # unknown


def test_cuda_requested_without_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(EngineError, match="no GPU"):
        plan_engines(EngineSettings(model="m", device="cuda"))


def test_model_info_reads_eos_from_generation_config(tmp_path):
    info = read_model_info(TINY_MODEL)
    assert info.vocab_size == 128256 and info.eos_token_ids == (128001, 128008, 128009)
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "eos_token_id": 2}')
    assert read_model_info(tmp_path).eos_token_ids == (2,)
    with pytest.raises(EngineError, match="config.json"):
        read_model_info(tmp_path / "missing")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": []}')  # no EOS check could hold
    with pytest.raises(EngineError, match="eos_token_id is an empty list"):
        read_model_info(tmp_path)


def test_registry_knows_vllm():
    assert "vllm" in sut_names()
    with pytest.raises(KeyError, match="known"):
        get_sut("nope")


def test_gpu_memory_utilization_passed_when_set_and_split_when_shared():
    assert EngineSettings(model="m", gpu_memory_utilization=0.9).vllm_kwargs()["gpu_memory_utilization"] == 0.9
    assert "gpu_memory_utilization" not in EngineSettings(model="m").vllm_kwargs()
    assert EngineSettings(model="m").vllm_kwargs(gpu_share=2)["gpu_memory_utilization"] == 0.45


# ------------------------------------------------------------------------- user.conf lines that cannot apply
QPS = "llama3_1-8b.Offline.target_qps = 3\n"


@pytest.mark.parametrize("text, line, message", [
    ("llama3.1-8b.Offline.target_qps = 3\n", 1, "model key 'llama3.1-8b' is not a LoadGen model key"),
    ("llama3_1-8b.offline.target_qps = 3\n", 1, "scenario 'offline' is not a LoadGen scenario (they are case-sensitive: 'Offline')"),
    ("llama3_1-8b.Offline.target_qps=3\n", 1, "with spaces around '='"),
    ("llama3_1-8b.Offline.target_qps =\n", 1, "LoadGen ignores this line silently"),
    ("llama3_1-8b.Offline.target_qps # = 3\n", 1, "LoadGen ignores this line silently: a key without '= value'"),
    (QPS + "llama3_1-8b.Offline.target_qsp = 3\n", 2, "no setting 'target_qsp' (did you mean 'target_qps'?)"),
    (QPS + "llama3_1-8b.Server.target_qsp = 3\n", 2, "no setting 'target_qsp' (did you mean 'target_qps'?)"),
    (QPS + "*.*.target_latency = 10\n", 2, "no effect in the Offline scenario"),
    (QPS + "*.Offline.target_latency = 10\n", 2, "no effect in the Offline scenario"),
    (QPS + "*.*.qsl_rng_seed = 1\n", 2, "only from its embedded mlperf.conf"),
    (QPS + "*.*.mode = 1\n", 2, "from --mode"),
    (QPS + "qps = 3\n", 2, "the form model.scenario.setting"),
    ("*.Offline.target_qps = 5\n" + QPS + "llama3_1-8b-edge.Offline.target_qps = 4\n", 1, "takes target_qps from line 2"),
    (QPS + "# again\n" + QPS, 1, "takes target_qps from line 3"),
    (QPS + "*.Offline.min_duration = 1.5e5\n", 2, "min_duration is a whole number"),
    (QPS + "*.Offline.min_query_count = 010\n", 2, "leading 0 is octal"),
    (QPS + "*.Offline.min_query_count = -1\n", 2, "a sign wraps"),
    ("llama3_1-8b.Offline.target_qps = 3 4\n", 1, "one value per line"),
    ("llama3_1-8b.Offline.target_qps = 3 # fast\n", 1, "comment after the value"),
    ("#comment without a space\n" + QPS, 1, "only when a space follows it"),
    ("llama3_1-8b.Offline.target_qps = fast\n", 1, "value 'fast' is not a number"),
    ("llama3_1-8b.Offline.target_qps = inf\n", 1, "finite"),
    (QPS + "*.Offline.token_latency_scaling_factor = 9\n", 2, "only when infer_token_latencies = 1"),
])
def test_user_conf_line_that_loadgen_ignores_or_rejects_is_refused_by_file_and_line(tmp_path, text, line, message):
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        check_user_conf(p, "llama3_1-8b", "Offline")
    assert f"{p}, line {line} (" in str(e.value) and message in str(e.value), str(e.value)


def test_user_conf_encodings_loadgen_misreads_are_refused(tmp_path):
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_bytes(b"\xef\xbb\xbf" + QPS.encode())
    with pytest.raises(InputError, match="byte-order mark"):
        check_user_conf(p, "llama3_1-8b", "Offline")
    p.write_text(QPS, encoding="utf-16")
    with pytest.raises(InputError, match="NUL bytes"):
        check_user_conf(p, "llama3_1-8b", "Offline")


def test_user_conf_lines_that_apply_are_accepted_with_loadgens_wildcards(tmp_path):
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text("# comment\n\n   \t\n#llama3_1-8b.Offline.target_qps = 99\n#disabled\n*.Offline.target_qps = 3.5\r\n"
                 "llama3_1-8b.*.min_duration = 700000\n*.*.min_query_count = 0x5000\n"
                 "llama3_1-8b.Offline.max_duration\t=\t0\n*.Offline.infer_token_latencies = 1\n"
                 "*.*.token_latency_scaling_factor = 7\n")
    assert check_user_conf(p, "llama3_1-8b", "Offline") == {
        "target_qps": "3.5", "min_duration": "700000", "min_query_count": "0x5000", "max_duration": "0",
        "infer_token_latencies": "1", "token_latency_scaling_factor": "7"}
    p.write_text("*.Offline.target_qps = 3.5\n*.*.min_duration = 700000\n")
    assert check_user_conf(p, "llama3_1-8b-edge", "Offline") == {"target_qps": "3.5", "min_duration": "700000"}


def test_one_user_conf_may_hold_lines_for_other_runs_of_the_system(tmp_path, caplog):
    """Offline and Server lines (and the interactive key) in one file: the run uses its own, the rest is logged
    in one console line (a new user found one line per ignored line noisy)."""
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text(QPS + "llama3_1-8b.Server.target_qps = 2\nllama3_1-8b-interactive.Offline.target_qps = 1\n"
                 "*.Server.target_latency = 2000\n")
    with caplog.at_level("INFO", logger="sut.settings.userconf"):
        assert check_user_conf(p, "llama3_1-8b", "Offline") == {"target_qps": "3"}
    said = [r.getMessage() for r in caplog.records if "for other runs" in r.getMessage()]
    first = QPS.count("\n") + 1
    assert said == [f"{p}: line {first} (llama3_1-8b.Server), line {first + 1} (llama3_1-8b-interactive.Offline), "
                    f"line {first + 2} (*.Server) are for other runs, not llama3_1-8b.Offline; LoadGen ignores them "
                    "here"]


def test_each_ignored_user_conf_line_is_named_with_its_own_key(tmp_path, caplog):
    """A user's find: a Server run printed `line(s) 1, 3 ... (llama3_1-8b-interactive.Server, llama3_1-8b.Offline)`,
    keys sorted apart from their line numbers, though line 1 was the Offline line; one ignored line reads "is for
    another run"."""
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text("llama3_1-8b.Offline.target_qps = 3\nllama3_1-8b.Server.target_qps = 2\n"
                 "llama3_1-8b-interactive.Server.target_qps = 1\n")
    with caplog.at_level("INFO", logger="sut.settings.userconf"):
        assert check_user_conf(p, "llama3_1-8b", "Server") == {"target_qps": "2"}
        p.write_text("llama3_1-8b.Server.target_qps = 2\nllama3_1-8b.Offline.target_qps = 3\n")
        assert check_user_conf(p, "llama3_1-8b", "Server") == {"target_qps": "2"}
    said = [r.getMessage() for r in caplog.records if re.search("for (other runs|another run)", r.getMessage())]
    assert said == [f"{p}: line 1 (llama3_1-8b.Offline), line 3 (llama3_1-8b-interactive.Server) are for other runs, "
                    "not llama3_1-8b.Server; LoadGen ignores them here",
                    f"{p}: line 2 (llama3_1-8b.Offline) is for another run, not llama3_1-8b.Server; LoadGen ignores it "
                    "here"]


def test_a_line_shadowed_here_but_used_by_another_run_is_accepted_and_one_no_run_uses_is_refused(tmp_path):
    """A user's find: `llama3_1-8b.Server.target_qps = 4` then `*.Server.target_qps = 3` serves both Server (4) and
    Interactive (3: the interactive key's Server run), yet the Server run was refused with "remove one of them"."""
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text("llama3_1-8b.Server.target_qps = 4\n*.Server.target_qps = 3\n")
    assert check_user_conf(p, "llama3_1-8b", "Server") == {"target_qps": "4"}
    assert check_user_conf(p, "llama3_1-8b-interactive", "Server") == {"target_qps": "3"}
    p.write_text("llama3_1-8b.Server.target_qps = 4\nllama3_1-8b-interactive.Server.target_qps = 1\n"
                 "*.*.target_qps = 2\n")  # line 3: Offline's (and the edge key's)
    assert check_user_conf(p, "llama3_1-8b", "Server") == {"target_qps": "4"}
    assert check_user_conf(p, "llama3_1-8b", "Offline") == {"target_qps": "2"}
    for text, shadowed in (("llama3_1-8b.Server.target_qps = 4\nllama3_1-8b.Server.target_qps = 5\n", 1),
                           ("*.*.target_qps = 2\n" + "".join(f"{mk}.{sc}.target_qps = 1\n" for mk, sc in
                            (("llama3_1-8b", "Offline"), ("llama3_1-8b-edge", "Offline"), ("llama3_1-8b", "Server"),
                             ("llama3_1-8b-interactive", "Server"))), 1)):
        p.write_text(text)  # no run of the benchmark takes its setting from the shadowed line
        with pytest.raises(InputError, match=rf"line {shadowed} .*ignored by LoadGen, .*remove one of them"):
            check_user_conf(p, "llama3_1-8b", "Server")


def test_shipped_cpu_user_conf_is_refused_for_another_model_key():
    """The shipped lines are keyed llama3_1-8b: with --model-key llama3_1-8b-interactive LoadGen would run at its
    default target_qps without a word."""
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    with pytest.raises(InputError, match=r"no line applies to this run \(llama3_1-8b-interactive.Offline\): its lines "
                                         r"are keyed .*llama3_1-8b.Offline"):
        check_user_conf(CPU_CONF, "llama3_1-8b-interactive", "Offline")
    for conf in sorted((REPO / "loadgen_configs").glob("*.user.conf")) + [REPO / "user.conf"]:
        assert "target_qps" in check_user_conf(conf, "llama3_1-8b", "Offline")


@pytest.mark.parametrize("text, key", [
    ("llama3.1-8b.Offline.target_qps = 3\n", "llama3_1-8b"),
    ("llama3_1-8b.offline.target_qps = 3\n", "llama3_1-8b"),
    ("llama3_1-8b.Offline.target_qps=3\n", "llama3_1-8b"),
    ("llama3_1-8b.Offline.target_qps = 3\n", "llama3_1-8b-interactive"),
])
def test_the_refused_lines_really_are_ignored_by_loadgen(tmp_path, text, key):
    """Ground truth for the refusals above: LoadGen itself reads these files without error and keeps target_qps at
    mlperf.conf's default 1 (if LoadGen ever starts reading them, this test says so)."""
    import subprocess
    import sys

    p = tmp_path / "user.conf"
    p.write_text(text)
    code = ("import sys, mlperf_loadgen as lg\nts = lg.TestSettings()\nts.scenario = lg.TestScenario.Offline\n"
            "rc = ts.FromConfig(sys.argv[1], sys.argv[2], 'Offline')\nprint(rc, ts.offline_expected_qps)")
    out = subprocess.run([sys.executable, "-c", code, str(p), key], capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[-2:] == ["0", "1.0"], out.stdout + out.stderr


def test_run_with_a_user_conf_line_for_another_model_exits_2_before_anything_starts(tmp_path, synthetic_small):
    import subprocess
    import sys

    from conftest import TINY_ENGINE_ARGS, sut_env

    data, _ = synthetic_small
    out_dir = tmp_path / "results"
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", *TINY_ENGINE_ARGS, "--dataset", str(data),
                          "--user-conf", str(CPU_CONF), "--model-key", "llama3_1-8b-edge", "--quick",
                          "--output-dir", str(out_dir)], env=sut_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{CPU_CONF}: no line applies to this run (llama3_1-8b-edge.Offline)" in out.stderr
    assert "Traceback" not in out.stderr and not (out_dir.exists() and any(out_dir.iterdir()))


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"min_tokens": 500}, "min_tokens must be in [0, max_tokens=128]"),
    ({"eos_token_ids": "abc"}, "eos_token_ids must be a list of token ids"),
    ({"eos_token_ids": [1.5]}, "eos_token_ids must be a list of token ids"),
    ({"eos_token_ids": 7}, "eos_token_ids must be a list of token ids"),
])
def test_bad_generation_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerationSettings(**fields)
    assert GenerationSettings(eos_token_ids=[128001, 128009]).eos_token_ids == (128001, 128009)


@pytest.mark.parametrize("fields, message", [({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
                                             ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be >= 1")])
def test_bad_engine_batch_limits_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(model="m", **fields)


def test_step_limits_vllm_refuses_at_start_are_refused_here():
    """vLLM's SchedulerConfig refuses these only once an engine starts: a long-prefill threshold above
    max_model_len, and a step budget below max_model_len with chunked prefill off (a prompt must fit one step)."""
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be in \[0, max_model_len 4096\]"):
        EngineSettings(model="m", max_model_len=4096, long_prefill_token_threshold=4097)
    EngineSettings(model="m", max_model_len=4096, long_prefill_token_threshold=4096)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= max_model_len \(4096\) with "
                                         "enable_chunked_prefill false"):
        EngineSettings(model="m", max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=False)
    EngineSettings(model="m", max_model_len=4096, max_num_batched_tokens=1024)  # chunked prefill on: fine


def test_chunked_prefill_off_raises_vllms_default_step_budget_to_max_model_len():
    """With chunked prefill off and no budget given vLLM takes max(max_model_len, its default): max_num_seqs up to
    that is accepted (it was refused at the CPU default of 4,096)."""
    from sut.engine import check_step_budget
    from sut.engine.devices import EngineSlot

    cpu = [EngineSlot(0, "cpu", "0-1")]
    check_step_budget(EngineSettings(model="m", max_model_len=8192, max_num_seqs=8192, enable_chunked_prefill=False),
                      cpu)
    with pytest.raises(EngineError, match="8,192 tokens"):
        check_step_budget(EngineSettings(model="m", max_model_len=8192, max_num_seqs=8193,
                                         enable_chunked_prefill=False), cpu)
    with pytest.raises(EngineError, match="4,096 tokens"):
        check_step_budget(EngineSettings(model="m", max_model_len=8192, max_num_seqs=5000), cpu)


def test_prefix_caching_in_the_preset_exits_2_before_a_run_folder(tmp_path, synthetic_small):
    data, _ = synthetic_small
    preset = tmp_path / "pc.toml"
    preset.write_text("[engine]\nenable_prefix_caching = true\n")
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--config", str(preset), "--model", str(TINY_MODEL),
                          "--load-format", "dummy", "--device", "cpu", "--dataset", str(data), "--output-dir",
                          str(tmp_path / "out"), "--no-progress"], cwd=REPO, env=sut_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "not allowed in an MLPerf run" in out.stderr, out.stderr[-1500:]
    assert "allow_prefix_caching=true" in out.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, text", [("generation_config.json", "{bad"), ("config.json", '{"vocab_size": "big", "eos_token_id": 1}')])
def test_a_malformed_model_folder_is_an_engine_error_naming_the_file(tmp_path, name, text):
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "eos_token_id": 1}')
    (tmp_path / name).write_text(text)
    with pytest.raises(EngineError, match=str(tmp_path)):
        read_model_info(tmp_path)


@pytest.mark.parametrize("name", ["../../escape", "/tmp/abs", "a/b", "..", ".", "", " x"])
def test_a_run_name_must_stay_inside_the_output_dir(name):
    from sut.settings.run import RunSettings

    with pytest.raises(ValueError, match="run_name must be a plain folder name inside --output-dir"):
        RunSettings(sut="vllm", dataset="x.json", run_name=name)
    assert RunSettings(sut="vllm", dataset="x.json", run_name="my-run.1").run_name == "my-run.1"


@pytest.mark.parametrize("text", ["", "# only a comment\n\n", "\n"])
def test_a_user_conf_without_any_setting_is_refused_unless_target_qps_is_given(tmp_path, text):
    """An empty user.conf ran at LoadGen's default target_qps 1 and exited 0."""
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text(text)
    with pytest.raises(InputError, match=r"user.conf: no setting in it \(empty, or comments only\).*target_qps 1.*"
                                         r"llama3_1-8b.Server.target_qps"):
        check_user_conf(p, "llama3_1-8b", "Server")
    assert check_user_conf(p, "llama3_1-8b", "Server", target_qps_given=True) == {}


@pytest.mark.parametrize("value, message", [
    ("0x10", "target_qps must be a decimal number; LoadGen reads '0x10' with C strtod"),
    ("-5", "target_qps must be a positive number"),
    ("0", "target_qps must be a positive number"),
])
def test_target_qps_values_loadgen_would_misread_or_refuse_name_their_line(tmp_path, value, message):
    from sut.errors import InputError
    from sut.settings.userconf import check_user_conf

    p = tmp_path / "user.conf"
    p.write_text(f"# first line\nllama3_1-8b.Offline.target_qps = {value}\n")
    with pytest.raises(InputError, match=re.escape(f"{p}, line 2 (") + ".*" + re.escape(message)):
        check_user_conf(p, "llama3_1-8b", "Offline")
    p.write_text("llama3_1-8b.Offline.target_qps = 1.5e1\n")
    assert check_user_conf(p, "llama3_1-8b", "Offline") == {"target_qps": "1.5e1"}


def test_user_conf_values_compare_as_loadgen_reads_them():
    """``value_key``: package's same-settings check (sut.package_same_system) compares two runs' user.conf values."""
    from sut.settings.userconf import value_key

    assert value_key("0x10") == value_key("16") == value_key("+16") == value_key("1.6e1") == value_key("16.0") == 16.0
    assert value_key("17") != value_key("16")
    assert value_key("abc") == "abc" and value_key(None) is None


def test_user_conf_issue_and_token_inference_settings_make_a_run_non_compliant(tmp_path):
    """Before: performance_issue_same / infer_token_latencies in user.conf changed what LoadGen issues and reports
    (tokens/s inferred, scaled by 0) with no compliance reason."""
    conf = tmp_path / "user.conf"
    conf.write_text("llama3_1-8b.Offline.target_qps = 3\nllama3_1-8b.Offline.performance_issue_same = 1\n"
                    "llama3_1-8b.Offline.performance_issue_same_index = 3\n"
                    "llama3_1-8b.Offline.infer_token_latencies = 1\n"
                    "llama3_1-8b.Offline.token_latency_scaling_factor = 2\n")
    reasons = settings_in_fresh_process(13368, user_conf=str(conf))["reasons"]
    for key in ("performance_issue_same", "performance_issue_same_index", "infer_token_latencies",
                "token_latency_scaling_factor"):
        assert any(r.startswith(f"{conf} changes {key} from mlperf.conf's") for r in reasons), reasons


@pytest.mark.parametrize("index", [8, 99999])
def test_an_issue_same_index_beyond_the_loaded_samples_is_refused(tmp_path, index):
    """Before: LoadGen segfaulted (index 99999: run.json stuck at "running") or logged an error under a VALID run
    (index 8 of the 8 samples a --quick run loads)."""
    import json

    conf = tmp_path / "user.conf"
    conf.write_text("llama3_1-8b.Offline.target_qps = 3\nllama3_1-8b.Offline.performance_issue_same = 1\n"
                    f"llama3_1-8b.Offline.performance_issue_same_index = {index}\n")
    kw = dict(sut="vllm", dataset="x.json", user_conf=str(conf), max_samples=8)
    out = subprocess.run([sys.executable, "-c", SNIPPET, json.dumps([kw, 8])], capture_output=True, text=True,
                         env=sut_env(), cwd=REPO, timeout=120)
    assert out.returncode != 0 and "InputError" in out.stderr
    assert f"{conf}: performance_issue_same_index {index} is not one of the 8 samples this run loads (0 to 7)" \
        in out.stderr, out.stderr[-1500:]
