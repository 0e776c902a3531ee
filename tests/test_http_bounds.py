"""An HTTP server that never ends its reply, streams past max_tokens, sends a second choice or ids after the
answer ended is refused at once (sut.core.transports.http), never buffered without bound."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from sut.core.transports import http_api as api
from sut.core.transports.http import HttpTransport, _read_capped
from sut.engine import GenerationSettings
from sut.messages import Request


def test_a_second_choice_or_another_choice_index_is_refused():
    one = {"index": 0, "token_ids": [10, 11], "finish_reason": None}
    assert api.parse_chunk({"choices": [one]})[0] == [10, 11]
    with pytest.raises(api.ReplyError, match="2 choices"):
        api.parse_chunk({"choices": [one, dict(one, index=1)]})
    with pytest.raises(api.ReplyError, match="other than the one answer"):
        api.parse_chunk({"choices": [dict(one, index=1)]})
    with pytest.raises(api.ReplyError, match="other than the one answer"):
        api.parse_completion({"choices": [dict(one, index=3, finish_reason="stop")]})


async def _endless(request):
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(400):  # 25 MiB at most: the reader must stop long before
        await resp.write(b" " * (1 << 16))
    return resp


async def _declared(request):
    return web.Response(body=b"{}", headers={"Content-Length": "2"}) if request.query.get("small") else \
        web.Response(body=b" " * (3 << 20))


async def _hang(request):
    await asyncio.sleep(2)  # far past the test's limit; the server's clean-up waits for it
    return web.Response(text="{}")


def _serve_and(fn):
    async def go():
        app = web.Application()
        app.router.add_get("/endless", _endless)
        app.router.add_get("/declared", _declared)
        app.router.add_get("/hang", _hang)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s:
                return await fn(s, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_a_reply_that_never_ends_is_cut_at_the_limit():
    async def fn(s, url):
        async with s.get(f"{url}/endless") as resp:
            with pytest.raises(api.ReplyError, match="longer than the 1,048,576 bytes"):
                await _read_capped(resp, 1 << 20)
        async with s.get(f"{url}/declared") as resp:  # its Content-Length says too much: refused before reading
            with pytest.raises(api.ReplyError, match="reply of 3,145,728 bytes"):
                await _read_capped(resp, 1 << 20)
        async with s.get(f"{url}/declared?small=1") as resp:
            return await _read_capped(resp, 1 << 20)
    assert _serve_and(fn) == b"{}"


def test_a_read_back_get_that_never_answers_fails_naming_the_url_and_the_limit(monkeypatch):
    """A server whose /version hangs after the run: the read-back failed with "TimeoutError: TimeoutError"."""
    from sut.core.transports import http

    monkeypatch.setattr(http, "PROBE_TIMEOUT_S", 0.3)

    async def fn(s, url):
        me = SimpleNamespace(urls=[url], _auth=[{}], _keys=(),
                             _http_get=lambda u, **kw: s.get(u, allow_redirects=False, **kw))
        with pytest.raises(api.ReplyError, match=f"^GET {url}/hang: no complete answer within 0.3 s$"):
            await HttpTransport._get(me, 0, "/hang")
    _serve_and(fn)


class _Lines:
    def __init__(self, chunks):
        self.lines = [b"data: " + json.dumps(c).encode() + b"\n" for c in chunks]

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for line in self.lines:
            yield line


def _stream(chunks, max_tokens=4):
    me = SimpleNamespace(spec=SimpleNamespace(generation=GenerationSettings(max_tokens=max_tokens), stream=False))
    return asyncio.run(HttpTransport._read_stream(me, 0, Request(1, None, 1), SimpleNamespace(content=_Lines(chunks))))


def test_a_stream_past_max_tokens_or_after_its_end_fails_as_it_comes():
    ids = {"choices": [{"index": 0, "token_ids": [5, 6, 7]}]}
    with pytest.raises(api.ReplyError, match="sent 6 ids, more than max_tokens 4"):
        _stream([ids, ids] + [ids] * 1000)
    ended = {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "stop"}]}
    with pytest.raises(api.ReplyError, match="ids after the answer ended"):
        _stream([ended, {"choices": [{"index": 0, "token_ids": [9]}]}])
