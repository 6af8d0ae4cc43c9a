"""A stub OpenAI-style server for the load generator's tests: one POST route answering with SSE chunks."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable


def sse_route(chunks: Callable[[dict[str, Any]], list[dict[str, Any]]], bodies: list[dict[str, Any]] | None = None):
    """An aiohttp handler streaming ``chunks(request body)`` as ``data:`` lines, then ``[DONE]``;
    each request's JSON body is appended to ``bodies``."""
    from aiohttp import web

    async def handler(request):
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks(body):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


def with_stub(path: str, handler, client: Callable[[Any, str], Awaitable[Any]], timeout_s: float = 30.0) -> Any:
    """Serve ``handler`` at POST ``path`` on a free 127.0.0.1 port, run ``client(session, base_url)``
    with an aiohttp session and return what it returns; the stub stops either way."""
    import aiohttp
    from aiohttp import web

    async def main():
        app = web.Application()
        app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await client(session, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(asyncio.wait_for(main(), timeout_s))
