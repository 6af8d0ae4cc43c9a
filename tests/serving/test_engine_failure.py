"""An exception escaping the engine thread: the requests in flight get a 500 in OpenAI's error
shape (a stream: an error event, then its end), ``/readyz`` turns 503 with the reason, the
traceback is logged, new requests are refused, and the owner's ``on_engine_failure`` is told."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.serving.fake_engine import FakeEngine, engine_client, json_events, serving, wait_until

STREAMING = {"prompt": "def f(x):", "max_tokens": 8, "stream": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.parametrize("where", ["step", "add"])
def test_engine_thread_failure_fails_requests_and_readiness(where, caplog):
    error = RuntimeError("injected engine failure") if where == "step" else TypeError("injected engine failure")
    engine = FakeEngine(hold=True, fail_after=2, **{f"{where}_error": error})
    client = engine_client(engine)
    told: list[str] = []

    async def run() -> None:
        async with serving(client, on_engine_failure=told.append) as (_, http):
            stream = asyncio.ensure_future(http.post("/v1/completions", json=STREAMING))
            await wait_until(lambda: len(engine.added) == 1, "the streaming request in the engine")
            # the second request: the step that follows its add fails (or its add does)
            chat = await asyncio.wait_for(http.post("/v1/chat/completions", json=CHAT), 10)
            streamed = await asyncio.wait_for(stream, 10)

            assert chat.status_code == 500, chat.text
            err = chat.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "engine_error"
            assert f"{type(error).__name__}: injected engine failure" in err["message"]

            assert streamed.status_code == 200
            events = json_events(streamed.content)
            assert "[DONE]" not in events  # an error, not a finished stream
            last = events[-1]["error"]
            assert last["type"] == "server_error" and last["code"] == "engine_error"
            assert "injected engine failure" in last["message"]

            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["ready"] is False
            assert ready.json()["reason"] == f"the engine failed: {type(error).__name__}: injected engine failure"
            later = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert later.status_code == 503 and later.json()["error"]["code"] == "not_ready"
            assert "injected engine failure" in later.json()["error"]["message"]
            assert (await http.get("/healthz")).status_code == 200  # the process answers until it exits

            await wait_until(lambda: told, "on_engine_failure to be called")
            assert told == [f"{type(error).__name__}: injected engine failure"]
            assert client.inflight == 0

    with caplog.at_level(logging.ERROR, logger="specops.engine.async_engine"):
        asyncio.run(run())
    logged = [r for r in caplog.records if r.name == "specops.engine.async_engine" and r.levelno == logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None and logged[0].exc_info[1] is error


def test_an_add_handed_over_after_the_failure_is_failed_at_once():
    from specops.engine.async_engine import EngineFailedError

    engine = FakeEngine(step_error=RuntimeError("injected"), fail_after=1)
    client = engine_client(engine)

    async def run() -> None:
        async with serving(client) as (_, http):
            r = await asyncio.wait_for(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 10)
            assert r.status_code == 500
            await wait_until(lambda: not client.running, "the engine to be marked failed")
            # a request that passed the running check just before the failure: its add is not lost
            stream = _bare_stream(client)
            client._command("add", ("req-late", [1, 2], None, None, stream))
            item = await asyncio.wait_for(stream._next_item(), 5)
            assert isinstance(item, EngineFailedError) and "injected" in str(item)

    asyncio.run(run())


def _bare_stream(client):
    from specops.engine.async_engine import GenerationRequest, RequestStream
    from specops.engine.sequence import SamplingParams

    req = GenerationRequest([1, 2], "x", SamplingParams(max_tokens=2))
    return RequestStream(client, "req-late", req, client.runtime.resolve("x", 2), 0.0)
