"""`StreamWatcher` peeks at SSE events by byte search; it must find what full JSON decoding finds.

The reference below decodes every event (what the watcher did before its shortcut):
content chunks as `proxy._has_content` counts them, ``usage.completion_tokens`` of the
last event with a ``usage`` object, the speculation counts of the last event with the
engine's object. Streams: vLLM, SGLang and ``specops serve`` shapes (the latter built with
the server's own chunk functions), completions and chat, with text made to look like the
markers (quotes, ``"usage"``, ``[DONE]``, ``data:``), split into random feeds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specops.server import protocol as p
from specops.sidecar import fields
from specops.sidecar.proxy import _has_content
from specops.sidecar.stream import StreamWatcher

FIX = Path(__file__).parent / "fixtures"
TRICKY = ["hello", ' "text": "x', '\\"content\\":\\"y', '"usage": {"completion_tokens": 999}', "data: [DONE]\n\n",
          "\n\ndata: {}", '"specops": {"drafted": 1}', '"meta_info":{', "é ✓ \u2028", "}", "{"]


def _spec_key(engine: str, obj: dict):
    if engine == "vllm":
        m = obj.get("metrics")
        return m.get("speculative_decoding") if isinstance(m, dict) else None
    return obj.get({"sglang": "meta_info", "specops": "specops"}[engine])


def _reference(engine: str, events: list[bytes]) -> tuple[int, int | None, fields.SpecCounts | None, bool]:
    chunks, usage_obj, spec_obj, done = 0, None, None, False
    for payload in events:
        if payload == b"[DONE]":
            done = True
            continue
        obj = json.loads(payload)
        chunks += _has_content(obj)
        if isinstance(obj.get("usage"), dict):
            usage_obj = obj
        if isinstance(_spec_key(engine, obj), dict):
            spec_obj = obj
    return chunks, fields.completion_tokens(usage_obj), fields.extract(engine, spec_obj), done


def _sse(obj) -> bytes:
    return json.dumps(obj) if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _vllm(rng: random.Random, chat: bool) -> list[bytes]:
    sd = json.loads((FIX / "vllm_response.json").read_text())["metrics"]
    base = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1, "model": "m"}
    out = []
    if chat:
        out.append(dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]))
    n = rng.randint(0, 12)
    for i in range(n):
        text = rng.choice(TRICKY + [""])
        choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
        ev = dict(base, choices=[dict(choice, logprobs=None, finish_reason=None)])
        if rng.random() < 0.3:  # continuous usage stats: every chunk has the running totals
            ev["usage"] = {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": i + 4}
        out.append(ev)
    out.append(dict(base, choices=[dict({"index": 0, "delta": {}} if chat else {"index": 0, "text": ""},
                                        finish_reason="length")]))
    if rng.random() < 0.8:
        out.append(dict(base, choices=[], usage={"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
                        metrics=sd))
    return [_sse(e).encode() for e in out]


def _sglang(rng: random.Random, fixture: str) -> list[bytes]:
    meta = json.loads((FIX / fixture).read_text())["meta_info"]
    base = {"id": "s", "object": "text_completion", "created": 1, "model": "m"}
    out = []
    n = rng.randint(0, 12)
    for i in range(n):
        ev = dict(base, choices=[{"index": 0, "text": rng.choice(TRICKY), "logprobs": None, "finish_reason": None}])
        if rng.random() < 0.5:  # builds that attach the running meta_info to chunks
            ev["meta_info"] = dict(meta, completion_tokens=i + 1)
        out.append(ev)
    out.append(dict(base, choices=[{"index": 0, "text": "", "finish_reason": "stop"}], usage={
        "prompt_tokens": 9, "completion_tokens": n, "total_tokens": n + 9}, meta_info=meta))
    return [_sse(e).encode() for e in out]


def _specops(rng: random.Random, chat: bool) -> list[bytes]:
    spec = {"method": "draft", "drafted": 12, "accepted": 7, "gamma": 3}
    usage = rng.random() < 0.7
    out = []
    if chat:
        out.append(p.chat_chunk("r", "m", 1, {"role": "assistant", "content": ""}, None, with_usage=usage))
    n = rng.randint(1, 12)
    for i in range(n):
        final = i == n - 1
        text = rng.choice(TRICKY)
        if chat:
            out.append(p.chat_chunk("r", "m", 1, {"content": text}, "length" if final else None,
                                    spec if final else None, usage))
        else:
            out.append(p.completion_chunk("r", "m", 1, text, "length" if final else None, spec if final else None,
                                          usage))
    if usage:
        out.append(p.usage_chunk("r", "m", 1, "chat.completion.chunk" if chat else "text_completion", 4, n, spec))
    return [_sse(e).encode() for e in out]


def _frame(rng: random.Random, events: list[bytes]) -> bytes:
    parts = []
    for e in events + [b"[DONE]"]:
        sep = b"\r\n\r\n" if rng.random() < 0.2 else b"\n\n"
        space = b" " if rng.random() < 0.9 else b""
        parts.append(b"data:" + space + e + sep)
        if rng.random() < 0.1:
            parts.append(b": keep-alive\n\n")
    return b"".join(parts)


def _feed(rng: random.Random, engine: str, raw: bytes) -> StreamWatcher:
    w = StreamWatcher(engine, started=0.0)
    pos, t = 0, 0.0
    while pos < len(raw):
        step = rng.choice([1, 3, 17, 64, 500, len(raw)])
        t += 0.01
        w.feed(raw[pos:pos + step], t)
        pos += step
    return w


@pytest.mark.parametrize("engine,make", [
    ("vllm", lambda rng: _vllm(rng, chat=False)),
    ("vllm", lambda rng: _vllm(rng, chat=True)),
    ("sglang", lambda rng: _sglang(rng, "sglang_response.json")),
    ("sglang", lambda rng: _sglang(rng, "sglang_response_drafts.json")),
    ("sglang", lambda rng: _sglang(rng, "sglang_response_num_drafts.json")),
    ("specops", lambda rng: _specops(rng, chat=False)),
    ("specops", lambda rng: _specops(rng, chat=True)),
])
def test_byte_scan_finds_what_full_decoding_finds(engine, make):
    rng = random.Random(f"{engine}-{make}")
    for _ in range(150):
        events = make(rng)
        raw = _frame(rng, events)
        w = _feed(rng, engine, raw)
        chunks, usage, counts, done = _reference(engine, events + [b"[DONE]"])
        assert (w.chunks, w.usage, w.counts, w.done, w.malformed) == (chunks, usage, counts, done, 0), raw
        assert len(w.gaps) == max(0, chunks - 1)


def test_null_usage_and_spec_fields_after_the_real_ones_do_not_hide_them():
    w = StreamWatcher("specops", started=0.0)
    w.feed(b'data: {"choices":[],"usage":{"completion_tokens":5},"specops":{"drafted":4,"accepted":2}}\n\n', 0.1)
    w.feed(b'data: {"choices":[{"text":"x"}],"usage": null,"specops" : null}\n\ndata: [DONE]\n\n', 0.2)
    assert (w.usage, w.counts.drafted, w.counts.accepted, w.chunks) == (5, 4, 2, 1)
