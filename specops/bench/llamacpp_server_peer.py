"""llama.cpp's own ``llama-server`` as a peer in ``specops bench decode``.

Methods:

* ``llama.cpp``      — plain decoding, on the target converted to GGUF by
  `specops.bench.gguf_convert` at the benchmark's precision (f32 / bf16: the same weights);
* ``llama.cpp-spec`` — llama-server's n-gram speculation on that GGUF, tuned fairly: each of
  `SPEC_CANDIDATES` runs the warm-up prompts and the fastest one whose greedy output is exact
  is kept (the report names it);
* ``llama.cpp-q4``   — plain decoding of the GGUF the model was pulled as (``specops models
  pull``: SmolLM2's Q4_1), reported beside the rest to show what quantization buys.

Each method is one ``llama-server`` process (built by ``make peers``:
`specops.bench.llamacpp_build`) with one slot, ``--threads`` / ``--threads-batch`` equal to
the benchmark's threads, started before the timed runs and stopped after them. A run posts the
same token ids as every other method to ``/completion`` (no tokenizer round trip) with
``cache_prompt`` off, so each run pays its prompt pass; greedy runs ask temperature 0 (the
server's greedy sampler), sampled runs the prompt's temperature with every other filter off.

Timing comes from llama.cpp itself (its ``timings``): ``seconds`` = ``prompt_ms`` +
``predicted_ms`` (end to end, the prompt pass included; HTTP excluded), ``prefill_s`` =
``prompt_ms``, so the decode-only rate is the rest (`MethodRun.prefill_s`). ``target_forwards``
is one per emitted token for plain decoding (the prompt pass emits the first); for speculation
llama.cpp reports ``draft_n`` / ``draft_n_accepted`` (tools/server/README.md, "timings"), and the
forwards are the emitted tokens less the accepted drafts.
"""

from __future__ import annotations

import logging
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specops.bench.peers import SERVER_METHODS, MethodRun

log = logging.getLogger(__name__)

SPEC_CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "8"),
    ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"),
    ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"),
    ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "8"),
)
"""llama-server's n-gram speculation settings ``llama.cpp-spec`` chooses from (its defaults look
up 12-token n-grams, which short chat prompts never repeat)."""

NO_REPACK = ("--no-repack",)
"""llama.cpp's CPU weight repacking of quantized tensors crashed (SIGSEGV) on the Q4_1 GGUF on an
AVX-512 host; the plain layout decodes correctly everywhere."""

TIMEOUT_S = 600.0


class ServerPeerUnavailable(RuntimeError):
    """A llama-server method cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Server:
    pool: object  # specops.bench.llamacpp_pools.Pool
    args: tuple[str, ...]


class LlamaServerMethod:
    """One llama-server method (see the module docstring)."""

    def __init__(self, name: str, gguf_path: Path, *, threads: int, n_ctx: int, eos_token_id: int | None,
                 spec_args: Sequence[str] = (), workdir: Path | None = None):
        if name not in SERVER_METHODS:
            raise ValueError(f"unknown llama-server method {name!r}; choose one of {', '.join(SERVER_METHODS)}")
        self.name = name
        self.gguf_path = Path(gguf_path)
        self.threads = threads
        self.n_ctx = n_ctx
        self.eos_token_id = eos_token_id
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="specops-llama-"))
        self.spec_args = tuple(spec_args)
        self._server: _Server | None = None
        self.start(self.spec_args)

    @property
    def config(self) -> str:
        """The llama-server options that set this method apart (for the report)."""
        extra = " ".join((*self.spec_args, *(NO_REPACK if self.name == "llama.cpp-q4" else ())))
        return f"{self.gguf_path.name}" + (f" {extra}" if extra else "")

    def start(self, spec_args: Sequence[str]) -> None:
        from specops.bench.llamacpp_pools import PoolError, start_pool

        self.close()
        args = ["--threads", str(self.threads), "--threads-batch", str(self.threads), "--parallel", "1",
                *(NO_REPACK if self.name == "llama.cpp-q4" else ()), *spec_args]
        try:
            pool = start_pool(self.name, self.gguf_path, _free_port(), args, self.workdir, ctx=self.n_ctx)
        except (PoolError, OSError) as exc:
            raise ServerPeerUnavailable(f"llama-server did not start: {exc}") from exc
        self.spec_args = tuple(spec_args)
        self._server = _Server(pool, tuple(args))

    def close(self) -> None:
        if self._server is not None:
            self._server.pool.stop()
            self._server = None

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodRun:
        import httpx

        if self._server is None:
            raise ServerPeerUnavailable(f"{self.name}: the server is stopped")
        prompt = [int(t) for t in prompt_ids]
        if len(prompt) + max_new_tokens > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds the {self.n_ctx} context")
        body = {"prompt": prompt, "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "seed": seed, "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0}
        url = f"http://127.0.0.1:{self._server.pool.port}/completion"
        try:
            reply = httpx.post(url, json=body, timeout=TIMEOUT_S)
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ServerPeerUnavailable(f"{self.name}: llama-server request failed: {exc}\n"
                                        f"{self._server.pool.log_tail()}") from exc
        tokens = [int(t) for t in data.get("tokens") or []]
        if self.eos_token_id is not None and self.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.eos_token_id) + 1]
        timings = data.get("timings") or {}
        prompt_s = float(timings.get("prompt_ms") or 0.0) / 1000
        decode_s = float(timings.get("predicted_ms") or 0.0) / 1000
        # the prompt pass emits the first token, each later forward one more plus its accepted drafts
        run = MethodRun(tokens=tokens, seconds=prompt_s + decode_s, target_forwards=max(len(tokens), 1),
                        prefill_s=prompt_s)
        if "draft_n" in timings:
            run.drafted = int(timings.get("draft_n") or 0)
            run.accepted = int(timings.get("draft_n_accepted") or 0)
            run.target_forwards = max(len(tokens) - run.accepted, 1)
        elif self.spec_args:
            run.drafted, run.accepted = 0, 0
        return run


def tune_spec(method: LlamaServerMethod, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
              *, max_new_tokens: int, candidates: Sequence[Sequence[str]] = SPEC_CANDIDATES) -> list[dict]:
    """Keep on ``method`` the fastest of ``candidates`` on ``prompts`` (greedy) among those whose
    output equals ``reference`` (plain decoding's); returns each candidate's trial."""
    trials = []
    for args in candidates:
        method.start(args)
        method.run(prompts[0], max_new_tokens=min(16, max_new_tokens), temperature=0.0, seed=0)  # warm
        runs = [method.run(p, max_new_tokens=max_new_tokens, temperature=0.0, seed=0) for p in prompts]
        exact = all(r.tokens == list(ref) for r, ref in zip(runs, reference))
        seconds = sum(r.seconds for r in runs)
        tps = sum(len(r.tokens) for r in runs) / max(seconds, 1e-9)
        trials.append({"args": " ".join(args), "tokens_per_s": round(tps, 2), "exact": exact})
        log.info("llama.cpp-spec trial %s: %.1f tok/s, exact %s", " ".join(args), tps, exact)
    usable = [(t["tokens_per_s"], i) for i, t in enumerate(trials) if t["exact"]]
    best = max(usable)[1] if usable else max((t["tokens_per_s"], i) for i, t in enumerate(trials))[1]
    method.start(candidates[best])
    return trials


def build_server_methods(names: Sequence[str], target_dir: Path | None, *, dtype: str, threads: int, n_ctx: int,
                         eos_token_id: int | None) -> tuple[list[LlamaServerMethod], dict[str, str]]:
    """The requested llama-server methods, and {name: reason} for those that cannot run here."""
    names = [n for n in names if n in SERVER_METHODS]
    if not names:
        return [], {}
    from specops.bench.llamacpp_build import BUILD_HINT, find_binary

    if find_binary("llama-server") is None:
        return [], {n: f"llama-server is not built: {BUILD_HINT}" for n in names}
    if target_dir is None:
        return [], {n: "needs the target model's folder (the model was passed in memory)" for n in names}
    from specops.bench.gguf_convert import GGUFConvertError, ensure_gguf, source_gguf

    methods, unavailable = [], {}
    converted: Path | None = None
    for name in names:
        if name == "llama.cpp-q4":
            path = source_gguf(target_dir)
            if path is None:
                unavailable[name] = "the model was not pulled from a quantized GGUF (specops models pull)"
                continue
        else:
            if converted is None:
                try:
                    converted = ensure_gguf(target_dir, out_type=dtype)
                except (GGUFConvertError, ImportError) as exc:
                    unavailable[name] = f"GGUF conversion failed: {exc}"
                    continue
            path = converted
        try:
            methods.append(LlamaServerMethod(name, path, threads=threads, n_ctx=n_ctx, eos_token_id=eos_token_id,
                                             spec_args=SPEC_CANDIDATES[0] if name == "llama.cpp-spec" else ()))
        except ServerPeerUnavailable as exc:
            unavailable[name] = str(exc)
    return methods, unavailable
