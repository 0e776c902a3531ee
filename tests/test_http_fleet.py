"""``--sut vllm-http --fleet FILE``: the fleet file's checks, API keys (sent on every request, never written),
the servers compared with each other before the run, and node / GPU / key variable per replica in ``run.json``.

Fast: stand-in servers (``fake_vllm_server.py``), the tiny model's config."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_CONF, REPO, TINY_MODEL, sut_env
from test_http_transport import Sink, stats_of, transport

from sut.core.transports.http_fleet import KEY_REFUSED, FleetServer, fleet_agreement
from sut.core.transports.http_options import HttpOptions
from sut.engine import EngineSettings
from sut.errors import InputError, ServerInputError, TransportError
from sut.http_sut import HttpSUT

pytestmark = pytest.mark.timeout(120)

MODEL = str(TINY_MODEL)
ENGINE = EngineSettings(model=MODEL, max_model_len=4096)


def _fleet(tmp_path: Path, text: str) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)


def _run(tmp_path: Path, data, *args, env=None):
    out_dir = tmp_path / "runs"
    out_dir.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", "--sut", "vllm-http", "--user-conf",
                           str(CPU_CONF), "--model", MODEL, "--max-model-len", "4096", "--dataset", str(data),
                           "--mode", "accuracy", "--max-samples", "8", "--no-accuracy-gate",
                           "--output-dir", str(out_dir), *args],
                          env=env or sut_env(), cwd=REPO, capture_output=True, text=True, timeout=90), out_dir


# -- the file ----------------------------------------------------------------------------------------
def test_a_fleet_file_gives_one_server_per_table_with_node_gpu_and_key_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_DEFAULT_KEY", "k1-value")
    monkeypatch.setenv("GPU_B_KEY", "k2-value")
    path = _fleet(tmp_path, 'api_key_env = "FLEET_DEFAULT_KEY"\n'
                            '[[server]]\nurl = "http://10.0.0.5:8000/v1"\nnode = "gpu-a"\ngpu = "GPU-5c2a0f1e"\n'
                            '[[server]]\nurl = "https://10.0.0.6:8001"\nnode = "gpu-b"\ngpu = "1"\n'
                            'api_key_env = "GPU_B_KEY"\n')
    opts = HttpOptions(fleet=path)
    assert opts.servers == (FleetServer("http://10.0.0.5:8000", "gpu-a", "GPU-5c2a0f1e", "FLEET_DEFAULT_KEY"),
                            FleetServer("https://10.0.0.6:8001", "gpu-b", "1", "GPU_B_KEY"))
    assert opts.server_urls == ("http://10.0.0.5:8000", "https://10.0.0.6:8001") and opts.urls == ()
    recorded = json.dumps(dataclasses.asdict(opts))  # what run.json's "options" holds
    assert "FLEET_DEFAULT_KEY" in recorded and "k1-value" not in recorded and "k2-value" not in recorded
    by_url = HttpOptions(urls="http://10.0.0.7:8000,http://gpu-c.lan:8000")
    assert [(s.node, s.gpu, s.api_key_env) for s in by_url.servers] == [("10.0.0.7", None, None),
                                                                        ("gpu-c.lan", None, None)]


OK_SERVER = '[[server]]\nurl = "http://10.0.0.5:8000"\nnode = "gpu-a"\n'


@pytest.mark.parametrize("text, said", [
    (OK_SERVER + 'port = 8000\n', "server 0 (http://10.0.0.5:8000): field 'port': unknown key"),
    ('servers = 1\n' + OK_SERVER, "field 'servers': unknown top-level key"),
    ('[[server]]\nnode = "gpu-a"\n', "server 0: field 'url': missing (required)"),
    ('[[server]]\nurl = 8000\nnode = "gpu-a"\n', "server 0: field 'url': must be a string, got int"),
    ('[[server]]\nurl = "ftp://10.0.0.5:8000"\nnode = "a"\n',
     "server 0 (ftp://10.0.0.5:8000): field 'url': 'ftp://10.0.0.5:8000' is not an http(s)://host:port URL"),
    ('[[server]]\nurl = "http://10.0.0.5:8000"\n', "server 0 (http://10.0.0.5:8000): field 'node': missing"),
    ('[[server]]\nurl = "http://10.0.0.5:8000"\nnode = 3\n', "field 'node': must be a string, got int"),
    (OK_SERVER + 'gpu = 0\n', "server 0 (http://10.0.0.5:8000): field 'gpu': must be a string, got int"),
    (OK_SERVER + '[[server]]\nurl = "http://10.0.0.5:8000/"\nnode = "gpu-b"\n',
     "server 1 (http://10.0.0.5:8000): field 'url': the same URL as server 0"),
    (OK_SERVER + 'api_key_env = "FLEET_TEST_UNSET_VAR"\n',
     "server 0 (http://10.0.0.5:8000): field 'api_key_env': environment variable FLEET_TEST_UNSET_VAR is not set or "
     "empty (api_key_env holds the NAME of the environment variable that holds the key, not the key)"),
    (OK_SERVER + 'api_key_env = "FLEET_TEST_EMPTY_VAR"\n', "variable FLEET_TEST_EMPTY_VAR is not set or empty"),
    ('api_key_env = "FLEET_TEST_UNSET_VAR"\n' + OK_SERVER, "server 0 (http://10.0.0.5:8000): field 'api_key_env'"),
    (OK_SERVER + 'api_key_env = 5\n', "field 'api_key_env': must be a string"),
    ('[server]\nurl = "http://10.0.0.5:8000"\nnode = "a"\n', "field 'server': no [[server]] table"),
    ('[[server]\n', "not valid TOML"),
])
def test_a_bad_fleet_file_is_an_input_error_naming_the_file_the_server_and_the_field(tmp_path, monkeypatch, text,
                                                                                      said):
    monkeypatch.delenv("FLEET_TEST_UNSET_VAR", raising=False)
    monkeypatch.setenv("FLEET_TEST_EMPTY_VAR", "")
    path = _fleet(tmp_path, text)
    with pytest.raises(InputError) as e:
        HttpSUT.check_options({"fleet": path})
    assert f"fleet file {path}: " in str(e.value) and said in str(e.value), str(e.value)


def test_a_key_pasted_as_the_variable_name_is_refused_without_echoing_it(tmp_path):
    key = "sk-" + secrets.token_hex(8)
    path = _fleet(tmp_path, OK_SERVER + f'api_key_env = "{key}"\n')
    with pytest.raises(InputError, match="field 'api_key_env': not an environment variable name") as e:
        HttpSUT.check_options({"fleet": path})
    assert key not in str(e.value)


def test_cli_fleet_and_server_url_together_or_a_bad_fleet_exit_2_before_a_run_folder(tmp_path, synthetic_small):
    data, _ = synthetic_small
    path = _fleet(tmp_path, OK_SERVER)
    out, runs = _run(tmp_path, data, "--fleet", path, "--server-url", "http://10.0.0.9:8000")
    assert out.returncode == 2 and "--fleet and --server-url" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not list(runs.iterdir())
    bad = _fleet(tmp_path, OK_SERVER + "gpu = 0\n")
    out, runs = _run(tmp_path, data, "--fleet", bad)
    assert out.returncode == 2 and f"fleet file {bad}: server 0 (http://10.0.0.5:8000): field 'gpu'" in out.stderr
    assert not list(runs.iterdir())


# -- API keys ----------------------------------------------------------------------------------------
def test_the_key_is_sent_on_every_request_and_never_written(tmp_path, synthetic_small, fake_server):
    data, _ = synthetic_small
    key = "fleet-secret-" + secrets.token_hex(16)
    keyed, _ = fake_server("--api-key", key)
    plain, _ = fake_server()
    path = _fleet(tmp_path, f'[[server]]\nurl = "{keyed}"\nnode = "gpu-a"\ngpu = "GPU-0a1b"\napi_key_env = "FLEET_KEY"\n'
                            f'[[server]]\nurl = "{plain}"\nnode = "gpu-b"\ngpu = "0"\n')
    before = stats_of(keyed)["auth"]  # the fixture's own /health poll
    out, runs = _run(tmp_path, data, "--fleet", path, "-v", env=dict(sut_env(), FLEET_KEY=key))
    assert out.returncode == 0, out.stderr[-3000:]
    auth = stats_of(keyed)["auth"]
    for p in ("/v1/models", "/v1/completions", "/version", "/metrics", "/health", "/server_info"):
        without = auth[p][1] - before.get(p, [0, 0])[1]
        assert auth[p][0] > 0 and without == 0, (p, auth)  # every request to that server carried the key
    (run,) = runs.iterdir()
    for f in [p for p in run.rglob("*") if p.is_file()]:
        assert key.encode() not in f.read_bytes(), f
    assert key not in out.stdout and key not in out.stderr
    rec = json.loads((run / "run.json").read_text())
    placed = [{k: e[k] for k in ("url", "node", "gpu", "api_key_env", "api_key")} for e in rec["engines"]]
    assert placed == [{"url": keyed, "node": "gpu-a", "gpu": "GPU-0a1b", "api_key_env": "FLEET_KEY", "api_key": "set"},
                      {"url": plain, "node": "gpu-b", "gpu": "0", "api_key_env": None, "api_key": None}]
    assert rec["options"]["fleet"] == path and rec["options"]["servers"][0]["api_key_env"] == "FLEET_KEY"
    assert rec["http"]["agreement"]["agreed"]["vllm_version"] == "0.0.0-fake"


def test_cli_a_refused_or_missing_key_exits_2_naming_the_server(tmp_path, synthetic_small, fake_server):
    data, _ = synthetic_small
    keyed, _ = fake_server("--api-key", "right-key")
    path = _fleet(tmp_path, f'[[server]]\nurl = "{keyed}"\nnode = "gpu-a"\napi_key_env = "FLEET_KEY"\n')
    out, runs = _run(tmp_path, data, "--fleet", path, env=dict(sut_env(), FLEET_KEY="wrong-key-1234"))
    said = f"server {keyed}: {keyed}/v1/models: HTTP 401: {KEY_REFUSED}"
    assert out.returncode == 2 and said in out.stderr, out.stderr[-2000:]
    assert "wrong-key-1234" not in out.stderr + out.stdout and not list(runs.iterdir())
    out, runs = _run(tmp_path, data, "--server-url", keyed)  # no key at all: say how to send one
    hint = "(--server-url sends no key: give the servers in a --fleet file with api_key_env)"
    assert out.returncode == 2 and f"{said} {hint}" in out.stderr, out.stderr[-2000:]


def test_the_transport_names_a_server_that_refuses_its_key(fake_server, started):
    keyed, _ = fake_server("--api-key", "right-key")
    t = transport(HttpOptions(urls=keyed))
    started.append(t)
    with pytest.raises(ServerInputError, match=f"\\({keyed}\\) does not answer: .*HTTP 401: {KEY_REFUSED} "
                                               "\\(--server-url sends no key: "):
        t.start(Sink())


# -- the servers compared ------------------------------------------------------------------------------
@pytest.mark.parametrize("a, b, field, values", [
    (["--server-info", "--dtype", "bfloat16"], ["--server-info", "--dtype", "float16"], "dtype",
     ("bfloat16", "float16")),
    (["--version", "0.10.1"], ["--version", "0.10.2"], "vllm_version", ("0.10.1", "0.10.2")),
    (["--server-info"], ["--server-info", "--quantization", "fp8"], "quantization", ("none", "fp8")),
    ([], ["--kv-cache-dtype", "fp8"], "kv_cache_dtype", ("auto", "fp8")),
    ([], ["--block-size", "32"], "block_size", ("16", "32")),
    ([], ["--max-model-len", "8192"], "max_model_len", ("4096", "8192")),
])
def test_servers_that_differ_are_refused_naming_both_urls_and_the_field(fake_server, a, b, field, values):
    one, _ = fake_server(*a)
    two, _ = fake_server(*b)
    with pytest.raises(InputError) as e:
        HttpSUT.preflight(HttpOptions(urls=[one, two]), ENGINE)
    said = str(e.value)
    assert f"differ in {field}: {one} ({field} {values[0]}), {two} ({field} {values[1]})" in said, said


def test_the_transport_refuses_servers_that_differ_too(fake_server, started):
    one, _ = fake_server("--version", "0.10.1")
    two, _ = fake_server("--version", "0.10.2")
    t = transport(HttpOptions(urls=[one, two]))
    started.append(t)
    with pytest.raises(ServerInputError, match=f"differ in vllm_version: {one} .*, {two} "):
        t.start(Sink())


def test_cli_servers_that_differ_exit_2_before_a_run_folder(tmp_path, synthetic_small, fake_server):
    data, _ = synthetic_small
    one, _ = fake_server("--server-info", "--dtype", "bfloat16")
    two, _ = fake_server("--server-info", "--dtype", "float16")
    out, runs = _run(tmp_path, data, "--server-url", f"{one},{two}")
    assert out.returncode == 2 and f"differ in dtype: {one} (dtype bfloat16), {two} (dtype float16)" in out.stderr, \
        out.stderr[-2000:]
    assert not list(runs.iterdir())


def test_a_field_one_server_does_not_report_is_unknown_not_a_difference(fake_server, started):
    one, _ = fake_server("--server-info", "--dtype", "bfloat16")
    two, _ = fake_server()  # no /server_info: dtype and quantization unknown
    HttpSUT.preflight(HttpOptions(urls=[one, two]), ENGINE)
    t = transport(HttpOptions(urls=[one, two]))
    started.append(t)
    records = t.start(Sink())
    agreement = t.stats()["http"]["agreement"]
    assert agreement["agreed"]["dtype"] == "bfloat16" and agreement["unknown"]["dtype"] == [two]
    assert agreement["agreed"]["quantization"] == "none" and agreement["unknown"]["quantization"] == [two]
    assert [(r.info["node"], r.info["gpu"], r.info["api_key"]) for r in records] == [("127.0.0.1", None, None)] * 2


def test_agreement_reads_unknown_as_unknown_and_a_quantization_source_as_none():
    told = {"url": "a", "engine_args": {"model": "/m/Llama", "dtype": "bfloat16"}, "engine_args_from": ["/server_info"]}
    silent = {"url": "b", "engine_args": {"model": "/other/Llama"}, "engine_args_from": ["/v1/models"]}
    got = fleet_agreement([told, silent])
    assert got["agreed"]["model"] == "Llama" and got["agreed"]["quantization"] == "none"
    assert got["unknown"]["dtype"] == ["b"] and got["unknown"]["quantization"] == ["b"]
    with pytest.raises(ValueError, match=r"differ in enable_prefix_caching: a \(enable_prefix_caching False\), "
                                         r"b \(enable_prefix_caching True\)"):
        fleet_agreement([dict(told, enable_prefix_caching=False), dict(silent, enable_prefix_caching=True)])


# -- the key kept out of every record, whatever the server answers ------------------------------------
@pytest.mark.parametrize("value", ["abc\ndef-secret-part", "abc\r\nX-Other: 1", "k\u00e9y-secret-part", " padded-secret "])
def test_a_key_no_http_header_can_carry_is_refused_naming_the_variable_not_the_key(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FLEET_ODD_KEY", value)
    path = _fleet(tmp_path, 'api_key_env = "FLEET_ODD_KEY"\n' + OK_SERVER)
    with pytest.raises(InputError, match="field 'api_key_env': environment variable FLEET_ODD_KEY: the key holds") as e:
        HttpSUT.check_options({"fleet": path})
    assert "secret" not in str(e.value) and value.strip() not in str(e.value)


@pytest.mark.parametrize("size", [16, 300])  # 300 bytes: a 600-character key (a JWT), cut off in the error's text
def test_a_server_that_echoes_the_key_in_its_errors_fails_the_run_without_it(tmp_path, synthetic_small, fake_server,
                                                                             size):
    data, _ = synthetic_small
    key = "echoed-secret-" + secrets.token_hex(size)
    keyed, _ = fake_server("--api-key", key, "--echo-auth", "--error-after", "2")
    path = _fleet(tmp_path, f'[[server]]\nurl = "{keyed}"\nnode = "gpu-a"\napi_key_env = "FLEET_KEY"\n')
    out, runs = _run(tmp_path, data, "--fleet", path, "-v", env=dict(sut_env(), FLEET_KEY=key))
    assert out.returncode == 1 and keyed in out.stderr, out.stderr[-3000:]
    assert key[14:30] not in out.stdout + out.stderr, out.stderr[-3000:]  # not the key, nor a part of it
    (run,) = runs.iterdir()
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    for f in [p for p in run.rglob("*") if p.is_file()]:
        assert key[14:30].encode() not in f.read_bytes(), f


@pytest.mark.parametrize("url, said", [
    ("http://user:pw-secret@10.0.0.5:8000", "server 0 (http://***@10.0.0.5:8000): field 'url': 'http://***@10.0.0.5:8000' "
                                            "holds credentials (user:password@)"),
    ("http://10.0.0.5:8000/?token=q-secret", "field 'url': 'http://10.0.0.5:8000/?token=q-secret' has a query or fragment"),
    ("http://10.0.0.5:8000#f", "has a query or fragment"),
    ("http://10.0.0.5:99999", "field 'url': 'http://10.0.0.5:99999' has no valid port"),
])
def test_a_url_with_credentials_a_query_or_a_bad_port_is_refused_without_echoing_a_password(tmp_path, url, said):
    path = _fleet(tmp_path, f'[[server]]\nurl = "{url}"\nnode = "a"\n')
    with pytest.raises(InputError) as e:
        HttpSUT.check_options({"fleet": path})
    assert said in str(e.value) and "pw-secret" not in str(e.value), str(e.value)
    with pytest.raises(InputError) as e:
        HttpSUT.check_options({"urls": url})
    assert "pw-secret" not in str(e.value), str(e.value)


def test_a_server_that_redirects_never_gets_the_key_sent_elsewhere(tmp_path, monkeypatch, fake_server):
    key = "redirected-secret-" + secrets.token_hex(8)
    elsewhere, _ = fake_server("--api-key", key)
    redirecting, _ = fake_server("--api-key", key, "--redirect-to", elsewhere)
    before = stats_of(elsewhere)["auth"]
    monkeypatch.setenv("FLEET_KEY", key)
    path = _fleet(tmp_path, f'[[server]]\nurl = "{redirecting}"\nnode = "a"\napi_key_env = "FLEET_KEY"\n')
    with pytest.raises(InputError) as e:
        HttpSUT.preflight(HttpSUT.check_options({"fleet": path}), ENGINE)
    assert (f"server {redirecting}: {redirecting}/v1/models: HTTP 307 redirect to {elsewhere}/v1/models refused (the "
            "API key must not follow a redirect): give the final URL") in str(e.value), str(e.value)
    after = stats_of(elsewhere)["auth"]
    assert all(after[p][0] == before.get(p, [0, 0])[0] for p in after), after  # no request there carried the key


def test_a_completion_redirected_mid_run_is_a_failure_and_the_key_goes_nowhere_else(tmp_path, monkeypatch,
                                                                                   fake_server, started):
    """The run's own requests do not follow redirects either (the checks before the run see none here: only
    the completions are redirected)."""
    key = "posted-secret-" + secrets.token_hex(8)
    elsewhere, _ = fake_server("--api-key", key)
    redirecting, _ = fake_server("--api-key", key, "--redirect-to", elsewhere, "--redirect-posts")
    monkeypatch.setenv("FLEET_KEY", key)
    t = transport(HttpOptions(fleet=_fleet(tmp_path, f'[[server]]\nurl = "{redirecting}"\nnode = "a"\n'
                                                     'api_key_env = "FLEET_KEY"\n')))
    started.append(t)
    with pytest.raises(TransportError, match="probe completion failed: HTTP 307 redirect to .* refused"):
        t.start(Sink())  # the start's probe completion is the first POST
    assert "/v1/completions" not in stats_of(elsewhere)["auth"]  # nothing went there, with or without the key


def test_a_redirect_names_where_it_leads_without_credentials_and_a_keyless_401_says_how_to_send_a_key():
    from sut.core.transports.http_fleet import status_text

    assert status_text(308, location="https://u:pw@h:8443/v1/models") == (
        "HTTP 308 redirect to https://***@h:8443/v1/models refused (the API key must not follow a redirect): "
        "give the final URL")
    assert "redirect to a URL it does not name refused" in status_text(302)
    assert status_text(304) == "HTTP 304" and status_text(401) == f"HTTP 401: {KEY_REFUSED}"
    assert status_text(403, key_sent=False).endswith("(--server-url sends no key: give the servers in a --fleet "
                                                     "file with api_key_env)")


def test_a_server_whose_health_redirects_is_refused_naming_where_to(tmp_path):
    """An http:// URL of a server behind a proxy that sends every request to https:// (``/health`` too)."""
    import http.server
    import threading

    from sut.http_sut import check_reachable

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(307)
            self.send_header("Location", f"https://gpu-a.lan:8443{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(InputError) as e:
            check_reachable([FleetServer(url, "a")])
    finally:
        srv.shutdown()
        srv.server_close()
    assert (f"server {url} is not healthy ({url}/health: HTTP 307 redirect to https://gpu-a.lan:8443/health refused "
            "(the API key must not follow a redirect): give the final URL)") in str(e.value), str(e.value)


def test_a_key_cut_off_by_an_error_texts_limit_is_hidden_too():
    from sut.core.transports.http_fleet import HIDDEN_KEY, redact_cut

    key = "k" + "0123456789" * 10
    assert redact_cut(f"echo: Bearer {key} end", [key], 30) == f"echo: Bearer {HIDDEN_KEY} "
    assert redact_cut(f"echo: Bearer {key[:50]}", [key], 500) == f"echo: Bearer {HIDDEN_KEY}"  # read cut it off
    assert redact_cut(f"echo: Bearer {key} end", [key], 500) == f"echo: Bearer {HIDDEN_KEY} end"
    assert redact_cut("ends in k01", [key], 50) == "ends in k01"  # 3 characters: left as they are


def test_a_server_that_trickles_its_reply_fails_the_check_before_the_run_in_time():
    """/health answers, then /v1/models sends its headers and one byte every 0.4 s: each read is within the socket
    timeout, so without a deadline for the whole body the check before the run would wait for ever."""
    import http.server
    import threading
    import time

    from sut.http_sut import read_back_server

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.4)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    t0 = time.monotonic()
    try:
        with pytest.raises(InputError) as e:
            read_back_server(0, FleetServer(url, "a"), EngineSettings(model="m"), None, timeout_s=1.5)
    finally:
        srv.shutdown()
        srv.server_close()
    assert time.monotonic() - t0 < 5, time.monotonic() - t0
    assert f"server {url}: {url}/v1/models: the reply did not arrive whole in time" in str(e.value), str(e.value)


def test_cli_one_server_under_two_addresses_exits_2_naming_both(tmp_path, synthetic_small, fake_server):
    """A server bound to 0.0.0.0 given as 127.0.0.1:P and 127.0.0.2:P: the addresses differ, so check_distinct passes;
    the same process start time and a request to one counted by the other's /metrics name it one server (exit 2, no
    run folder)."""
    data, _ = synthetic_small
    url, _ = fake_server("--host", "0.0.0.0")
    other = url.replace("127.0.0.1", "127.0.0.2")
    out, runs = _run(tmp_path, data, "--server-url", f"{url},{other}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{url} and {other} are one server: the same process start time" in out.stderr, out.stderr[-2000:]
    assert not list(runs.iterdir())


def test_two_servers_started_at_once_are_not_taken_for_one(fake_server, caplog):
    """Two servers that report the same process start time (started in one 10 ms tick) but count only their own
    requests pass; without the request counter the same start time is only warned."""
    one, _ = fake_server("--start-time", "1765000000.00")
    two, _ = fake_server("--start-time", "1765000000.00")
    HttpSUT.preflight(HttpOptions(urls=[one, two]), ENGINE)
    three, _ = fake_server("--start-time", "1765000000.00", "--no-request-count")
    with caplog.at_level("WARNING", logger="sut.http"):
        HttpSUT.preflight(HttpOptions(urls=[one, three]), ENGINE)
    assert any(f"servers {one} and {three} started at the same time" in r.getMessage() for r in caplog.records)


def test_a_fleet_file_that_is_no_regular_file_or_no_utf8_is_refused_naming_it(tmp_path):
    from sut.core.transports.http_fleet import load_fleet
    from sut.core.transports.http_options import url_list

    fifo = tmp_path / "fleet.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"fleet file {fifo}: not a regular file"):
        load_fleet(str(fifo), url_list)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[[server]]\nurl = "http://a:8000"\nnode = "caf\xe9"\n')
    with pytest.raises(ValueError, match=f"fleet file {bad}: not UTF-8 text \\(byte 44: invalid continuation byte\\)"):
        load_fleet(str(bad), url_list)


def test_the_warning_about_settings_running_servers_keep_leaves_out_load_format(fake_server, caplog):
    """With given servers --load-format dummy declares their dummy weights (it is used), so the warning that engine
    settings never reach running servers names the others only."""
    url, _ = fake_server("--server-info", "--load-format", "dummy")
    engine = dataclasses.replace(ENGINE, load_format="dummy", max_num_seqs=7)
    with caplog.at_level("WARNING", logger="sut.http"):
        HttpSUT.preflight(HttpOptions(urls=[url]), engine)
    (said,) = [r.getMessage() for r in caplog.records if "never reach servers" in r.getMessage()]
    assert "max_num_seqs=7" in said and "load_format" not in said, said
