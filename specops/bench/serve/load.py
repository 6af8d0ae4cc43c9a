"""The load generator of ``specops bench serve``: streamed ``/v1/completions`` requests (or
``/v1/chat/completions`` for a conversation), a measured cell of them, and the unmeasured traffic
(warm-up, settle) between cells."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

from specops.bench.serve.config import RequestResult, ServeBenchConfig
from specops.bench.serve.prompts import ChatPrompt, Prompt, PromptTags, build_prompts


# aiohttp, as `vllm bench serve` uses: on a 2-core host the client shares the CPU with the
# server, and httpx's streaming cost 143-160 us of client CPU per streamed token against
# aiohttp's 50-69 (measured at 16 streams; c16 tok/s rose 8-29% with the same server).
def _text(chunk: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk carries (a chat chunk's delta content, a completion chunk's text)."""
    choices = chunk.get("choices")
    if not choices:
        return ""
    return (choices[0].get("delta") or {}).get("content") or "" if chat else choices[0].get("text") or ""


async def _one(session: Any, url: str, model: str, prompt: Prompt, temperature: float, cfg: ServeBenchConfig,
               headers: dict[str, str]) -> RequestResult:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = isinstance(prompt, ChatPrompt)
    if chat:
        body["messages"] = [{"role": role, "content": text} for role, text in prompt.messages]
        body["metadata"] = {"task": prompt.task}
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with session.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body,
                                headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                now = time.perf_counter()
                if _text(chunk, chat):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    spec = chunk.get("specops") or {}
                    res.drafted = spec.get("drafted") or 0
                    res.accepted = spec.get("accepted") or 0
                    res.observed = bool(spec.get("canary") or spec.get("probe"))
                    res.fallen_back = spec.get("fallback_reason") == "policy_fallback"
        res.e2e_s = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage chunk"
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_cell(url: str, model: str, prompts: list[tuple[Prompt, float]], concurrency: int, cfg: ServeBenchConfig,
                   on_done=None) -> tuple[list[RequestResult], float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def guarded(prompt: Prompt, temperature: float) -> RequestResult:
            async with sem:
                out = await _one(session, url, model, prompt, temperature, cfg, headers)
            if on_done is not None:
                on_done()
            return out

        start = time.perf_counter()
        tasks = []
        for prompt, temperature in prompts:
            tasks.append(asyncio.create_task(guarded(prompt, temperature)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _traffic(url: str, model: str, cfg: ServeBenchConfig, seconds: float, concurrencies: list[int],
             pool: list[tuple[Prompt, float]], tags: PromptTags) -> None:
    """Unmeasured traffic from ``pool`` (cycled), at each of ``concurrencies`` in turn, for ``seconds``;
    each batch as ``tags`` sends it (fresh: behind its own tag)."""
    deadline = time.monotonic() + seconds
    k = at = 0
    while time.monotonic() < deadline:
        c = concurrencies[k % len(concurrencies)]
        n = max(2 * c, 4)
        prompts = tags.fresh([pool[(at + i) % len(pool)] for i in range(n)])
        asyncio.run(run_cell(url, model, prompts, c, cfg))
        k, at = k + 1, at + n


def _adaptive_warmup(url: str, model: str, cfg: ServeBenchConfig, tags: PromptTags) -> None:
    """Traffic of the same mix (other draws), cycling through the measured concurrencies,
    for ``adaptive_warmup_s``: the controller decides from telemetry windows and its alert
    rules wait ``for_s`` (30-60 s in the default policy), so an idle pause would measure
    the initial settings, not what the controller makes of them."""
    from dataclasses import replace

    pool = build_prompts(replace(cfg, seed=cfg.seed + 1000), 512)  # other draws than the measured cells
    _traffic(url, model, cfg, cfg.adaptive_warmup_s, cfg.concurrency, pool, tags)


def _settle(url: str, model: str, cfg: ServeBenchConfig, concurrency: int, prompts: list[tuple[Prompt, float]],
           tags: PromptTags) -> None:
    """One server: ``settle_seconds`` of the cell's prompts at its concurrency under the mode just
    set, before the cell; for the adaptive mode with its controller still paused, so that its
    first window after resuming holds only requests served under its own settings. Fresh
    (`PromptTags`), each settle batch has its own tag, so the cell that follows finds none of its
    prompts in the prefix cache; warm, they are the cell's own texts and it finds them all
    (TTFT at c16 p50 27 ms warm against 59 ms once the cache had lost them, in every mode alike)."""
    _traffic(url, model, cfg, cfg.settle_seconds, [concurrency], prompts, tags)
