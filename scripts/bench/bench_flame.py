#!/usr/bin/env python3
"""Standalone SUT vs Flame-batched SUT (batch 32 and 64): same inputs, same engine, alternating.

    python scripts/bench/bench_flame.py                        # CPU defaults: tiny model, real Flame if its binaries are here
    python scripts/bench/bench_flame.py --control-plane standin --rounds 3 --min-duration-s 120
    python scripts/bench/bench_flame.py --config loadgen_configs/h200_fp8.toml --model /models/Llama-3.1-8B-Instruct \\
        --dataset cnn_eval.json --user-conf loadgen_configs/h200_fp8.user.conf --idle-wait-s 0 \\
        --flame-endpoint http://fsm:8080 --flame-engines 8

Every run is its own ``python -m sut run`` process (LoadGen reads user.conf once per process) in
LoadGen performance mode. Each round runs the three configurations in a rotated order
(standalone, flame-32, flame-64; then flame-32, flame-64, standalone; ...) so that slow drift of
the machine does not favour one of them. Printed: LoadGen tokens/s per run, the mean per
configuration, and each Flame configuration's ratio to the standalone mean (target >= 0.995).

Without ``--flame-endpoint`` (and without FLAME_ENDPOINT) the script starts a control plane on this
machine for the Flame runs (``--control-plane``): ``real`` = Flame v0.6.0's own session manager and
executor manager (``sut.flame.cluster``; binaries from ``--flame-bin``, FLAME_BIN or ../shared/flame/bin;
the default when they are found), ``standin`` = the Python test stand-in (``python -m tests.flame_standin``).
Either way the numbers include the control plane's own CPU use on this machine, which a production
cluster runs elsewhere; the CPU accounting shows it as "flame control plane" / "flame stand-in".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, REPO / "scripts" / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from cpu_accounting import categories, cpu_times, foreign_cpu_s, proc_stat, wait_idle, window_cpu  # noqa: E402
from fill_model import simulate_fill  # noqa: E402

from sut.run.child import cpu_noise_note  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_standin(workdir: Path, max_executors: int) -> tuple[subprocess.Popen, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(workdir / "standin.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tests.flame_standin", "--port", "0", "--workdir", str(workdir),
                             "--max-executors", str(max_executors)], cwd=REPO, env=_env(), stdout=out,
                            stderr=open(workdir / "standin.err", "w"), start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out.seek(0)
        for line in out.read().splitlines():
            if line.startswith("FLAME_ENDPOINT="):
                return proc, line.split("=", 1)[1].strip()
        if proc.poll() is not None:
            raise SystemExit(f"the Flame stand-in exited with code {proc.returncode}; see {workdir / 'standin.err'}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the Flame stand-in did not print its endpoint within 60 s")


def resolve_control_plane(a) -> tuple[str, Optional[Path]]:
    """``(plane, binaries folder)``: ``--control-plane``, else real when the binaries are found, else standin.
    Exits with code 2 when real is asked for and the binaries are missing."""
    from sut.flame.cluster import default_bin_dir, find_bin_dir

    if a.flame_endpoint:
        return "external", None
    bin_dir = find_bin_dir(a.flame_bin)
    plane = a.control_plane or ("real" if bin_dir else "standin")
    if plane == "real" and bin_dir is None:
        raise SystemExit(f"error: --control-plane real needs flame-session-manager and flame-executor-manager in "
                         f"{a.flame_bin or default_bin_dir()} (--flame-bin DIR or FLAME_BIN)")
    return plane, bin_dir


def start_real(bin_dir: Path, workdir: Path):
    """A one-host real Flame v0.6.0 cluster (sut.flame.cluster.RealCluster), started."""
    from sut.flame.cluster import ClusterSettings, RealCluster

    return RealCluster(ClusterSettings(bin_dir=bin_dir, workdir=workdir)).start()


def run_one(name: str, sut_args: list[str], common: list[str], out_dir: Path, log_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "sut", "run", *sut_args, *common, "--output-dir", str(out_dir), "--run-name", name,
           "--no-progress"]
    t0 = time.monotonic()
    cpu0 = cpu_times()
    stat0 = proc_stat()
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        win: dict = {}
        try:
            # CPU per process category inside the timed LoadGen window (start: LoadGen starts; end:
            # LoadGen prints its summary), from the run's own log.
            logp, state = log_dir / f"{name}.log", "wait"
            while proc.poll() is None:
                text = logp.read_text(errors="replace") if state != "done" else ""
                if state == "wait" and "LoadGen Offline" in text:
                    win["t0"], win["cpu0"], state = time.monotonic(), cpu_times(), "in"
                    win["cats"], win["seen"] = categories(win["cpu0"]), dict(win["cpu0"])
                elif state == "in":  # each process's last sample stays: one that exits at the end still counts
                    win["seen"].update(cpu_times(win["cats"]))  # ours only: window_cpu counts no newcomer
                    if "encountered during test" in text:
                        win["share"] = window_cpu(win["cpu0"], win["seen"], time.monotonic() - win["t0"], win["cats"])
                        state = "done"
                time.sleep(0.25)
            rc = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGINT)  # the harness handles Ctrl-C: stops its engines, closes its session
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    wall = time.monotonic() - t0
    foreign = foreign_cpu_s(cpu0, cpu_times())
    d = [y - x for x, y in zip(stat0, proc_stat())]
    steal = d[7] / max(1, sum(d)) if len(d) > 7 else 0.0
    runs = [d / "run.json" for d in (out_dir / name, out_dir / f"{name}-NOT-COMPLIANT") if (d / "run.json").is_file()]
    rec = json.loads(runs[-1].read_text()) if runs else {}
    res = {"name": name, "rc": rc, "process_s": round(time.monotonic() - t0, 1), "status": rec.get("status"),
           "tokens_per_s": rec.get("tokens_per_s"), "samples_per_s": rec.get("samples_per_s"),
           "validity": rec.get("validity"), "output_tokens": (rec.get("ledger") or {}).get("output_tokens"),
           "samples": (rec.get("ledger") or {}).get("completed"), "record": str(runs[-1]) if runs else None,
           "foreign_cpu_share": round(foreign / (wall * (os.cpu_count() or 1)), 4), "steal_share": round(steal, 4),
           "loadgen_window_cpu_share": win.get("share"), "devices": rec.get("devices")}
    fl = rec.get("flame")
    if fl:
        res["flame"] = {k: fl.get(k) for k in ("executors", "executors_per_engine", "batch_size_distribution",
                                                "peak_inflight_tasks")}
        res["flame"]["exec_s_p50"] = (fl.get("tasks") or {}).get("exec_s", {}).get("p50")
        res["flame"]["queue_s_p50"] = (fl.get("tasks") or {}).get("queue_s", {}).get("p50")
    if rc != 0 or res["tokens_per_s"] is None:
        print(f"  !! {name} failed (rc {rc}); log: {log_dir / (name + '.log')}", flush=True)
    return res


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="engine preset for every run (e.g. loadgen_configs/h200_fp8.toml); its engine "
                   "settings replace the CPU defaults below, and --sut is set per run")
    p.add_argument("--model", default=str(REPO / "sut" / "models" / "tiny-llama3"))
    p.add_argument("--load-format", default=None, help="default: dummy for the tiny model, else auto")
    p.add_argument("--dtype", default=None, help="default float32 (CPU) unless --config sets it")
    p.add_argument("--max-model-len", type=int, default=None, help="default 4096 unless --config sets it")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine default (256)")
    p.add_argument("--no-enforce-eager", action="store_true", help="allow CUDA graphs (GPU)")
    p.add_argument("--dataset", help="cnn_eval-format file (default: a synthetic one written to --out)")
    p.add_argument("--synthetic-samples", type=int, default=500)
    p.add_argument("--user-conf", default=str(REPO / "loadgen_configs" / "cpu_tiny.user.conf"))
    p.add_argument("--min-duration-s", type=float, default=60.0)
    p.add_argument("--target-qps", type=float, help="override user.conf's Offline target_qps")
    p.add_argument("--ignore-eos", action="store_true", help="fixed 128-token outputs (benchmark only)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    p.add_argument("--flame-endpoint", default=os.environ.get("FLAME_ENDPOINT"),
                   help="an external Flame cluster (then --control-plane is not used)")
    p.add_argument("--control-plane", choices=("real", "standin"), default=None,
                   help="Flame control plane to start here: real (Flame v0.6.0 binaries; the default when found) or "
                        "standin (the Python test stand-in)")
    p.add_argument("--flame-bin", default=None, help="folder with flame-session-manager and flame-executor-manager "
                   "(default: FLAME_BIN, else ../shared/flame/bin)")
    p.add_argument("--flame-engines", type=int, default=1)
    p.add_argument("--standin-max-executors", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "results" / "bench_flame"))
    p.add_argument("--idle-wait-s", type=float, default=900.0,
                   help="before each run, wait up to this long for the machine to be idle (shared machines)")
    p.add_argument("--foreign-cpu-max", type=float, default=0.03,
                   help="leave a run out of the means when processes not started by this script used more than "
                        "this share of the CPUs during it (default 0.03; GPU hosts: 1 to keep every run)")
    p.add_argument("--sut-arg", action="append", default=[], metavar="'--FLAG VALUE'",
                   help="extra 'python -m sut run' flag(s) for every run, e.g. --sut-arg '--device cuda'")
    p.add_argument("--flame-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra flame SUT option for every Flame run (e.g. executors_per_engine=9)")
    p.add_argument("--standalone-gc-freeze", action="store_true",
                   help="also run the standalone SUT with gc_freeze=true (the Flame engines always freeze)")
    p.add_argument("--simulate-fill", action="store_true",
                   help="only print the engine-occupancy model behind the executors-per-engine rule")
    return p


def _dataset(a, out: Path) -> str:
    """``--dataset``, else a synthetic dataset of ``--synthetic-samples`` written into ``out``."""
    if a.dataset:
        return a.dataset
    dataset = str(out / f"synthetic{a.synthetic_samples}.json")
    subprocess.run([sys.executable, "-m", "sut", "synthetic", "--out", dataset, "--samples", str(a.synthetic_samples)],
                   cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return dataset


def common_run_args(a, dataset: str) -> list[str]:
    """The ``python -m sut run`` flags every configuration shares."""
    load_format = a.load_format or ("dummy" if Path(a.model).name == "tiny-llama3" else "auto")
    # min_query_count 1: otherwise MLPerf's llama3_1-8b setting (13,368) makes one Offline query of 13,368
    # samples; with it, LoadGen issues target_qps x min_duration x 1.1 samples.
    common = ["--model", a.model, "--load-format", load_format, "--dataset", dataset, "--user-conf", a.user_conf,
              "--min-duration-s", str(a.min_duration_s), "--min-query-count", "1"]
    if a.config:  # the preset's engine settings; flags given here still win
        common += ["--config", a.config]
    dtype = a.dtype or (None if a.config else "float32")
    max_len = a.max_model_len or (None if a.config else 4096)
    if dtype:
        common += ["--dtype", dtype]
    if max_len:
        common += ["--max-model-len", str(max_len)]
    if not a.no_enforce_eager and not a.config:
        common.append("--enforce-eager")
    for x in a.sut_arg:
        common += x.split()
    if a.max_num_seqs:
        common += ["--max-num-seqs", str(a.max_num_seqs)]
    if a.target_qps:
        common += ["--target-qps", str(a.target_qps)]
    if a.ignore_eos:
        common.append("--benchmark-ignore-eos")
    return common


def _start_control_plane(a, plane: str, bin_dir: Optional[Path], out: Path):
    """``(plane, endpoint, stand-in process or None, real cluster or None)``: the external endpoint, or a
    control plane started here."""
    if a.flame_endpoint:
        return "external", a.flame_endpoint, None, None
    if plane == "real":
        cluster = start_real(bin_dir, out / "flame-cluster")
        print(f"real Flame v0.6.0 control plane ({bin_dir}) at {cluster.endpoint}, logs in {cluster.log_dir} (its CPU "
              "use counts against the Flame runs on this machine)", flush=True)
        return plane, cluster.endpoint, None, cluster
    standin, endpoint = start_standin(out / "standin", a.standin_max_executors)
    print(f"Flame stand-in at {endpoint} (its CPU use counts against the Flame runs on this machine)", flush=True)
    return plane, endpoint, standin, None


def run_configs(a, endpoint: str, lock_dir: str, out: Path) -> list[tuple[str, list[str]]]:
    """``(name, python -m sut run flags)`` per configuration: standalone (and standalone-gcf), flame<batch>."""
    configs = [("standalone", ["--sut", "vllm"])]
    if a.standalone_gc_freeze:
        configs.append(("standalone-gcf", ["--sut", "vllm", "--option", "gc_freeze=true"]))
    for b in a.batch_sizes:
        configs.append((f"flame{b}", ["--sut", "flame", "--batch-size", str(b), "--flame-endpoint", endpoint,
                                      "--flame-engines", str(a.flame_engines), "--option", f"lock_dir={lock_dir}",
                                      "--option", f"app_workdir={out / 'service'}",
                                      *[x for o in a.flame_option for x in ("--option", o)]]))
    return configs


def _print_run(r: int, name: str, res: dict, foreign_cpu_max: float) -> None:
    flag = "  << other jobs used the CPU" if res["foreign_cpu_share"] > foreign_cpu_max else ""
    print(f"round {r} {name:<10} {res['tokens_per_s'] or float('nan'):10.2f} tok/s  "
          f"({res['samples']} samples, {res['validity']}, process {res['process_s']} s, "
          f"foreign CPU {res['foreign_cpu_share']:.1%}, steal {res['steal_share']:.1%}){flag}", flush=True)
    if res.get("loadgen_window_cpu_share"):
        print("      CPU share of the machine during LoadGen: " + ", ".join(
            f"{k} {v:.2%}" for k, v in res["loadgen_window_cpu_share"].items()), flush=True)


def _run_rounds(a, configs: list, common: list[str], runs_dir: Path, log_dir: Path) -> list[dict]:
    """Every round, the configurations in a rotated order; one result dict per run."""
    results: list[dict] = []
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for name, args in order:
            if a.idle_wait_s > 0:
                wait_idle(a.idle_wait_s)
            res = run_one(f"r{r}-{name}", args, common, runs_dir, log_dir)
            res.update(config=name, round=r)
            results.append(res)
            _print_run(r, name, res, a.foreign_cpu_max)
    return results


def summarize(configs: list, results: list[dict], foreign_cpu_max: float) -> dict:
    """Per configuration (runs that failed or shared the CPU left out): runs, mean/min/max tokens/s and the
    ratio of the mean to the standalone mean; printed as a table."""
    clean = [x for x in results if x["tokens_per_s"] and x["foreign_cpu_share"] <= foreign_cpu_max]
    if len(clean) < len(results):
        print(f"\n{len(results) - len(clean)} run(s) shared the CPU with other jobs (> {foreign_cpu_max:.0%}) "
              "or failed; left out below")
    base = [x["tokens_per_s"] for x in clean if x["config"] == "standalone" and x["tokens_per_s"]]
    base_mean = statistics.fmean(base) if base else None
    out: dict = {}
    print("\nconfig       runs  mean tok/s   min      max     ratio to standalone")
    for name, _ in configs:
        vals = [x["tokens_per_s"] for x in clean if x["config"] == name and x["tokens_per_s"]]
        if not vals:
            print(f"{name:<12} 0 successful runs")
            continue
        m = statistics.fmean(vals)
        ratio = m / base_mean if base_mean else None
        out[name] = {"runs": len(vals), "mean_tokens_per_s": m, "min": min(vals), "max": max(vals),
                     "ratio_to_standalone": ratio}
        print(f"{name:<12} {len(vals):>4}  {m:10.2f} {min(vals):8.2f} {max(vals):8.2f}   "
              f"{'' if ratio is None else f'{ratio:.4f}'}")
    note = cpu_noise_note(results)
    if note:
        print(note)
    return out


def target_met(configs: list, per_config: dict) -> bool:
    """Every Flame configuration reaches 99.5 % of the standalone mean."""
    flame_names = [n for n, _ in configs if n.startswith("flame")]
    return "standalone" in per_config and all(
        (per_config.get(n) or {}).get("ratio_to_standalone", 0) >= 0.995 for n in flame_names)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.simulate_fill:
        simulate_fill(max_num_seqs=a.max_num_seqs or 256)
        return 0
    plane, bin_dir = resolve_control_plane(a)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # run the cleanup below

    out = Path(a.out).resolve() / time.strftime("%Y%m%d-%H%M%S")
    runs_dir, log_dir = out / "runs", out / "logs"
    runs_dir.mkdir(parents=True)
    log_dir.mkdir()
    dataset = _dataset(a, out)
    common = common_run_args(a, dataset)
    plane, endpoint, standin, cluster = _start_control_plane(a, plane, bin_dir, out)
    lock_dir = f"/tmp/sut-flame-bench-{os.getpid()}"  # engine seats and sockets of the Flame runs (short path)
    configs = run_configs(a, endpoint, lock_dir, out)
    try:
        results = _run_rounds(a, configs, common, runs_dir, log_dir)
    finally:
        if standin is not None:
            os.killpg(standin.pid, signal.SIGTERM)
            standin.wait(30)
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(lock_dir, ignore_errors=True)

    summary = {"settings": vars(a), "dataset": dataset, "endpoint": endpoint, "standin": standin is not None,
               "control_plane": plane, "flame_bin": str(bin_dir) if cluster is not None else None,
               "runs": results, "configs": summarize(configs, results, a.foreign_cpu_max)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwritten {out / 'summary.json'}")
    print("target (Flame >= 99.5% of standalone at every batch size):", "MET" if target_met(configs, summary["configs"])
          else "NOT MET")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
