"""llama.cpp's Python binding as a peer in ``specops bench decode`` (llama-cpp-python, the
``peers`` extra). Its generate loop samples and copies logits in Python every token, so it
understates llama.cpp; `specops.bench.llamacpp_server_peer` times llama.cpp's own server.

Methods:

* ``llama-cpp-python``        — plain decoding (greedy sampler at temperature 0);
* ``llama-cpp-python-lookup`` — llama-cpp-python's prompt-lookup decoding: a
  ``LlamaPromptLookupDecoding`` draft model proposes the tokens that followed the last
  matching n-gram of the context, and one batched decode verifies them.
  ``num_pred_tokens=2`` is the value llama-cpp-python documents for CPU-only machines
  (10 for GPUs).

Both run the target converted to GGUF by `specops.bench.gguf_convert` (same weights;
f32 for a float32 benchmark), on the same token ids as every other method (no
tokenizer round trip), with ``n_threads = n_threads_batch = --threads``. A run is timed
like ours: from the first prompt token to the last new token (prompt pass included;
model load and the GGUF conversion excluded). Each run starts from an empty KV cache
(``reset()`` first, so llama-cpp-python's prefix reuse cannot skip a prompt pass).

Counters: ``target_forwards`` = llama_decode batches (``Llama.eval`` calls: the prompt
pass, then one per step); for the lookup method ``drafted`` = tokens the lookup
proposed and ``accepted = new_tokens - target_forwards`` (as for transformers' peers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from specops.bench.peers import LLAMA_CPP_PYTHON_METHODS, MethodRun

LOOKUP_PRED_TOKENS = 2   # llama-cpp-python's documented CPU value
LOOKUP_MAX_NGRAM = 2     # LlamaPromptLookupDecoding's default
INSTALL_HINT = 'pip install -e ".[peers]" (builds llama-cpp-python from source)'


class PeerUnavailable(RuntimeError):
    """A peer method cannot run here; the message says why (shown in the benchmark report)."""


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, or None when it is not installed (or does not load)."""
    try:
        import llama_cpp
    except (ImportError, OSError):
        return None
    return getattr(llama_cpp, "__version__", "unknown")


class _CountingDraft:
    """Wraps a llama-cpp-python draft model and counts the tokens it proposes."""

    def __init__(self, draft):
        self.draft = draft
        self.proposed = 0

    def __call__(self, input_ids, /, **kwargs):  # [n] -> [k]
        out = self.draft(input_ids, **kwargs)
        self.proposed += len(out)
        return out


class LlamaCppMethod:
    """One llama.cpp method on a GGUF file (see the module docstring)."""

    def __init__(self, name: str, gguf_path: Path | str, *, threads: int, n_ctx: int,
                 eos_token_id: int | None = None):
        if name not in LLAMA_CPP_PYTHON_METHODS:
            raise ValueError(f"unknown llama-cpp-python method {name!r}; choose one of {', '.join(LLAMA_CPP_PYTHON_METHODS)}")
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except (ImportError, OSError) as exc:
            raise PeerUnavailable(f"llama-cpp-python is not installed ({exc}); {INSTALL_HINT}") from exc
        self.name = name
        self.eos_token_id = eos_token_id
        self.n_ctx = n_ctx
        self.draft = (_CountingDraft(LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_MAX_NGRAM,
                                                               num_pred_tokens=LOOKUP_PRED_TOKENS))
                      if name == "llama-cpp-python-lookup" else None)
        try:
            self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                             n_threads=threads, n_threads_batch=threads, draft_model=self.draft, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise PeerUnavailable(f"llama.cpp could not load {gguf_path}: {exc}") from exc
        self.forwards = 0
        eval_tokens = self.llm.eval

        def counted_eval(tokens):
            self.forwards += 1
            return eval_tokens(tokens)

        self.llm.eval = counted_eval  # generate() calls self.eval once per decode batch

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodRun:
        prompt = list(prompt_ids)
        if len(prompt) + max_new_tokens > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds the {self.n_ctx} context")
        if self.draft is not None:
            self.draft.proposed = 0
        self.forwards = 0
        self.llm.set_seed(seed)
        # temperature 0: greedy sampler; otherwise plain temperature sampling (every other filter off)
        sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        tokens: list[int] = []
        start = time.perf_counter()
        self.llm.reset()  # empty KV cache: no prefix reuse across runs
        for token in self.llm.generate(prompt, reset=True, **sampling):
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens or token == self.eos_token_id:
                break
        seconds = time.perf_counter() - start
        run = MethodRun(tokens=tokens, seconds=seconds, target_forwards=self.forwards)
        if self.draft is not None:
            run.drafted = self.draft.proposed
            run.accepted = max(0, len(tokens) - self.forwards)
        return run


def build_llama_cpp_methods(names: Sequence[str], target_dir: Path | None, *, dtype: str, threads: int,
                            n_ctx: int, eos_token_id: int | None,
                            tokenizer_json: Path | None = None) -> tuple[list[LlamaCppMethod], dict[str, str]]:
    """The requested llama.cpp methods, and {name: reason} for those that cannot run here."""
    names = [n for n in names if n in LLAMA_CPP_PYTHON_METHODS]
    if not names:
        return [], {}
    reason = None
    gguf_path = None
    if llama_cpp_version() is None:
        reason = f"llama-cpp-python is not installed; {INSTALL_HINT}"
    elif target_dir is None:
        reason = "needs the target model's folder (the model was passed in memory)"
    else:
        from specops.bench.gguf_convert import GGUFConvertError, ensure_gguf

        try:
            gguf_path = ensure_gguf(target_dir, out_type=dtype, tokenizer_json=tokenizer_json)
        except (GGUFConvertError, ImportError) as exc:
            reason = f"GGUF conversion failed: {exc}"
    if reason is not None:
        return [], {n: reason for n in names}
    methods, unavailable = [], {}
    for name in names:
        try:
            methods.append(LlamaCppMethod(name, gguf_path, threads=threads, n_ctx=n_ctx, eos_token_id=eos_token_id))
        except PeerUnavailable as exc:
            unavailable[name] = str(exc)
    return methods, unavailable
