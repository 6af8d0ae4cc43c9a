"""Prompts are tokenized off the event loop, and one too long for the context whatever its
tokens is refused with the context-length 400 before it is tokenized."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from specops.engine.async_engine import FALLBACK_CHARS_PER_TOKEN, chars_per_token_bound
from specops.server.chat_template import render_plain
from tests.serving.fake_engine import FakeEngine, bundled_tokenizer, engine_client, serving

CONTEXT = 64


class SpyTokenizer:
    """The bundled tokenizer, noting each call's method, input size and thread; with
    ``template``, it has a chat template (rendered like the bundled transcript format)."""

    def __init__(self, template: bool = False) -> None:
        self.inner = bundled_tokenizer()
        self.calls: list[tuple[str, int, int]] = []
        self.chat_template = "transcript" if template else None

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.calls.append(("encode", len(text), threading.get_ident()))
        return self.inner.encode(text, *args, **kwargs)

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        self.calls.append(("decode", len(ids), threading.get_ident()))
        return self.inner.decode(ids, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        text = render_plain([(m["role"], m["content"]) for m in messages], self.inner.eos_token)
        self.calls.append(("template", len(text), threading.get_ident()))
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def _run(tok: SpyTokenizer, requests: list[tuple[str, dict]]) -> tuple[list[Any], int]:
    """The responses to ``requests`` (in order) and the event loop's thread."""
    client = engine_client(FakeEngine(max_model_len=CONTEXT), tok)

    async def run() -> tuple[list[Any], int]:
        async with serving(client) as (_, http):
            out = [await asyncio.wait_for(http.post(path, json=body), 10) for path, body in requests]
            return out, threading.get_ident()

    return asyncio.run(run())


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x" * 1_000_000, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_000}], "max_tokens": 2},
     "messages"),
])
def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(route, body, param):
    tok = SpyTokenizer()
    (r,), _ = _run(tok, [(route, body)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert "1000" in err["message"] and f"context is {CONTEXT} tokens" in err["message"]
    assert not [c for c in tok.calls if c[0] == "encode"], tok.calls


def test_a_token_id_prompt_over_the_context_is_refused_undecoded():
    tok = SpyTokenizer()
    (r,), _ = _run(tok, [("/v1/completions", {"prompt": [5] * 100_000, "max_tokens": 2})])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    assert tok.calls == []


def test_a_prompt_under_the_bound_is_still_checked_by_its_token_count():
    tok = SpyTokenizer()
    text = "x " * 200  # far under CONTEXT x the bound in characters, over CONTEXT in tokens
    assert len(text) < CONTEXT * chars_per_token_bound(tok)
    (r,), _ = _run(tok, [("/v1/completions", {"prompt": text, "max_tokens": 2})])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens;" in r.json()["error"]["message"]
    assert [c[0] for c in tok.calls] == ["encode"]


def test_templating_tokenizing_and_prompt_decoding_run_off_the_event_loop():
    tok = SpyTokenizer(template=True)
    responses, loop_thread = _run(tok, [
        ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": [11, 12, 13, 14, 15], "max_tokens": 2}),
    ])
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    prompt_calls = [c for c in tok.calls if c[0] in ("encode", "template") or (c[0] == "decode" and c[1] == 5)]
    assert [c[0] for c in prompt_calls] == ["encode", "template", "encode", "decode"]
    assert all(thread != loop_thread for _, _, thread in prompt_calls), (prompt_calls, loop_thread)


def test_chars_per_token_bound():
    tok = bundled_tokenizer()
    bound = chars_per_token_bound(tok)
    assert bound == max(len(t) for t in tok.get_vocab())
    text = "    return  x\n" * 50 + "ünïcødé 😀 " * 20
    assert len(tok.encode(text)) >= len(text) / bound
    assert chars_per_token_bound([0] * 10) == FALLBACK_CHARS_PER_TOKEN  # no vocabulary to read
