"""A request's slot (one of ``max_batch + max_queue``) is given back, and its engine request
aborted, wherever the client leaves: before the first byte of a stream is written, while the
first chunk is being written, or while a non-streaming answer is computed."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.serving.fake_engine import FakeEngine, engine_client, serving, wait_until


def _scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 40000), "server": ("fake", 80),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


async def _leave_while_writing(app, path: str, body: dict, at: str) -> int:
    """One request whose client disconnects while the server's write of ``at`` (the response
    start, or the first body chunk) blocks, as a write to a full socket does; the status sent."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    read = False
    status = []

    async def receive() -> dict:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        if status == [200] and message["type"] == at:
            gone.set()
            await asyncio.Event().wait()  # the write never completes

    await asyncio.wait_for(app(_scope(path, raw), receive, send), 10)
    return status[0]


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True})
COMPLETION = ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 8, "stream": True})


@pytest.mark.parametrize("route, body, at", [
    (*CHAT, "http.response.body"),        # the chat role chunk: its stream's iterator has not started
    (*CHAT, "http.response.start"),       # before any chunk: the response's iterator has not started
    (*COMPLETION, "http.response.start"),
])
def test_client_leaving_at_the_first_write_frees_the_slot_and_aborts(route, body, at):
    engine = FakeEngine(hold=True)  # requests stay in flight until aborted
    client = engine_client(engine, max_batch=1, max_queue=1)

    async def run() -> None:
        async with serving(client) as (app, _):
            for attempt in range(client.max_inflight + 2):  # more than the slots: a leak ends in 429
                assert await _leave_while_writing(app, route, body, at) == 200, f"attempt {attempt}"
                assert client.inflight == 0, f"attempt {attempt}: the slot was not given back"
            await wait_until(lambda: sorted(engine.aborted) == sorted(engine.added), "every request aborted")
            assert len(engine.added) == client.max_inflight + 2

    asyncio.run(run())


def test_cancelled_non_streaming_request_frees_its_slot():
    engine = FakeEngine(hold=True)
    client = engine_client(engine, max_batch=1, max_queue=1)

    async def run() -> None:
        async with serving(client) as (app, http):
            # a non-streaming request, cancelled while the engine holds it (the client's task ends)
            waiting = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}))
            await wait_until(lambda: client.inflight == 1, "the request to be admitted")
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await wait_until(lambda: client.inflight == 0, "the slot back")
            await wait_until(lambda: engine.aborted == engine.added, "the request aborted")

    asyncio.run(run())
