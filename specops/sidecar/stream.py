"""Watching a relayed SSE stream: which events carry content, when, and the engine's final numbers.

The proxy passes the engine's bytes on untouched; this only looks at them. To keep
the per-chunk cost small it does not JSON-decode every event:

- an event is a *content* event when its JSON text has a ``"text"`` or ``"content"``
  key whose value is a non-empty string (completions ``choices[].text``, chat
  ``choices[].delta.content``) — a byte search: inside JSON string values quotes are
  escaped, so the pattern cannot match prompt or completion text;
- of the events that carry a ``"usage"`` object or the engine's speculation object
  (vLLM ``"speculative_decoding"``, SGLang ``"meta_info"``, specops ``"specops"``,
  llama.cpp ``"timings"``; a
  ``null`` value, as in specops' and vLLM's content chunks, does not count) only the
  *last* one of each is kept, and decoded once, when the numbers are read: the engines
  report cumulative totals, so earlier ones carry nothing the last does not (a
  substring test first, the regex only on events that contain the key);
- an event whose data is not a JSON object (does not start with ``{`` and end with
  ``}``), or a kept one that does not decode, is counted ``malformed``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specops.sidecar import fields

MAX_EVENT_BYTES = 1024 * 1024  # the parse buffer; the relayed bytes are never held

_CONTENT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_SPEC_MARKERS = {"vllm": b'"speculative_decoding"', "sglang": b'"meta_info"', "specops": b'"specops"',
                 "llamacpp": b'"timings"'}
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_SPEC_OBJECTS = {engine: re.compile(re.escape(marker) + rb"\s*:\s*\{") for engine, marker in _SPEC_MARKERS.items()}


class StreamWatcher:
    """Splits the passed-through bytes into SSE events and times the content ones."""

    def __init__(self, engine: str, started: float) -> None:
        self.engine = engine
        self.marker = _SPEC_MARKERS[engine]
        self._spec_object = _SPEC_OBJECTS[engine].search
        self.started = started
        self.buffer = b""
        self._cr = False  # the last read ended in CR (its LF may come next)
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.chunks = 0
        self.done = False
        self.malformed = 0
        self._usage_raw: bytes | None = None
        self._spec_raw: bytes | None = None
        self._decoded: tuple[bytes, Any] | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self._cr or b"\r" in data:
            if self._cr:  # a CRLF split between two reads
                data, self._cr = b"\r" + data, False
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n")
        self.buffer = self.buffer + data if self.buffer else data
        if len(self.buffer) > MAX_EVENT_BYTES and b"\n\n" not in self.buffer:
            self.malformed += 1  # not SSE (or one giant event): stop parsing it, keep relaying it
            self.buffer = b""
            return
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            if event.startswith(b"data:") and b"\n" not in event:  # the usual one-line event
                payload = event[5:].lstrip(b" ")
            else:
                payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            if payload:
                self._event(payload.strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        if not (payload.startswith(b"{") and payload.endswith(b"}")):
            self.malformed += 1
            return
        if b'"usage"' in payload and _USAGE.search(payload):
            self._usage_raw = payload
        if self.marker in payload and self._spec_object(payload):
            self._spec_raw = payload
        if _CONTENT.search(payload):
            self.chunks += 1
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now

    def _decode(self, raw: bytes | None) -> Any:
        if raw is None:
            return None
        if self._decoded is not None and self._decoded[0] is raw:
            return self._decoded[1]
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
            self.malformed += 1
        self._decoded = (raw, obj)
        return obj

    @property
    def usage(self) -> int | None:
        """``usage.completion_tokens`` of the last event that had it."""
        return fields.completion_tokens(self._decode(self._usage_raw))

    @property
    def counts(self) -> fields.SpecCounts | None:
        """The engine's speculation counts from the last event that had them (None: inconclusive)."""
        return fields.extract(self.engine, self._decode(self._spec_raw))
