"""The sidecar's HTTP/1.1 client to its engine pools: pooled keep-alive connections, nothing else.

Why not httpx on this path: profiling the proxy (py-spy, a fake upstream that answers
at once) put a third of its CPU per streamed request in httpx / httpcore / anyio —
request building, the header and the body written as two socket sends, and several
layers of wrappers around every body chunk read. The engines speak plain HTTP/1.1 on
the pod's loopback, so this client does only that:

- one idle-connection list per pool (LIFO, at most ``max_idle``); a connection goes
  back after a response body was read to its end and the engine did not say
  ``connection: close``; a name is resolved when a connection is opened, never per
  request;
- the request line, headers and body go out in one write;
- a reused connection that fails before any response byte (the engine closed it while
  idle) is retried once on a new connection — nothing of the request was processed;
- bodies: ``content-length``, ``transfer-encoding: chunked`` (decoded here, one piece
  per socket read: the chunks that arrived together go on together, so the proxy
  writes once per read — fewer writes when it falls behind the engine) or read to EOF;
- every wait has a deadline: connect (``connect_timeout_s``) and each read
  (``read_timeout_s``: one watchdog timer per body instead of a timeout context per
  read, which cost more than the rest of the per-chunk Python work; the response head
  by a plain loop timer); a failure is an `UpstreamError` whose ``kind`` the proxy
  maps to its error answers (``unreachable``, ``timeout``, ``truncated``).

``https://`` pools get TLS with the default trust store. Not supported (the engines do
not send them on these routes): HTTP/2, ``1xx``
interim responses, content encodings (the proxy does not ask for any).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
_TIMER_SLACK_S = 0.001  # a loop timer may run up to its clock resolution early


class UpstreamError(Exception):
    """A pool failed: ``kind`` is ``unreachable``, ``timeout`` or ``truncated``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    prefix: str          # path prefix of the base URL ('' or '/something')
    host_header: bytes
    tls: bool = False


def endpoint(base_url: str) -> Endpoint:
    """Parse ``http(s)://host[:port][/prefix]`` (raises ValueError otherwise)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream URL must be http(s)://host[:port][/path], got {base_url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return Endpoint(host, port, parts.path.rstrip("/"), f"{shown}:{port}".encode(), tls)


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    loop: asyncio.AbstractEventLoop
    reused: bool = False
    expired: bool = False    # a timer aborted it (a response head that did not come in time)

    def close(self) -> None:
        self.writer.close()

    def expire(self) -> None:
        self.expired = True
        self.writer.transport.abort()


@dataclass
class UpstreamResponse:
    """One response; read its body with `body` or `chunks`, then `release` it."""

    status: int
    headers: dict[str, str]
    _conn: _Conn | None
    _pool: UpstreamPool
    _length: int | None = None       # content-length; None with chunked or read-to-EOF
    _chunked: bool = False
    _done: bool = False
    _keep: bool = True
    _timed_out: bool = False
    _reading: bool = False
    _since: float = 0.0
    _timer: asyncio.TimerHandle | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    @property
    def complete(self) -> bool:
        """The body has been read to its end (set before its last piece is yielded, when known)."""
        return self._done

    def _arm(self) -> asyncio.StreamReader:
        """Start the read watchdog (see `_check`); the connection's reader."""
        conn = self._conn
        self._loop = loop = conn.loop
        self._timer = loop.call_at(loop.time() + self._pool.read_timeout_s, self._check)
        return conn.reader

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The read watchdog: one timer per body, not a timeout context per read.

        A read notes when it started waiting; the timer fires ``read_timeout_s`` after
        that, and when the read is still waiting it aborts the connection (the read then
        ends and raises ``timeout``); otherwise it is set again (for ``read_timeout_s``
        after the wait now in progress began, or from now when none is: time spent
        passing chunks on to a slow client is not the engine's silence).
        """
        self._timer = None
        if self._conn is None or self._done:
            return
        now = self._loop.time()
        due = (self._since if self._reading else now) + self._pool.read_timeout_s
        if self._reading and now >= due - _TIMER_SLACK_S:
            self._timed_out = True
            self._conn.writer.transport.abort()
        else:
            self._timer = self._loop.call_at(due, self._check)

    async def _next(self, r: asyncio.StreamReader, n: int = 65536) -> bytes:
        """Whatever the engine sent next, up to ``n`` bytes (b'' at its end); raises `UpstreamError`."""
        self._since = self._loop.time()
        self._reading = True
        try:
            data = await r.read(n)
        except (ConnectionError, OSError) as exc:
            if not self._timed_out:
                raise UpstreamError("truncated", f"broke the response ({type(exc).__name__})") from None
            data = b""
        finally:
            self._reading = False
        if self._timed_out:
            raise UpstreamError("timeout", f"sent nothing for {self._pool.read_timeout_s:g}s")
        return data

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer encoding removed).

        One piece per read of the socket: with ``transfer-encoding: chunked``, every
        chunk that had arrived by then (and the arrived part of one still coming) is
        passed on in one piece, so the proxy writes once per engine flush it reads —
        fewer writes when it falls behind — and the bytes are the same. When the end of
        the body came with the last piece, `complete` is already true when it is
        yielded (the proxy then ends its own response with that write).
        """
        if self._conn is None or self._done:
            return _nothing()
        if self._chunked:
            return self._dechunk()
        return self._plain()

    async def _plain(self) -> AsyncIterator[bytes]:
        r = self._arm()
        try:
            if self._length is not None:
                left = self._length
                while left > 0:
                    data = await self._next(r, min(left, 65536))
                    if not data:
                        raise UpstreamError("truncated", "closed the connection mid-body")
                    left -= len(data)
                    if not left:
                        self._done = True
                    yield data
            else:
                self._keep = False
                while True:
                    data = await self._next(r)
                    if not data:
                        break
                    yield data
            self._done = True
        finally:
            self._disarm()

    async def _dechunk(self) -> AsyncIterator[bytes]:
        """Decode ``transfer-encoding: chunked``: the payload bytes of each read, joined."""
        r = self._arm()
        try:
            pending = b""  # an incomplete chunk-size line carried to the next read
            left = 0       # bytes of the current chunk still to come, its closing CRLF included
            while True:
                data = await self._next(r)
                if not data:
                    raise UpstreamError("truncated", "closed the connection mid-body")
                if pending:
                    data, pending = pending + data, b""
                out: list[bytes] = []
                pos, n = 0, len(data)
                while pos < n:
                    if left:
                        take = min(left, n - pos)
                        payload = min(take, left - 2)  # the last two bytes of a chunk are its CRLF
                        if payload > 0:
                            out.append(data if (pos == 0 and payload == n) else data[pos:pos + payload])
                        pos += take
                        left -= take
                        continue
                    eol = data.find(b"\n", pos)
                    if eol < 0:
                        pending = data[pos:]
                        if len(pending) > MAX_HEAD_BYTES:
                            raise UpstreamError("truncated", "sent a bad chunk header")
                        break
                    try:
                        size = int(data[pos:eol].split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        size = -1
                    if size < 0:
                        raise UpstreamError("truncated", "sent a bad chunk header")
                    pos = eol + 1
                    if size == 0:  # the last chunk: trailers, then a blank line
                        rest = data[pos:]
                        if self._trailers_end(rest):  # all here: the last piece is the end of the body
                            self._done = True
                            if out:
                                yield out[0] if len(out) == 1 else b"".join(out)
                            return
                        if out:
                            yield out[0] if len(out) == 1 else b"".join(out)
                        await self._trailers(r, rest)
                        self._done = True
                        return
                    left = size + 2
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
        finally:
            self._disarm()

    def _trailers_end(self, rest: bytes) -> bool:
        """Whether ``rest`` holds the trailers' closing blank line (then no more reads)."""
        if rest[:2] == b"\r\n" or rest[:1] == b"\n":  # no trailers: the usual case
            end = 2 if rest[:1] == b"\r" else 1
        else:
            i = rest.find(b"\n\r\n")
            j = rest.find(b"\n\n")
            if i < 0 and j < 0:
                return False
            end = i + 3 if j < 0 or (0 <= i < j) else j + 2
        if len(rest) > end:  # bytes after the response: the connection is not clean, do not reuse it
            self._keep = False
        return True

    async def _trailers(self, r: asyncio.StreamReader, rest: bytes) -> None:
        while True:
            eol = rest.find(b"\n")
            if eol < 0:
                if len(rest) > MAX_HEAD_BYTES:
                    raise UpstreamError("truncated", "sent oversized trailers")
                more = await self._next(r)
                if not more:
                    raise UpstreamError("truncated", "closed the connection mid-body")
                rest += more
                continue
            line, rest = rest[:eol], rest[eol + 1:]
            if not line.strip():
                if rest:  # bytes after the response: the connection is not clean, do not reuse it
                    self._keep = False
                return

    async def body(self) -> bytes:
        return b"".join([part async for part in self.chunks()])

    def release(self) -> None:
        """Return the connection to the pool (body read to its end) or close it."""
        conn, self._conn = self._conn, None
        self._disarm()
        if conn is None:
            return
        if self._done and self._keep:
            self._pool.put(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections to one engine endpoint."""

    def __init__(self, base_url: str, *, connect_timeout_s: float, read_timeout_s: float, max_idle: int = 64) -> None:
        self.ep = endpoint(base_url)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._tls = ssl.create_default_context() if self.ep.tls else None

    def put(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not conn.reader.at_eof():
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(self.ep.host, self.ep.port, limit=MAX_HEAD_BYTES,
                                                               ssl=self._tls)
        except TimeoutError:
            raise UpstreamError("unreachable", "could not be connected to in time") from None
        except OSError as exc:
            raise UpstreamError("unreachable", f"is unreachable ({type(exc).__name__})") from None
        return _Conn(reader, writer, asyncio.get_running_loop())

    def _take(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        head = [f"{method} {self.ep.prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", self.ep.host_header, b"\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        message = b"".join(head) + body
        for attempt in (0, 1):
            conn = self._take() if attempt == 0 else None
            if conn is None:
                conn = await self._connect()
            try:
                return await self._exchange(conn, message)
            except UpstreamError as exc:
                conn.close()
                # an idle connection the engine closed: nothing was processed, one retry on a new one
                if not (conn.reused and exc.kind == "stale"):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(self, conn: _Conn, message: bytes) -> UpstreamResponse:
        conn.writer.write(message)
        loop = conn.loop
        timer = loop.call_at(loop.time() + self.read_timeout_s, conn.expire)  # cheaper than asyncio.timeout
        try:
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, OSError) as exc:
            if conn.expired:
                raise UpstreamError("timeout", "did not answer in time") from None
            if isinstance(exc, OSError):
                raise UpstreamError("stale" if conn.reused else "unreachable",
                                    f"is unreachable ({type(exc).__name__})") from None
            if not exc.partial:
                raise UpstreamError("stale" if conn.reused else "unreachable",
                                    "closed the connection without answering") from None
            raise UpstreamError("unreachable", "sent a truncated response head") from None
        except asyncio.LimitOverrunError:
            raise UpstreamError("unreachable", f"sent a response head over {MAX_HEAD_BYTES} bytes") from None
        finally:
            timer.cancel()
        lines = raw.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
            raise UpstreamError("unreachable", "did not answer in HTTP/1.1")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        resp = UpstreamResponse(int(status_line[1]), headers, conn, self)
        resp._keep = headers.get("connection", "").lower() != "close" and status_line[0] == "HTTP/1.1"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            resp._chunked = True
        elif headers.get("content-length", "").isdigit():
            resp._length = int(headers["content-length"])
        return resp

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class UpstreamClient:
    """One `UpstreamPool` per engine base URL."""

    def __init__(self, base_urls: dict[str, str], *, connect_timeout_s: float, read_timeout_s: float,
                 max_idle: int = 64) -> None:
        self.pools = {name: UpstreamPool(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                                         max_idle=max_idle) for name, url in base_urls.items()}

    async def request(self, pool: str, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> UpstreamResponse:
        return await self.pools[pool].request(method, path, body, headers)

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
