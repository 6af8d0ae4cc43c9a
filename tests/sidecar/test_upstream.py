"""The sidecar's pooled HTTP/1.1 client against scripted raw-socket servers (loopback, bounded)."""

from __future__ import annotations

import asyncio

import pytest

from specops.sidecar.upstream import UpstreamClient, UpstreamError, endpoint


class Scripted:
    """A loopback server answering each request with the next scripted reply (bytes, or a callable)."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/base"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if callable(reply):
                    await reply(writer)
                    if writer.is_closing():
                        return
                else:
                    writer.write(reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_keep_alive_reuses_one_connection_and_sends_one_message():
    async def go():
        srv = Scripted([OK, OK, OK])
        async with srv as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=2)
            for _ in range(3):
                r = await client.request("p", "POST", "/v1/completions", b'{"a":1}', {"content-type": "application/json"})
                assert (r.status, await r.body()) == (200, b"{}")
                r.release()
            client.close()
        assert srv.connections == 1
        head, _, body = srv.requests[0].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\nhost: 127.0.0.1:") and body == b'{"a":1}'

    _run(go())


def test_chunked_stream_arrives_chunk_by_chunk():
    async def stream(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def go():
        srv = Scripted([stream, OK])
        async with srv as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=2)
            r = await client.request("p", "POST", "/x", b"{}", {})
            assert [c async for c in r.chunks()] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
            r.release()
            r2 = await client.request("p", "POST", "/x", b"{}", {})  # the connection went back to the pool
            assert await r2.body() == b"{}"
            r2.release()
            client.close()
        assert srv.connections == 1

    _run(go())


def test_idle_connection_closed_by_the_engine_is_retried_once_on_a_new_one():
    async def answer_and_close(writer):
        writer.write(OK)
        await writer.drain()
        writer.close()

    async def go():
        srv = Scripted([answer_and_close, OK])
        async with srv as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=2)
            r = await client.request("p", "POST", "/x", b"{}", {})
            await r.body()
            r.release()
            await asyncio.sleep(0.1)  # the engine's close has arrived
            r = await client.request("p", "POST", "/x", b"{}", {})
            assert r.status == 200 and await r.body() == b"{}"
            r.release()
            client.close()
        assert srv.connections == 2 and len(srv.requests) == 2  # no request was sent twice

    _run(go())


def test_failures_have_kinds():
    async def silent(writer):
        await asyncio.sleep(5)

    async def not_http(writer):
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def cut(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab")
        await writer.drain()
        writer.close()

    async def go():
        for reply, kind in ((silent, "timeout"), (not_http, "unreachable")):
            async with Scripted([reply]) as url:
                client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=0.3)
                with pytest.raises(UpstreamError) as err:
                    await client.request("p", "POST", "/x", b"{}", {})
                assert err.value.kind == kind
                client.close()
        async with Scripted([cut]) as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=1)
            r = await client.request("p", "POST", "/x", b"{}", {})
            with pytest.raises(UpstreamError) as err:
                await r.body()
            assert err.value.kind == "truncated"
            r.release()
            client.close()
        # nothing listens: refused at once
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = UpstreamClient({"p": f"http://127.0.0.1:{port}"}, connect_timeout_s=1, read_timeout_s=1)
        with pytest.raises(UpstreamError) as err:
            await client.request("p", "POST", "/x", b"{}", {})
        assert err.value.kind == "unreachable"

    _run(go())


def test_endpoint_urls():
    e = endpoint("http://engine:8000/prefix/")
    assert (e.host, e.port, e.prefix, e.host_header, e.tls) == ("engine", 8000, "/prefix", b"engine:8000", False)
    assert endpoint("https://engine").port == 443 and endpoint("https://engine").tls
    with pytest.raises(ValueError):
        endpoint("ftp://engine")


def test_chunks_that_arrived_together_are_passed_on_together_and_framing_is_decoded_across_reads():
    parts = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nx-trailer: 1\r\n\r\n"

    async def together(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + framed)
        await writer.drain()

    async def dribbled(writer):  # one byte per write: sizes, payloads, CRLFs and trailers split everywhere
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(len(framed)):
            writer.write(framed[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.001)

    async def go():
        srv = Scripted([together, dribbled, OK])
        async with srv as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=2)
            r = await client.request("p", "POST", "/x", b"{}", {})
            assert [c async for c in r.chunks()] == [b"".join(parts)]  # one piece: one write downstream
            r.release()
            r = await client.request("p", "POST", "/x", b"{}", {})
            pieces = [c async for c in r.chunks()]
            assert b"".join(pieces) == b"".join(parts) and all(pieces)
            r.release()
            r = await client.request("p", "POST", "/x", b"{}", {})  # the same connection, clean after trailers
            assert await r.body() == b"{}"
            r.release()
            client.close()
        assert srv.connections == 1

    _run(go())


def test_read_timeout_counts_the_engine_silence_not_a_slow_consumer():
    async def slow_then_stall(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(3):
            writer.write(b"3\r\nabc\r\n")
            await writer.drain()
            await asyncio.sleep(0.15)  # under the read timeout each time, over it in total
        await asyncio.sleep(5)  # then silence

    async def go():
        async with Scripted([slow_then_stall]) as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=0.3)
            r = await client.request("p", "POST", "/x", b"{}", {})
            got = []
            loop = asyncio.get_running_loop()
            with pytest.raises(UpstreamError) as err:
                async for c in r.chunks():
                    got.append(c)
                    if len(got) == 1:
                        await asyncio.sleep(0.5)  # the consumer is slow: not the engine's silence
                    t_last = loop.time()
            assert err.value.kind == "timeout" and b"".join(got) == b"abc" * 3
            assert 0.25 <= loop.time() - t_last < 1.0  # bounded by the read timeout after the last data
            r.release()
            client.close()

    _run(go())


def test_complete_is_known_with_the_last_piece_when_the_end_came_with_it():
    async def with_end(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()

    async def end_later(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def go():
        async with Scripted([with_end, end_later, OK]) as url:
            client = UpstreamClient({"p": url}, connect_timeout_s=1, read_timeout_s=2)
            for expect in (True, False):
                r = await client.request("p", "POST", "/x", b"{}", {})
                seen = [(c, r.complete) async for c in r.chunks()]
                assert seen == [(b"hello", expect)] and r.complete
                r.release()
            r = await client.request("p", "POST", "/x", b"{}", {})  # still one clean keep-alive connection
            assert await r.body() == b"{}" and r.complete
            r.release()
            client.close()

    _run(go())
