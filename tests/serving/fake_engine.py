"""The HTTP app over a scripted engine, in process: no models, driven through ASGI.

`FakeEngine` has the interface the engine thread drives (``add``, ``abort``, ``step``,
``has_unfinished``, ``stats``, ``max_model_len``): each step gives every request one
token until its ``max_tokens``. It can hold its requests (they stay in flight until
aborted) or fail (``step`` or ``add`` raising), which is what the tests here need.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POLICY = ROOT / "examples" / "policies" / "default.yaml"
TOKEN = 42  # the token every step emits


class FakeEngine:
    """One token per request per step; ``hold``: requests never advance; ``step_error``: raised
    by ``step`` once ``fail_after`` requests were added; ``add_error``: raised by the
    ``fail_after``-th ``add``."""

    def __init__(self, max_model_len: int = 64, *, hold: bool = False, step_error: BaseException | None = None,
                 add_error: BaseException | None = None, fail_after: int = 1) -> None:
        self.max_model_len = max_model_len
        self.hold = hold
        self.step_error = step_error
        self.add_error = add_error
        self.fail_after = fail_after
        self.left: dict[str, int] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add(self, request_id: str, prompt_ids: list[int], params: Any, spec: Any) -> None:
        if self.add_error is not None and len(self.added) + 1 >= self.fail_after:
            raise self.add_error
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room for output")
        self.left[request_id] = params.max_tokens
        self.added.append(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.left.pop(request_id, None)

    def has_unfinished(self) -> bool:
        if self.step_error is not None:
            return len(self.added) >= self.fail_after
        return bool(self.left) and not self.hold

    def step(self) -> list[Any]:
        if self.step_error is not None:
            raise self.step_error
        outputs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            finished = self.left[rid] == 0
            if finished:
                del self.left[rid]
            outputs.append(SimpleNamespace(request_id=rid, new_token_ids=[TOKEN], finished=finished,
                                           finish_reason="length" if finished else None, record=None))
        return outputs

    def stats(self) -> Any:
        from specops.engine.sequence import EngineStats

        return EngineStats(waiting=0, running=len(self.left), batch_size=len(self.left), kv_blocks_used=0,
                           kv_blocks_free=64, kv_blocks_total=64)


_TOKENIZER: list[Any] = []


def bundled_tokenizer() -> Any:
    if not _TOKENIZER:
        from specops.assets import TOKENIZER_DIR
        from specops.decoder.api import _load_tokenizer

        _TOKENIZER.append(_load_tokenizer(TOKENIZER_DIR))
    return _TOKENIZER[0]


def engine_client(engine: FakeEngine, tokenizer: Any = None, *, max_batch: int = 2, max_queue: int = 2) -> Any:
    """An `AsyncEngine` over ``engine`` with the default policy (no Redis, no model parts)."""
    from prometheus_client import CollectorRegistry

    from specops.policies import load_policy
    from specops.engine.async_engine import AsyncEngine
    from specops.engine.metrics import ServingMetrics
    from specops.engine.policy_runtime import PolicyRuntime

    runtime = PolicyRuntime(SimpleNamespace(draft=None, medusa=None), load_policy(str(DEFAULT_POLICY)))
    tok = tokenizer if tokenizer is not None else bundled_tokenizer()
    return AsyncEngine(engine, runtime, tok, metrics=ServingMetrics(CollectorRegistry()), max_batch=max_batch,
                       max_queue=max_queue, poll_s=0.05, threads=1)


@asynccontextmanager
async def serving(client: Any, **app_kwargs: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app over ``client``, started (lifespan, engine loaded), and an HTTP client into it."""
    from specops.server.app import build_app

    app = build_app(lambda: client, model_name="fake", **app_kwargs)
    async with app.router.lifespan_context(app):
        for _ in range(1000):
            if app.state.client is not None:
                break
            assert app.state.load_error is None, app.state.load_error
            await asyncio.sleep(0.01)
        assert app.state.client is client
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fake",
                                     timeout=10) as http:
            yield app, http


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = raw.decode().split("\n\n")
    assert events[-1] == "", raw
    return [e[len("data: "):] for e in events[:-1]]


def json_events(raw: bytes) -> list[Any]:
    return [json.loads(e) if e != "[DONE]" else e for e in sse_events(raw)]
