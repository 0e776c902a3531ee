"""Servers the harness talks to off this host's loopback: ``sut.core.exposure`` says so, the flame and http
transports warn (console) and record it (run.json ``flame.exposure`` / ``http.exposure``). No network: a
non-loopback URL is either never connected to, or is a loopback server that the test makes the check take for
another host."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace as NS

import pytest

from sut.core import exposure as exposure_mod
from sut.core.exposure import exposure, is_loopback_host


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("LOCALHOST.", True), ("api.localhost", True),
    ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("0.0.0.0", False), ("::", False), ("192.168.1.2", False), ("2001:db8::1", False),
    ("", False), (None, False), ("no-such-host.invalid", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


def test_a_name_counts_as_loopback_only_when_every_address_is(monkeypatch):
    answers = {"both": ["127.0.0.1", "10.0.0.7"], "lo-only": ["127.0.1.1", "::1"]}
    monkeypatch.setattr(exposure_mod.socket, "getaddrinfo",
                        lambda host, *a, **k: [(None, None, None, "", (ip, 0)) for ip in answers[host]])
    assert is_loopback_host("lo-only") and not is_loopback_host("both")


def test_warning_off_loopback_and_where_tls_is_not_enough():
    assert exposure("http://127.0.0.1:8080", "Flame endpoint", "r")["warning"] is None
    assert exposure("https://10.0.0.5:8080", "Flame endpoint", "r") == {
        "url": "https://10.0.0.5:8080", "loopback": False, "tls": True, "warning": None}
    rec = exposure("http://10.0.0.5:8080", "Flame endpoint", "anyone can X")
    assert (rec["loopback"], rec["tls"]) == (False, False)
    assert rec["warning"].startswith("Flame endpoint http://10.0.0.5:8080 is not on this host's loopback: prompts "
                                     "and outputs cross the network unencrypted (plain http), and anyone can X;")
    rec = exposure("https://10.0.0.5:8000", "vllm-http server", "anyone can Y", tls_fences=False)
    assert "cross the network encrypted (https), and anyone can Y" in rec["warning"]


def test_the_flame_transport_warns_and_records_an_endpoint_off_loopback(monkeypatch, caplog):
    """The endpoint is not connected to: ``connect`` and the application check are stand-ins."""
    from sut.flame import transport as ft
    from tests.test_flame_client import _sut

    monkeypatch.setattr(ft, "connect", lambda endpoint: (NS(), "http://10.213.0.9:8080"))
    monkeypatch.setattr(ft, "ensure_app", lambda *a, **k: None)
    t = _sut(aio_watch=False).transport
    with caplog.at_level(logging.WARNING, logger="sut.flame"):
        t._connect()
    rec = t.stats()["flame"]["exposure"]
    assert (rec["url"], rec["loopback"], rec["tls"]) == ("http://10.213.0.9:8080", False, False)
    assert "Flame v0.6.0 authenticates no client" in rec["warning"]
    assert rec["warning"] in [r.getMessage() for r in caplog.records]


def test_the_http_transport_warns_and_records_a_server_off_loopback(fake_server, monkeypatch, caplog):  # noqa: F811
    """A fake server on 127.0.0.1 that the check is made to take for another host; one named localhost is quiet."""
    from tests.test_http_transport import HttpOptions, Sink, transport

    (u0, _), (u1, _) = fake_server(), fake_server()
    real = exposure_mod.is_loopback_host
    monkeypatch.setattr(exposure_mod, "is_loopback_host", lambda host: False if host == "127.0.0.1" else real(host))
    t = transport(HttpOptions(urls=[u0, u1.replace("127.0.0.1", "localhost")]))
    try:
        with caplog.at_level(logging.WARNING, logger="sut.core.transports.http"):
            t.start(Sink())
        recs = t.stats()["http"]["exposure"]
    finally:
        t.stop()
    assert [(r["url"], r["loopback"]) for r in recs] == [(u0, False), (u1.replace("127.0.0.1", "localhost"), True)]
    assert recs[1]["warning"] is None and "unless it was started with --api-key" in recs[0]["warning"]
    assert [r.getMessage() for r in caplog.records if "loopback" in r.getMessage()] == [recs[0]["warning"]]
    json.dumps(recs)  # goes to run.json as it is
