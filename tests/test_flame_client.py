"""The flame transport and --sut flame without a cluster: options (typed, CLI flag metadata), executor sizing,
batch formation, common data, application rendering, bind failures, and that the product imports no test double."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

from sut.base import SUTContext
from sut.core.transport import TransportSpec, make_transport
from sut.data.dataset import Dataset
from sut.engine import EngineSettings, GenerationSettings
from sut.errors import InputError, RunFailed, TransportError
from sut.flame.batcher import Batcher
from sut.flame.client import FlameSUT
from sut.flame.options import LOCALITY_DEFAULTS, FlameOptions, executors_per_engine
from sut.flame.stats import FlameStats
from sut.messages import Request

REPO = Path(__file__).resolve().parent.parent
QS = collections.namedtuple("QS", "id index")


def _ctx(run_dir=None, **opts):
    ds = Dataset("mem", "0" * 64, [np.arange(1, 20, dtype=np.int32)] * 8, [""] * 8, 8)
    return SUTContext(dataset=ds, engine=EngineSettings(model="m", max_num_seqs=256), generation=GenerationSettings(),
                      options=opts, progress=False, run_dir=run_dir)


def _sut(**opts):
    return FlameSUT(_ctx(**opts))


def test_executor_sizing():
    assert executors_per_engine(256, 32) == 16 and executors_per_engine(256, 64) == 8
    assert executors_per_engine(256, 32, fill=1.0, slack=1) == 9
    assert executors_per_engine(4, 1000) == 2  # never 1: a second task of a replica must not wait for the first
    assert executors_per_engine(64, 128) == 2  # the study's max_num_seqs 64 with batch limit 128
    s = _sut(batch_size=64, engines=8)
    rec = s.transport.stats()["flame"]
    assert (s.transport.per_engine, rec["executors"], rec["max_inflight_tasks"]) == (8, 64, 128)
    assert s.transport.replicas == 8 and s.dispatcher.router.replicas == 8  # one replica per engine (session)
    assert _sut(batch_size=32, executors_per_engine=3).transport.stats()["flame"]["executors"] == 3


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"payload": "pickle"}, {"nope": 1}, {"engines": 0}, {"engine_fill": 0},
                                 {"batch_size": "64"}, {"engine_factory": "no-colon"}, {"service_hooks_args": "x=1"},
                                 {"batch_size": 4097}, {"batch_size": 99999999999999999999}, {"resreq": "garbage"},
                                 {"resreq": "cpu=1,disk=2"}, {"engine_fill": 1e308}, {"engine_fill": 64.5}])
def test_bad_options_are_refused(bad):
    with pytest.raises(InputError, match="--sut flame"):
        _sut(**bad)


def test_bad_resreq_and_batch_size_messages_name_the_rule():
    with pytest.raises(InputError, match=r"resreq 'garbage': invalid resource requirement entry 'garbage', expected "
                                         r"key=value \(e.g. cpu=1,mem=2g,gpu=1\)"):
        _sut(resreq="garbage")
    with pytest.raises(InputError, match="batch_size must be at most 4096"):
        _sut(batch_size=5000)
    assert _sut(resreq="cpu=2,mem=4g", batch_size=4096).transport.o.resreq == "cpu=2,mem=4g"


def test_preflight_refuses_min_executors_above_what_the_session_asks_for(no_flame_config):
    # max_num_seqs 256, batch 32: the session asks for 16 executors; min_executors 17 could never be met
    with pytest.raises(InputError, match="min_executors 17 is more than the 16 executor"):
        _preflight(min_executors=17)
    with pytest.raises(InputError, match="no Flame endpoint"):  # 16 passes this check, then the endpoint one
        _preflight(min_executors=16)


@pytest.mark.parametrize("opts, message", [
    ({"executors_per_engine": 10 ** 18}, "executors_per_engine must be in [1, 4096], got 1000000000000000000"),
    ({"executor_slack": 5000}, "executor_slack must be in [0, 4096], got 5000"),
    ({"min_executors": 0}, "min_executors must be in [1, 4096], got 0"),
    ({"batch_size": 1, "engine_fill": 64}, "16,384 executors per engine (engine_fill 64 x max_num_seqs 256 / "
                                           "batch_size 1 + executor_slack 0) is more than 4096"),
])
def test_executor_counts_a_session_could_never_get_are_refused_before_anything_starts(no_flame_config, opts, message):
    """1e18 executors per engine passed the checks and stalled the warm-up after the run folder existed."""
    with pytest.raises(InputError, match=re.escape(message)):
        _preflight(**opts)


def test_options_arrive_typed_and_carry_their_cli_flags():
    """Values are not coerced (a preset's "64" is refused above); the six Flame flags live in the field metadata."""
    o = FlameSUT.check_options({"batch_size": 64, "batch_window_ms": 5, "allow_prefix_caching": False})
    assert isinstance(o, FlameOptions) and (o.batch_size, o.batch_window_ms) == (64, 5)
    assert FlameSUT.check_options(o) is o
    flags = {f.metadata["flag"]: f.name for f in dataclasses.fields(FlameOptions) if "flag" in f.metadata}
    assert flags == {"--batch-size": "batch_size", "--batch-window-ms": "batch_window_ms", "--flame-endpoint": "endpoint",
                     "--flame-app": "app", "--executors-per-engine": "executors_per_engine", "--flame-engines": "engines"}
    assert all(f.metadata["help"] for f in dataclasses.fields(FlameOptions) if "flag" in f.metadata)


def test_locality_defaults():
    o = FlameOptions.for_locality(engines=2)
    assert (o.batch_size, o.batch_window_ms, o.engines) == (128, 10.0, 2) == (*LOCALITY_DEFAULTS.values(), 2)
    assert o.compress and o.gc_freeze  # zlib payload and the frozen start-up heap are on by default


def _batcher(batch_size, window_ms):
    o = FlameOptions(batch_size=batch_size, batch_window_ms=window_ms)
    return Batcher(NS(replica=0), o, 128, 2, FlameStats(), NS(halted=False))


def _reqs(ids):
    return [Request(i, np.arange(1, 5, dtype=np.int32), 0) for i in ids]


def test_batches_window_and_flush():
    b = _batcher(32, 200)
    t0 = time.monotonic()
    b.put(_reqs(range(70)))
    assert time.monotonic() - t0 < 0.5  # put only queues
    assert len(b.next_items()) == 32 and len(b.next_items()) == 32
    t1 = time.monotonic()
    assert len(b.next_items()) == 6  # partial batch after the window
    assert 0.15 < time.monotonic() - t1 < 2.0
    b.put(_reqs([100, 101, 102]))
    b.flush()
    t2 = time.monotonic()
    assert len(b.next_items()) == 3 and time.monotonic() - t2 < 0.1  # a flush sends the partial batch at once
    b.close()
    assert b.next_items() is None


def test_trickling_arrivals_fill_a_batch_within_the_window():
    b = _batcher(4, 500)

    def trickle():
        for i in range(4):
            b.put(_reqs([i]))
            time.sleep(0.05)

    threading.Thread(target=trickle).start()
    assert [r.rid for r in b.next_items()] == [0, 1, 2, 3]


def test_app_render_carries_this_process_pythonpath(monkeypatch, tmp_path):
    """A service started with this machine's interpreter must import what the client imports
    (e.g. packages installed with pip --target and put on PYTHONPATH); an explicit --python does not."""
    from sut.flame import app as app_mod

    extra = str(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", f"{extra}:{REPO}")
    env = app_mod.render(workdir=str(tmp_path))["spec"]["environments"]["PYTHONPATH"].split(":")
    assert env == [str(REPO), extra]
    other = app_mod.render(python="/opt/py/bin/python", repo="/opt/sut", workdir=str(tmp_path))
    assert other["spec"]["environments"]["PYTHONPATH"] == "/opt/sut"
    with pytest.raises(ValueError, match="SUT_REPO"):
        app_mod.render(repo="relative/path")


def test_service_logs_go_to_the_run_folder(tmp_path):
    """The services' output of a run lands in that run's folder (not <repo>/results/flame-service),
    and only services on the client's host write there."""
    t = FlameSUT(_ctx(run_dir=str(tmp_path / "run1"))).transport
    assert t.service_log_dir() == str(tmp_path / "run1" / "flame-service")
    d = json.loads(t.common_data(0))
    assert d["log_dir"] == str(tmp_path / "run1" / "flame-service") and d["client_host"] == socket.gethostname()
    assert _sut(service_log_dir="none").transport.service_log_dir() is None and _sut().transport.service_log_dir() is None
    assert "log_dir" not in json.loads(_sut().transport.common_data(0))


def test_common_data_names_the_replicas_slot_and_the_extension_points():
    t = _sut(engines=2, engine_factory="pkg.mod:make", engine_factory_args={"step_s": 1}, service_hooks="pkg.mod:Hooks",
             service_hooks_args={"x": 1}).transport
    d0, d1 = json.loads(t.common_data(0)), json.loads(t.common_data(1))
    assert (d0["slot"], d1["slot"]) == (0, 1)
    assert d1["engine_factory"] == "pkg.mod:make" and d1["engine_factory_args"] == {"step_s": 1}
    assert d1["service_hooks"] == "pkg.mod:Hooks" and d1["service_hooks_args"] == {"x": 1}
    assert d1["allow_prefix_caching"] is False and d1["compress"] is True and d1["gc_freeze"] is True
    plain = json.loads(_sut().transport.common_data(0))
    assert "engine_factory" not in plain and "service_hooks" not in plain  # the product's default engine


def test_replicas_sharing_a_gpu_open_one_after_the_other_unless_their_kv_cache_is_given():
    spec = TransportSpec(engine=EngineSettings(model="m", engines_per_device=2), generation=GenerationSettings(),
                         options=FlameOptions(engines=3))
    assert make_transport("flame", spec)._start_groups() == [[0], [1], [2]]
    given = dataclasses.replace(spec, engine=EngineSettings(model="m", engines_per_device=2, kv_cache_memory_bytes=1))
    assert make_transport("flame", given)._start_groups() == [[0, 1, 2]]
    one = dataclasses.replace(spec, engine=EngineSettings(model="m"))
    assert make_transport("flame", one)._start_groups() == [[0, 1, 2]]


def test_prefix_caching_is_allowed_through_the_spec():
    """The synthetic-locality entry point allows prefix caching through the spec, not a flame option."""
    spec = TransportSpec(engine=EngineSettings(model="m", enable_prefix_caching=True), generation=GenerationSettings(),
                         options=FlameOptions.for_locality(), allow_prefix_caching=True, detail=True)
    d = json.loads(make_transport("flame", spec).common_data(0))
    assert d["allow_prefix_caching"] is True and d["detail"] is True and d["engine"]["enable_prefix_caching"] is True
    assert json.loads(make_transport("flame", dataclasses.replace(spec, allow_prefix_caching=False)).common_data(0))[
        "allow_prefix_caching"] is False


def test_streaming_is_refused():
    spec = TransportSpec(engine=EngineSettings(model="m"), generation=GenerationSettings(), stream=True)
    with pytest.raises(TransportError, match="first-token"):
        make_transport("flame", spec).start(NS())


def test_oversize_batch_is_refused_before_connecting():
    rng = np.random.default_rng(0)
    huge = [rng.integers(0, 128000, size=300_000, dtype=np.int32) for _ in range(4)]
    ctx = _ctx(endpoint="http://127.0.0.1:9")  # nothing listens there: the check must come first
    ctx.dataset = Dataset("huge", "0" * 64, huge, [""] * 4, 4)
    s = FlameSUT(ctx)
    with pytest.raises(RunFailed, match="4,194,304"):
        s.start()
    s.stop()
    assert s.transport.sessions == [] and s.transport.conn is None


def test_bind_failures_that_flame_retries_do_not_fail_the_start():
    """Seen with the real Flame v0.6.0: "shim creation failed ... transport error" for one executor, which
    Flame retried with a new process; only the service's own on_session_enter failure or the retry limit
    (1002) fail the start."""
    from sut.flame.session import ReplicaSession

    events = [NS(code=1001, message="Executor <e1> on node <vm> failed to bind session with return_code <11>: shim "
                                    "creation failed: failed to connect to service at </tmp/x/e1.sock>: transport error")]
    rs = ReplicaSession(0, NS(get_session=lambda sid: NS(events=list(events))), "http://x:1", FlameOptions())
    rs.session = NS(id="s1")
    rs.check_bind_failures()
    rs.check_bind_failures()
    assert len(rs.bind_warnings) == 1  # logged once
    events.append(NS(code=1002, message="Session retry limit reached"))
    with pytest.raises(RunFailed, match=r"retry limit reached The last attempt failed with: .*shim creation failed"):
        rs.check_bind_failures()  # why the attempts failed (a missing python said only "5/5 failed")
    events[1:] = [NS(code=1001, message="... return_code <12>: on_session_enter failed: model files missing")]
    with pytest.raises(RunFailed, match="model files missing"):
        rs.check_bind_failures()


def test_the_product_never_imports_test_doubles():
    """Test doubles and fault injection live under tests/ (tests/flame_doubles.py, tests/transport_doubles.py):
    no module of sut/ imports them or defines them."""
    pattern = re.compile(r"^\s*(from|import)\s+\S*(fake_engine|flame_doubles|transport_doubles|tests)\b|"
                         r"^\s*from\s+\S+\s+import\s+.*\b(Faults|FakeEngineHandle|fake_generate)\b|"
                         r"^class\s+(Faults|FakeEngineHandle)\b", re.M)
    offenders = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in sorted((REPO / "sut").rglob("*.py"))
                 for m in pattern.finditer(p.read_text())]
    assert not offenders, offenders
    assert not (REPO / "sut" / "flame" / "fake_engine.py").exists()
    assert "engine_backend" not in {f.name for f in dataclasses.fields(FlameOptions)}
    assert not [f.name for f in dataclasses.fields(FlameOptions) if f.name.startswith("fake")]


@pytest.mark.parametrize("field", ["batch_window_ms", "warmup_stall_s"])
def test_flame_options_refuse_nan(field):
    """NaN would make the batcher spin (Condition.wait(nan) returns at once) or disable the stall check."""
    from sut.flame.options import FlameOptions

    with pytest.raises(ValueError, match=field):
        FlameOptions(**{field: float("nan")})


@pytest.mark.parametrize("field", ["close_timeout_s", "warmup_timeout_s", "engine_start_timeout_s"])
@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_flame_time_limits_must_be_finite_and_positive(field, value):
    """close_timeout_s 0 or -1 gave up closing at once: after a failure the session stayed Open with its executors
    Bound once the harness had exited; warmup_timeout_s -1 failed only after the run folder existed."""
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0, got {value}"):
        FlameOptions(**{field: value})


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_the_warm_up_hold_must_be_finite_and_not_negative(value):
    with pytest.raises(ValueError, match=f"warmup_hold_ms must be a finite number >= 0 .*got {value}"):
        FlameOptions(warmup_hold_ms=value)
    assert FlameOptions(warmup_hold_ms=0.0).warmup_hold_ms == 0.0  # 0: a warm-up ping holds no executor


@pytest.mark.parametrize("option", ["close_timeout_s=-1", "close_timeout_s=0", "warmup_timeout_s=-1",
                                    "engine_start_timeout_s=0", "warmup_hold_ms=-5"])
def test_a_bad_flame_time_limit_exits_2_naming_it_before_the_run_folder(tmp_path, capsys, option):
    from sut import cli

    out, data = tmp_path / "out", tmp_path / "ds.json"
    data.write_text(json.dumps([{"instruction": "x", "input": "y", "tok_input": [128000, 5, 6, 7], "output": "z"}]))
    code = cli.main(["run", "--sut", "flame", "--flame-endpoint", "http://127.0.0.1:9", "--model",
                     str(REPO / "sut" / "models" / "tiny-llama3"), "--dataset", str(data), "--output-dir", str(out),
                     "--option", option])
    err = capsys.readouterr().err
    assert code == 2 and f"--sut flame: {option.split('=')[0]} must be a finite number" in err, err
    assert not out.exists() or not any(out.iterdir())


# --------------------------------------------------------------------------- preflight (exit 2, no run folder)
@pytest.fixture
def no_flame_config(tmp_path, monkeypatch):
    """No FLAME_ENDPOINT and a HOME without ~/.flame/flame.yaml; returns that HOME."""
    monkeypatch.delenv("FLAME_ENDPOINT", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def _preflight(**opts):
    FlameSUT.preflight(FlameSUT.check_options(opts), EngineSettings(model="m"))


def test_preflight_refuses_a_run_without_a_flame_endpoint(no_flame_config):
    with pytest.raises(InputError, match="--sut flame: no Flame endpoint: pass --flame-endpoint .*to start a cluster "
                                         "on this host: python -m sut.flame cluster"):
        _preflight()


def test_preflight_names_an_unreadable_flame_yaml(no_flame_config):
    (no_flame_config / ".flame").mkdir()
    (no_flame_config / ".flame" / "flame.yaml").write_text("contexts: [\n")
    with pytest.raises(InputError, match=r"cannot read the Flame endpoint from ~/.flame/flame.yaml"):
        _preflight()


@pytest.mark.parametrize("via_env", [False, True])
def test_preflight_refuses_an_endpoint_where_nothing_answers_within_seconds(no_flame_config, monkeypatch, via_env):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    if via_env:
        monkeypatch.setenv("FLAME_ENDPOINT", endpoint)
    t0 = time.monotonic()
    with pytest.raises(InputError, match=f"no Flame session manager answers at {endpoint}"):
        _preflight(**({} if via_env else {"endpoint": endpoint}))
    assert time.monotonic() - t0 < 5


def test_a_run_against_an_http_server_as_flame_endpoint_exits_2_before_the_run_folder(tmp_path, capsys, http_port):
    from sut import cli

    out, data = tmp_path / "out", tmp_path / "ds.json"
    data.write_text(json.dumps([{"instruction": "x", "input": "y", "tok_input": [128000, 5, 6, 7], "output": "z"}]))
    endpoint = f"http://127.0.0.1:{http_port}"
    code = cli.main(["run", "--sut", "flame", "--flame-endpoint", endpoint, "--model",
                     str(REPO / "sut" / "models" / "tiny-llama3"), "--dataset", str(data), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"no Flame session manager answers at {endpoint}: it accepts a connection but" in err, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("endpoint", ["127.0.0.1:8080", "http://127.0.0.1:99999", "http://127.0.0.1:80x",
                                      "http://127.0.0.1:8080/extra", "grpc://127.0.0.1:8080", "http://127.0.0.1:"])
def test_preflight_names_a_malformed_endpoint_as_such(no_flame_config, endpoint):
    """A user's endpoints without http://, with port 99999 or trailing text were refused as "nothing accepts a
    connection there"; the message now says what is wrong with them."""
    with pytest.raises(InputError, match=f"malformed Flame endpoint '{re.escape(endpoint)}': expected http://HOST:PORT"):
        _preflight(endpoint=endpoint)


@pytest.fixture
def grpc_port():
    """``serve(servicer or None)`` -> the port of a gRPC server on 127.0.0.1 with that Flame frontend servicer (None:
    a gRPC server without it, as the executor managers' backend port); stopped at the end."""
    from concurrent import futures

    import grpc
    from flamepy.proto.frontend_pb2_grpc import add_FrontendServicer_to_server

    servers = []

    def serve(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        if servicer is not None:
            add_FrontendServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return port
    yield serve
    for server in servers:
        server.stop(0)


def test_preflight_passes_when_the_session_manager_answers_a_flame_call(no_flame_config, grpc_port):
    from flamepy.proto import types_pb2
    from flamepy.proto.frontend_pb2_grpc import FrontendServicer

    class Frontend(FrontendServicer):
        def ListApplication(self, request, context):
            return types_pb2.ApplicationList()

    _preflight(endpoint=f"http://127.0.0.1:{grpc_port(Frontend())}")


@pytest.fixture
def http_port():
    """The port of an HTTP/1.1 server on 127.0.0.1 (a vLLM server, say: it accepts TCP, speaks no gRPC)."""
    import http.server

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("server, why", [
    ("http", (r"it accepts a connection but gives no Flame answer \(a server of another kind, or the executor "
              r"managers' backend port, frontend \+ 1: Flame's ListApplication call got UNAVAILABLE: .*HTTP/2.*\); "
              r"pass the session manager's frontend port")),
    ("grpc", r"it accepts a connection but gives no Flame answer \(.*: Flame's ListApplication call got UNIMPLEMENTED"),
    ("silent", r"it accepts a connection but answered no Flame call within 3 s"),
])
def test_preflight_refuses_an_endpoint_that_accepts_tcp_but_answers_no_flame_call(no_flame_config, grpc_port,
                                                                                  http_port, server, why):
    """An HTTP server, a silent listener or a gRPC server of another kind took the TCP check: the run failed with
    exit 1 after its run folder existed, ~10 s later (flamepy's connect). Now the preflight asks Flame's
    ListApplication with a 3 s deadline and refuses them (exit 2, no run folder)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, accepts (the kernel does), never answers
        port = {"http": http_port, "silent": silent.getsockname()[1]}.get(server) or grpc_port(None)
        endpoint = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(InputError, match=f"--sut flame: no Flame session manager answers at {endpoint}: {why}"):
            _preflight(endpoint=endpoint)
        assert time.monotonic() - t0 < 6  # the TCP check, then the call's 3 s deadline


def test_a_flame_replica_failure_is_one_fatal_event_and_attach_then_refuses():
    """The flame transport's fatal path is ``Transport._report_fatal``: one event, later failures only
    logged, no new task, and the next test of a one-process series must not attach to it."""
    t = _sut().transport
    got = []
    t.records, t.sink = [object()], NS(on_fatal=got.append)  # as after start, without a cluster
    t.attach(NS(on_fatal=got.append))
    t.fatal(0, "lost session s1")
    t.fatal(0, "lost it again")
    assert [(e.replica, e.message) for e in got] == [(0, "lost session s1")] and t.halted
    with pytest.raises(TransportError, match="lost session s1"):
        t.submit(0, [Request(1, np.arange(3, dtype=np.int32))])
    with pytest.raises(TransportError, match="a replica failed during an earlier test"):
        t.attach(NS(on_fatal=got.append))


def test_an_application_read_failing_without_a_cause_points_at_the_backend_port():
    """A user gave the executor managers' backend port (frontend + 1): it accepts the TCP preflight, then
    get_application failed with an empty cause."""
    from types import SimpleNamespace

    import flamepy

    from sut.errors import RunFailed
    from sut.flame.options import FlameOptions
    from sut.flame.session import ensure_app

    def boom(name):
        raise flamepy.FlameError(flamepy.FlameErrorCode.INTERNAL, "failed to get application: ")

    with pytest.raises(RunFailed, match=r"failed to get application: +\(no cause given: is that the session "
                                        r"manager's frontend port\?"):
        ensure_app(SimpleNamespace(get_application=boom), "http://127.0.0.1:8081", FlameOptions(), None)


def test_an_existing_registration_that_would_not_start_this_checkouts_service_is_warned_about(caplog):
    """A registration left from another checkout (other repository first on PYTHONPATH) or another command is used
    as it is (a wrapper script can be right), with a warning that shows both and how to register again."""
    import sys
    from types import SimpleNamespace

    from sut.flame import app as app_mod
    from sut.flame.options import FlameOptions
    from sut.flame.session import ensure_app

    mine = app_mod.render(name="sut-vllm")["spec"]
    same = SimpleNamespace(command=mine["command"], arguments=list(mine["arguments"]),
                           environments={"PYTHONPATH": str(REPO)})
    stale = SimpleNamespace(command=sys.executable, arguments=["-m", "sut.flame.serve"],
                            environments={"PYTHONPATH": "/old/checkout"})
    for found, warned in ((same, False), (stale, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="sut.flame"):
            ensure_app(SimpleNamespace(get_application=lambda name, f=found: f), "http://127.0.0.1:8081",
                       FlameOptions(), None)
        said = "\n".join(r.getMessage() for r in caplog.records)
        assert ("PYTHONPATH starting /old/checkout" in said) is warned, said
        assert ("register --replace --endpoint http://127.0.0.1:8081 --name sut-vllm" in said) is warned


def test_a_run_through_the_stand_in_control_plane_is_recorded_not_compliant(tmp_path):
    """What the SUT learns as it starts (the control plane is the test stand-in) joins the compliance reasons
    given before the start, on disk before LoadGen runs; the real control plane adds none."""
    from sut.run.harness import _start_sut

    t = _sut().transport
    t.endpoint, t.control_plane = "http://127.0.0.1:8080", "flame"
    assert t.noncompliance_reasons() == []
    t.control_plane = "stand-in"
    (reason,) = t.noncompliance_reasons()
    assert reason.startswith("Flame control plane at http://127.0.0.1:8080: the Flame control plane was the test")

    class Started:
        def start(self):
            return {"engines": [], "noncompliance_reasons": [reason]}

    record = {"versions": {}, "compliance": {"compliant": True, "reasons": []}}
    _start_sut(Started(), record, tmp_path)
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk["compliance"] == {"compliant": False, "reasons": [reason]} and "noncompliance_reasons" not in on_disk
    record = {"versions": {}, "compliance": {"compliant": False, "reasons": ["dummy weights", reason]}}
    _start_sut(Started(), record, tmp_path)  # a later test of a series: the reason is not repeated
    assert json.loads((tmp_path / "run.json").read_text())["compliance"]["reasons"] == ["dummy weights", reason]


def test_a_cpu_max_num_seqs_above_vllms_default_step_budget_is_refused_before_any_session():
    FlameSUT.check_settings(EngineSettings(model="m", device="cpu", max_num_seqs=4096))
    with pytest.raises(InputError, match="--sut flame: max_num_seqs 5000 with max_num_batched_tokens unset"):
        FlameSUT.check_settings(EngineSettings(model="m", device="cpu", max_num_seqs=5000))
    FlameSUT.check_settings(EngineSettings(model="m", device="cpu", max_num_seqs=5000, max_num_batched_tokens=5000))
    FlameSUT.check_settings(EngineSettings(model="m", device="auto", max_num_seqs=5000))  # the services' cards: unknown
