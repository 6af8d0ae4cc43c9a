"""The engine client the HTTP layer holds: add / abort / stream over one background step loop.

Threads and ownership::

    event loop (uvicorn)           engine thread                  policy thread
    --------------------           -------------                  -------------
    submit(): resolve policy  ──►  commands: add / abort     ◄──  every poll_s: LivePolicy.poll()
      (in memory), enqueue         engine.step() (blocking)       (notifications, reconcile,
    RequestStream: per-request ◄── call_soon_threadsafe(push)     backoff), RecordBuffer.flush()
      asyncio queue, detokenize,   finished: runtime.record()     → Redis; gauges
      stop strings, metrics        (Prometheus + buffer)

Only the engine thread touches the `Engine` (it is not thread-safe); requests reach
it as commands between steps. Each request has its own asyncio queue; the engine
thread fans step outputs out with ``loop.call_soon_threadsafe``. Admission is
bounded (``max_batch + max_queue`` requests in flight, then `QueueFullError`), so
overload never means unbounded memory. A stream that is closed before it finishes
(client gone, stop string matched) aborts its request; the engine frees its blocks
at the next step. `RequestStream.close` is what gives a request's slot back: the
stream's iterator calls it when it ends, and the HTTP layer calls it once the
response is over, whether or not the iterator ever started, so a request cancelled
at any point (the client gone before the first chunk was written included) is
aborted and its slot freed.

Engine failure. Any exception escaping the engine thread (``engine.step``, an
``engine.add`` that fails with something other than the ValueError of a refused
request, ``engine.abort``) is fatal: the traceback is logged, every request in
flight or waiting to be added gets an `EngineFailedError` (the HTTP layer answers
500 in OpenAI's error shape, or ends a stream with an error event), `running` turns
False with `engine_error` saying why (``/readyz``: 503 with the reason), later
requests are refused with `EngineUnavailableError`, and the ``on_failure`` callback
given to `start` is called on the event loop. The loop is not restarted: after a
failed step the engine's scheduler and KV pool may be half-updated, and serving on
from them could return wrong tokens or leak blocks, so ``specops serve`` exits
non-zero instead (`specops.server.server`) and its supervisor (Kubernetes, systemd)
starts a fresh process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specops.engine.metrics import ServingMetrics
from specops.engine.policy_runtime import PolicyRuntime, Resolution

log = logging.getLogger(__name__)

_ADDED = object()  # the engine accepted the request

HTTP_CORE_FROM = 4
"""Running sequences from which the engine's steps leave one core to the event loop, when
its forwards run on torch's intra-op threads (`core_rule`).

The engine thread's torch ops run on all intra-op threads; while many requests stream,
the event loop (detokenizing, SSE framing, socket writes: per token) competes with them
for cores, and an OpenMP region whose worker is preempted waits for it. Measured on a
2-core machine with `specops bench serve`-style load (16 streams, ~150-token prompts):
1 engine thread gave 696-733 tok/s against 482-594 with 2; with one stream, 2 threads
are faster (the event loop is nearly idle). None: always all threads."""


def core_rule(engine: Any) -> int | None:
    """`HTTP_CORE_FROM` for an engine whose target forwards use torch's OpenMP team; None
    (every thread, always) when they run the C layer stack (`PagedLlama.c_layers`): its
    pool's caller takes the chunks of a worker the OS has not scheduled, so a core busy with
    the event loop slows a step only by that worker's share, never to a stall. Measured with
    the bench's prompt mix, 16 streams, 2 cores: 1359-1552 tok/s with both threads against
    818-846 with one from 4 sequences on."""
    model = getattr(getattr(engine, "target", None), "model", None)
    return None if getattr(model, "c_layers", False) else HTTP_CORE_FROM


FALLBACK_CHARS_PER_TOKEN = 64
"""`chars_per_token_bound` of a tokenizer that does not list its vocabulary."""


def chars_per_token_bound(tokenizer: Any) -> int:
    """At most how many characters of text one token stands for: the longest entry of the
    tokenizer's vocabulary (added and special tokens included). In the vocabularies of byte-level
    BPE, SentencePiece and WordPiece tokenizers an entry has at least one character per character
    of text it encodes, so a text of ``n`` characters has at least ``n / bound`` tokens. A
    tokenizer whose normalizer deletes characters (one that collapses runs of whitespace) can
    beat the bound; the HTTP layer's size check would then refuse such a prompt as too long.
    `FALLBACK_CHARS_PER_TOKEN` when the tokenizer has no ``get_vocab``."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return FALLBACK_CHARS_PER_TOKEN
    longest = max((len(token) for token in get_vocab()), default=0)
    return longest if longest > 0 else FALLBACK_CHARS_PER_TOKEN


class QueueFullError(RuntimeError):
    """Too many requests in flight; retry after ``retry_after_s``."""

    def __init__(self, inflight: int, retry_after_s: int = 1) -> None:
        super().__init__(f"server busy: {inflight} requests in flight (max_batch + max_queue); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The models are still loading, or the engine stopped."""


class EngineFailedError(RuntimeError):
    """The engine thread failed while this request was in flight (see the module docstring)."""


@dataclass
class GenerationRequest:
    """One validated generation, as the HTTP layer hands it over."""

    prompt_ids: list[int]
    text: str                                   # what the policy classifies (prompt / last user message)
    params: Any                                 # specops.engine.sequence.SamplingParams
    stop: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    routing_key: str | None = None
    turn: int | None = None                     # chat: 1 + assistant messages before it (None: the turn label)


@dataclass
class Delta:
    """Newly visible output of a stream: text (stop strings already cut) and whether it ended."""

    text: str
    finish_reason: str | None = None


class _Detokenizer:
    """Incremental text of the committed tokens, holding back what a stop string may still claim.

    Each step decodes a short window, not the whole output (a full decode per step is
    quadratic in the output length): the text of ``ids[prefix:]`` minus the text of
    ``ids[prefix:read]``, where ``read`` is where the text was last complete and ``prefix``
    the read point before it. Both decodes start at the same token, so a tokenizer that
    treats the start of a string specially (a stripped leading space) affects both alike;
    a window that ends inside a UTF-8 sequence (``\ufffd``) waits for the next token.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0          # characters already handed out
        self.text = ""         # text of ids[:read]
        self._prefix = 0       # token index where the decode window starts
        self._read = 0         # tokens whose text is in self.text

    def _advance(self, final: bool) -> None:
        decode, ids = self.tokenizer.decode, self.ids
        if self._read == len(ids):
            return
        before = decode(ids[self._prefix:self._read], skip_special_tokens=True) if self._read > self._prefix else ""
        after = decode(ids[self._prefix:], skip_special_tokens=True)
        if after.startswith(before):
            if after.endswith("\ufffd") and not final:
                return  # an unfinished UTF-8 sequence: wait for the next token
            self.text += after[len(before):]
        else:  # the window's text changed before the read point: decode the whole output once
            full = decode(ids, skip_special_tokens=True)
            if full.endswith("\ufffd") and not final:
                return
            self.text = full
        self._prefix, self._read = self._read, len(ids)

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """(new visible text, a stop string matched)."""
        self.ids.extend(token_ids)
        self._advance(final)
        if self.stop:
            hits = [self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                cut = max(self.sent, min(hits))
                out = self.text[self.sent:cut]
                self.sent = cut
                return out, True
        end = len(self.text)
        if not final:
            for s in self.stop:  # the longest tail that is a prefix of a stop string stays back
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if s.startswith(self.text[end - n:end]):
                        end -= n
                        break
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out, False


class RequestStream:
    """Async iterator of `Delta`s for one request; closing it early aborts the request."""

    def __init__(self, client: AsyncEngine, request_id: str, req: GenerationRequest, resolution: Resolution,
                 arrived: float) -> None:
        self.client = client
        self.request_id = request_id
        self.resolution = resolution
        self.prompt_tokens = len(req.prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.record: Any = None                  # DecodeStats, when the engine finished the request
        self.arrived = arrived
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._detok = _Detokenizer(client.tokenizer, req.stop)
        self._done = False
        self._released = False

    def push(self, item: Any) -> None:  # on the event loop (via call_soon_threadsafe)
        self._queue.put_nowait(item)

    async def _next_item(self) -> Any:
        return await self._queue.get()

    def specops(self) -> dict[str, Any]:
        """The ``specops`` object of the response."""
        body = self.resolution.as_dict()
        rec = self.record
        if rec is not None:
            body["method"] = rec.method
            body["drafted"] = rec.drafted
            body["accepted"] = rec.accepted
            if rec.fallback_reason:
                body["fallback_reason"] = rec.fallback_reason
        else:
            body["drafted"] = body["accepted"] = None
        return body

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    def close(self) -> None:
        """Abort the request unless it finished, and give its slot back (once). Safe to call
        more than once, and on a stream whose iterator never started."""
        if not self._done:
            self._done = True
            self.client.abort(self.request_id)
            self.client.metrics.requests.labels("aborted").inc()
        if not self._released:
            self._released = True
            self.client._release()

    async def _iterate(self) -> AsyncIterator[Delta]:
        metrics = self.client.metrics
        cls = self.resolution.request_class
        itl, out_tokens = metrics.itl.labels(cls), metrics.output_tokens.labels(cls)  # looked up once
        try:
            while not self._done:
                item = await self._next_item()
                if isinstance(item, BaseException):  # the engine failed: nothing left to abort
                    self._done = True
                    metrics.requests.labels("error").inc()
                    raise item
                now = time.monotonic()
                n = len(item.new_token_ids)
                if n:
                    if self.first_at is None:
                        self.first_at = now
                        metrics.ttft.labels(cls).observe(now - self.arrived)
                    elif self.last_at is not None:
                        itl.observe(now - self.last_at)
                    self.last_at = now
                    self.completion_tokens += n
                    out_tokens.inc(n)
                text, stopped = self._detok.add(list(item.new_token_ids), final=item.finished)
                if item.finished:
                    self.record = item.record
                if stopped:
                    self.finish_reason = "stop"
                    self._done = True
                    if not item.finished:
                        self.client.abort(self.request_id)
                    yield Delta(text, "stop")
                    break
                if item.finished:
                    self._done = True
                    reason = item.finish_reason if item.finish_reason in ("stop", "length") else "abort"
                    self.finish_reason = reason
                    yield Delta(text, reason)
                    break
                if text:
                    yield Delta(text)
            metrics.requests.labels("ok").inc()
            if self.last_at is not None:
                metrics.e2e.labels(cls).observe(self.last_at - self.arrived)
        finally:
            self.close()


def _push_all(pairs: list[tuple[RequestStream, Any]]) -> None:  # on the event loop
    for stream, item in pairs:
        stream.push(item)


class AsyncEngine:
    """Owns the `Engine`, the `PolicyRuntime` and the threads around them (see module docstring)."""

    def __init__(self, engine: Any, runtime: PolicyRuntime, tokenizer: Any, *, metrics: ServingMetrics,
                 max_batch: int = 16, max_queue: int = 256, poll_s: float = 0.2, vocab_size: int | None = None,
                 threads: int | None = None, http_core_from: int | None = HTTP_CORE_FROM) -> None:
        self.engine = engine
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_inflight = max_batch + max_queue
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        self.max_chars_per_token = chars_per_token_bound(tokenizer)
        self.poll_s = poll_s
        self.inflight = 0
        self._ids = itertools.count()
        self._commands: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self.engine_error: str | None = None     # why the engine thread failed (None: it has not)
        self._on_failure: Callable[[str], None] | None = None
        self._active: dict[str, RequestStream] = {}          # engine thread only
        self._taken: list[tuple[str, Any]] = []               # engine thread only: commands being run
        self._stats: Any = None
        # intra-op threads of the engine's steps: all of them, less one (kept for the event
        # loop that streams the tokens) while at least ``http_core_from`` sequences run
        import torch

        self.threads = int(threads or torch.get_num_threads())
        self.http_core_from = http_core_from if self.threads > 1 else None
        self._set_threads = torch.set_num_threads
        self._threads_now = self.threads

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_failure: Callable[[str], None] | None = None) -> None:
        """Start the engine and policy threads; ``on_failure(reason)`` runs on ``loop`` if the
        engine thread fails (see the module docstring)."""
        self._loop = loop
        self._on_failure = on_failure
        self._stats = self.engine.stats()  # later snapshots come from the engine thread only
        for name, target in (("specops-engine", self._engine_loop), ("specops-policy", self._policy_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout_s)
        self.runtime.records.flush(force=True)
        self.runtime.close()

    @property
    def running(self) -> bool:
        return (bool(self._threads) and all(t.is_alive() for t in self._threads) and not self._stopping
                and self.engine_error is None)

    # -- requests ----------------------------------------------------------------------
    async def submit(self, req: GenerationRequest) -> RequestStream:
        """Admit a request; returns its stream once the engine accepted it.

        Raises `QueueFullError`, `EngineUnavailableError`, or the engine's ValueError
        (e.g. `PromptTooLongError`) for a request it refuses.
        """
        if not self.running or self._loop is None:
            raise EngineUnavailableError("the engine is not running")
        if self.inflight >= self.max_inflight:
            self.metrics.requests.labels("rejected").inc()
            raise QueueFullError(self.inflight)
        res = self.runtime.resolve(req.text, len(req.prompt_ids), labels=req.labels, routing_key=req.routing_key,
                                   temperature=req.params.temperature, turn=req.turn)
        spec = self.spec_for(res)
        request_id = f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id, req, res, time.monotonic())
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        self.metrics.prompt_tokens.labels(res.request_class).inc(len(req.prompt_ids))
        self._command("add", (request_id, list(req.prompt_ids), req.params, spec, stream))
        try:
            first = await stream._next_item()
        except BaseException:  # cancelled while waiting: the engine may still add it
            self.abort(request_id)
            self._release()
            raise
        if first is not _ADDED:
            self._release()
            self.metrics.requests.labels("error").inc()
            raise first
        return stream

    def spec_for(self, res: Any) -> Any:
        """The engine's `SpecSettings` for a request the runtime resolved: a canary's or a fallback
        probe's speculation is being measured (``observed``: the engine's veto spares it)."""
        return res.spec

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def _release(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)

    def _command(self, kind: str, payload: Any) -> None:
        with self._cond:
            if self.engine_error is not None:  # nobody will run it: an add hears so at once
                if kind == "add":
                    self._deliver(payload[4], EngineFailedError(f"the engine failed: {self.engine_error}"))
                return
            self._commands.append((kind, payload))
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------
    def _deliver(self, stream: RequestStream, item: Any) -> None:
        self._deliver_all([(stream, item)])

    def _deliver_all(self, pairs: list[tuple[RequestStream, Any]]) -> None:
        """Hand items to their streams with one event-loop wake-up (not one per stream)."""
        assert self._loop is not None
        if not pairs:
            return
        try:
            self._loop.call_soon_threadsafe(_push_all, pairs)
        except RuntimeError:  # the loop closed (shutdown)
            pass

    def _engine_loop(self) -> None:
        try:
            self._run_engine()
        except BaseException as exc:  # whatever it is, the requests must hear of it (module docstring)
            self._fail(exc)

    def _run_engine(self) -> None:
        active = self._active
        while True:
            with self._cond:
                while not self._commands and not self.engine.has_unfinished() and not self._stopping:
                    self._cond.wait(0.5)
                if self._stopping:
                    break
                self._taken, self._commands = self._commands, []
            taken = self._taken
            while taken:
                kind, payload = taken.pop(0)
                if kind == "add":
                    request_id, ids, params, spec, stream = payload
                    active[request_id] = stream  # failed with the others if ``add`` breaks the engine
                    try:
                        self.engine.add(request_id, ids, params, spec)
                    except ValueError as exc:  # the engine refuses this request: the request's 4xx
                        del active[request_id]
                        self._deliver(stream, exc)
                        continue
                    self._deliver(stream, _ADDED)
                else:
                    self.engine.abort(payload)
            if self.engine.has_unfinished():
                self._pick_threads()
                outputs = self.engine.step()
                ready: list[tuple[RequestStream, Any]] = []
                for out in outputs:
                    stream = active.get(out.request_id)
                    if out.finished:
                        active.pop(out.request_id, None)
                        if out.record is not None and stream is not None:
                            try:
                                res = stream.resolution
                                self.runtime.record(res, out.record.to_record(res.request_class))
                            except Exception:  # telemetry must never fail a request
                                log.exception("recording telemetry of %s failed", out.request_id)
                    if stream is not None:
                        ready.append((stream, out))
                self._deliver_all(ready)
            try:
                self._stats = self.engine.stats()
                self.metrics.engine(self._stats)
            except Exception:  # pragma: no cover - stats are plain counters
                log.exception("engine stats failed")

    def _fail(self, exc: BaseException) -> None:
        """The engine thread's last act: say why, fail every request it holds or was handed."""
        reason = f"{type(exc).__name__}: {exc}"
        with self._cond:
            self.engine_error = reason
            leftover, self._commands = self._taken + self._commands, []
            self._taken = []
        streams = list(self._active.values()) + [payload[4] for kind, payload in leftover if kind == "add"]
        self._active.clear()
        log.error("the engine thread failed; failing %d requests and refusing new ones: %s", len(streams), reason,
                  exc_info=exc)
        message = f"the engine failed: {reason}"
        self._deliver_all([(stream, EngineFailedError(message)) for stream in streams])
        if self._on_failure is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_failure, reason)
            except RuntimeError:  # the loop closed (shutdown)
                pass

    def _pick_threads(self) -> None:
        """One core for the event loop while many sequences stream (see `HTTP_CORE_FROM`)."""
        if self.http_core_from is None:
            return
        running = getattr(getattr(self.engine, "scheduler", None), "running", ())
        busy = len(running) >= self.http_core_from
        want = self.threads - 1 if busy else self.threads
        if want != self._threads_now:
            self._set_threads(want)
            self._threads_now = want

    # -- the policy thread -----------------------------------------------------------------
    def _policy_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
            try:
                self.runtime.poll()
                self.metrics.policy(self.runtime.live, self.runtime.records)
            except Exception:  # keep polling whatever happens
                log.exception("policy poll failed")
            time.sleep(self.poll_s)

    def status(self) -> dict[str, Any]:
        """Engine and policy details for ``/readyz``."""
        live = self.runtime.live
        policy = live.status() if live is not None else {"source": "file", "live": True, "stale_reason": None}
        policy["records_buffered"] = len(self.runtime.records)
        policy["records_dropped"] = self.runtime.records.dropped
        stats = self._stats  # the engine thread's last snapshot (the engine is not thread-safe)
        return {"engine": {"running": self.running, "error": self.engine_error, "waiting": stats.waiting,
                           "active": stats.running, "kv_blocks_used": stats.kv_blocks_used,
                           "kv_blocks_free": stats.kv_blocks_free, "inflight": self.inflight,
                           "max_inflight": self.max_inflight, "max_model_len": self.max_model_len,
                           "prefix_cache_hit_blocks": stats.prefix_cache_hit_blocks,
                           "medusa_branches": stats.medusa_branches,
                           "medusa_branch_tokens": stats.medusa_branch_tokens,
                           "attention_kernel": stats.attention_kernel},
                "policy": policy}
