"""The HTTP layer's pure parts: request validation, incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from specops.server import protocol as p
from specops.engine.async_engine import _Detokenizer
from specops.server.chat_template import render_plain


@pytest.fixture(scope="module")
def tokenizer():
    from specops.assets import TOKENIZER_DIR
    from specops.decoder.api import _load_tokenizer

    tok = _load_tokenizer(TOKENIZER_DIR)
    assert tok is not None, "the bundled tokenizer ships with the package and must load"
    return tok


def _stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    ids = tokenizer.encode(text)
    det = _Detokenizer(tokenizer, stop)
    chunks, stopped = [], False
    for i, t in enumerate(ids):
        out, stopped = det.add([t], final=i == len(ids) - 1)
        chunks.append(out)
        if stopped:
            break
    return chunks, stopped


@pytest.mark.parametrize("stop", ["world", "orl", "d. b", "\n", "hello"])
def test_stop_strings_truncate_and_never_leak(tokenizer, stop):
    text = "hello world. bye\nagain"
    chunks, stopped = _stream(tokenizer, text, [stop, "zzz-never"])
    assert stopped
    assert "".join(chunks) == text[:text.find(stop)]
    assert all(stop not in "".join(chunks[: i + 1]) for i in range(len(chunks)))


def test_partial_utf8_is_held_back_and_all_text_arrives(tokenizer):
    text = "hé 😀 ok ünïcødé"
    chunks, stopped = _stream(tokenizer, text, [])
    assert not stopped
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text


def test_unknown_fields_are_ignored_unless_they_change_the_output():
    ok = p.CompletionRequest.model_validate({"prompt": "x", "repetition_penalty": 1.0, "logprobs": None,
                                             "best_of": 1, "some_vendor_flag": {"a": 1}})
    ok.check()
    for field, value in (("repetition_penalty", 1.1), ("logprobs", 2), ("echo", True), ("best_of", 3),
                         ("logit_bias", {"5": 10}), ("min_tokens", 4), ("repetition_penalty", True)):
        req = p.CompletionRequest.model_validate({"prompt": "x", field: value})
        with pytest.raises(p.ProtocolError) as err:
            req.check()
        assert err.value.param == field and err.value.status == 400


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "stop": ["a"] * 9}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_checks_name_the_field(body, param):
    with pytest.raises(p.ProtocolError) as err:
        p.CompletionRequest.model_validate(body).check()
    assert err.value.param == param


def test_prompt_forms():
    assert p.CompletionRequest(prompt="a").prompt_value() == "a"
    assert p.CompletionRequest(prompt=["a"]).prompt_value() == "a"
    assert p.CompletionRequest(prompt=[1, 2]).prompt_value() == [1, 2]
    assert p.CompletionRequest(prompt=[[1, 2]]).prompt_value() == [1, 2]
    with pytest.raises(p.ProtocolError):
        p.CompletionRequest(prompt=["a", "b"]).prompt_value()
    with pytest.raises(p.ProtocolError):
        p.CompletionRequest(prompt=[]).prompt_value()


def test_chat_limits_and_template():
    req = p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 5})
    req.check()
    assert req.token_limit == 5
    bad = p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4, "max_completion_tokens": 5})
    with pytest.raises(p.ProtocolError):
        bad.check()
    text = render_plain([("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "and?")], "<|eos|>")
    assert text == "Be brief.\n\nUser: hi\nAssistant: hello<|eos|>\nUser: and?\nAssistant:"
    parts = p.ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert parts.text() == "ab"
    with pytest.raises(p.ProtocolError):
        p.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).text()


def test_windowed_detokenization_equals_the_full_decode_on_random_ids(tokenizer):
    """Chunks of any token split, any ids (special tokens, broken UTF-8 included), add up to the
    text of one full decode: the decode window never drops or repeats text."""
    import random

    rng = random.Random(7)
    vocab = len(tokenizer)
    for trial in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        det = _Detokenizer(tokenizer, [])
        chunks, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            out, stopped = det.add(ids[i:i + n], final=i + n >= len(ids))
            assert not stopped
            chunks.append(out)
            i += n
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True), f"trial {trial}: {ids}"


def test_engine_leaves_a_core_to_the_event_loop_while_many_sequences_stream():
    """threads=2: 2 intra-op threads for 1-3 running sequences, 1 from HTTP_CORE_FROM on, and back."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from specops.engine.async_engine import HTTP_CORE_FROM, AsyncEngine
    from specops.engine.metrics import ServingMetrics

    engine = SimpleNamespace(scheduler=SimpleNamespace(running=[]))
    client = AsyncEngine(engine, runtime=None, tokenizer=[0] * 10, metrics=ServingMetrics(CollectorRegistry()),
                         threads=2)
    calls = []
    client._set_threads = calls.append
    for running in (1, HTTP_CORE_FROM - 1, HTTP_CORE_FROM, 16, 2, 1):
        engine.scheduler.running = [None] * running
        client._pick_threads()
    assert calls == [1, 2]  # set only on a change
    one = AsyncEngine(engine, runtime=None, tokenizer=[0] * 10, metrics=ServingMetrics(CollectorRegistry()), threads=1)
    one._set_threads = calls.append
    engine.scheduler.running = [None] * 16
    one._pick_threads()
    assert calls == [1, 2]  # one thread: nothing to leave


@pytest.mark.parametrize("canary, probe", [(False, False), (True, False), (False, True)])
def test_a_canary_or_probe_request_is_marked_observed_for_the_engine(canary, probe, monkeypatch):
    """The runtime's resolution carries the engine's settings as they are (one settings type): the
    class's γ, deadline and name, its lookup branch, and ``observed`` for a canary's or a probe's request."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from specops.policies.loader import load_policy
    from specops.engine.async_engine import AsyncEngine
    from specops.engine.metrics import ServingMetrics
    from specops.engine.policy_runtime import PolicyRuntime
    from specops.server.server import DEFAULT_POLICY

    policy = load_policy(DEFAULT_POLICY)
    runtime = PolicyRuntime(SimpleNamespace(draft=None, eagle=None, medusa=None), policy)
    monkeypatch.setattr(runtime, "_route", lambda key: (None, canary))
    monkeypatch.setattr(runtime, "_method", lambda rc, settings, temperature: ("ngram", probe, None))
    res = runtime.resolve("x", 3)
    rc = policy.classify("x", {}, 3, None, 0.0)
    engine = SimpleNamespace(scheduler=SimpleNamespace(running=[]))
    client = AsyncEngine(engine, runtime=None, tokenizer=[0] * 10, metrics=ServingMetrics(CollectorRegistry()))
    spec = client.spec_for(res)
    spec.check()
    assert spec is res.spec
    assert (spec.method, spec.auto_key, spec.deadline_s) == ("ngram", rc.name, rc.deadline_s)
    assert (spec.gamma, spec.lookup_branch, spec.typical) == (res.gamma, rc.lookup_branch, False)
    assert spec.observed is (canary or probe)


def test_the_core_rule_applies_only_to_engines_on_torch_threads():
    from types import SimpleNamespace

    from specops.engine.async_engine import HTTP_CORE_FROM, core_rule

    c_stack = SimpleNamespace(target=SimpleNamespace(model=SimpleNamespace(c_layers=True)))
    torch_path = SimpleNamespace(target=SimpleNamespace(model=SimpleNamespace(c_layers=False)))
    generic = SimpleNamespace(target=SimpleNamespace(hf_model=object()))
    assert core_rule(c_stack) is None
    assert core_rule(torch_path) == HTTP_CORE_FROM
    assert core_rule(generic) == HTTP_CORE_FROM


@pytest.mark.parametrize("api_key", [None, "sk-test"])
def test_openapi_declares_the_bearer_key_on_v1_routes_only_when_set(api_key):
    from specops.server.app import build_app

    doc = build_app(lambda: None, model_name="m", api_key=api_key).openapi()
    secured = {path for path, ops in doc["paths"].items() for op in ops.values() if op.get("security")}
    v1 = {path for path in doc["paths"] if path.startswith("/v1/")}
    assert v1 == {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    assert secured == (v1 if api_key else set())
    assert ("bearer" in doc.get("components", {}).get("securitySchemes", {})) == bool(api_key)


def test_serve_says_when_its_policy_file_is_not_the_stored_one(tmp_path, caplog):
    """``--policy FILE`` seeds an empty Redis; against a Redis that holds another policy it is not
    applied (rolling out is `specops policy rollout`'s job), and serve says so instead of silently
    serving the stored one."""
    import logging

    from specops.policies import load_policy
    from specops.policies.loader import read_source
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore
    from specops.server.server import _bootstrap

    root = Path(__file__).resolve().parents[2] / "examples" / "policies"
    default, off = str(root / "default.yaml"), str(root / "off.yaml")
    client = connect(None, tmp_path / "redis")
    try:
        with caplog.at_level(logging.INFO, logger="specops.server.server"):
            _bootstrap(client, "ns", load_policy(default), read_source(default)[0], source=None)
            store = PolicyStore(client, namespace="ns")
            assert store.get_revision(store.current_revision()).policy.version == load_policy(default).version
            caplog.clear()
            _bootstrap(client, "ns", load_policy(default), read_source(default)[0], source=default)  # the same policy
            _bootstrap(client, "ns", load_policy(off), read_source(off)[0], source=None)  # nothing named: no warning
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            _bootstrap(client, "ns", load_policy(off), read_source(off)[0], source=off)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "off.yaml" in warned[0] and "not applied" in warned[0]
        assert "specops policy rollout" in warned[0]
        assert store.get_revision(store.current_revision()).policy.version == load_policy(default).version
    finally:
        close(client)


def test_health_answers_like_healthz_without_the_api_key():
    """``GET /health`` (what vLLM, SGLang and llama-server answer, and load generators probe) is
    ``/healthz`` under another name; like it, it needs no API key and no loaded engine."""
    import asyncio

    import httpx

    from specops.server.app import build_app

    app = build_app(lambda: None, model_name="m", api_key="sk-test")

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            return await http.get(path)

    health, healthz = asyncio.run(get("/health")), asyncio.run(get("/healthz"))
    assert health.status_code == healthz.status_code == 200
    assert health.content == healthz.content == b"ok\n"
    assert health.headers["content-type"] == healthz.headers["content-type"]
