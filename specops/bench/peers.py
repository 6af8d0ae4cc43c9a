"""The methods a benchmark compares: transformers' own decoding (the peers) and ours.

Every method is a `BenchMethod`: ``run(prompt_ids, prompt) -> MethodRun``. Peers:

* ``hf-greedy``   — ``model.generate(do_sample=False)`` (sampling prompts: ``do_sample=True``);
* ``hf-assisted`` — ``generate(assistant_model=draft)`` with transformers' defaults;
* ``hf-lookup``   — ``generate(prompt_lookup_num_tokens=...)`` (prompt-lookup drafting).

transformers does not report acceptance, so the peers count forward calls with hooks:
each target forward emits the accepted tokens plus one of its own, so
``accepted = new_tokens - target_forwards``; for ``hf-assisted`` every assistant
forward proposes one token, so ``drafted = assistant_forwards`` (an approximation that
includes the assistant's prompt prefill). ``hf-lookup`` drafts without forwards, so
its acceptance rate is unknown (None); its mean accepted length is still measured.

Ours (``ar``, ``draft``, ``ngram``, ``medusa``, ``auto``) run through `specops.decoder.Decoder`
and report the decoder's own exact counters.

``ar-chain`` is a reference, not a decoding method: greedy plain decoding whose continuation
is computed CHAIN_TOKENS tokens per C call (the fast runner's `draft_chain` on the target,
the same forwards as ``ar``, so the same tokens), i.e. ``ar`` without its per-token Python.
Speculation's rounds spend less Python per token than ``ar`` does, so part of a "vs ar"
ratio is that Python; "vs ar-chain" is the ratio without it. Sampled prompts run ``ar``
(the chain here is greedy). Fast fp32 CPU runner only.

llama.cpp is the CPU engine people actually run: its own ``llama-server`` binary
(``llama.cpp``, ``llama.cpp-spec``, ``llama.cpp-q4``: `specops.bench.llamacpp_server_peer`, built
by ``make peers``) and, for comparison, its Python binding's generate loop
(``llama-cpp-python``, ``llama-cpp-python-lookup``: `specops.bench.llamacpp_peer`, the
``peers`` extra), which spends Python and NumPy on every token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from specops.spec.clock import device_clock

HF_METHODS = ("hf-greedy", "hf-assisted", "hf-lookup")
OUR_METHODS = ("ar", "draft", "ngram", "ngram-prompt", "medusa", "auto", "eagle", "eagle-tree")
# bench names that run one of the Decoder's methods with options: prompt lookup without the
# target's corpus n-gram store (`specops.spec.ngram_store`), as ``ngram`` ran before it had one;
# eagle drafting EAGLE-2's dynamic tree, whose ``eagle_tree`` shape is `BenchConfig.eagle_tree`
VARIANTS: dict[str, tuple[str, dict]] = {"ngram-prompt": ("ngram", {"corpus": False}), "eagle-tree": ("eagle", {})}
LLAMA_CPP_PYTHON_METHODS = ("llama-cpp-python", "llama-cpp-python-lookup")  # specops.bench.llamacpp_peer
SERVER_METHODS = ("llama.cpp", "llama.cpp-spec", "llama.cpp-q4")  # specops.bench.llamacpp_server_peer
LLAMA_CPP_METHODS = SERVER_METHODS + LLAMA_CPP_PYTHON_METHODS
REFERENCE_METHODS = ("ar-chain",)
ALL_METHODS = HF_METHODS + OUR_METHODS + REFERENCE_METHODS + LLAMA_CPP_METHODS
CHAIN_TOKENS = 32  # tokens per C call of ``ar-chain`` (an EOS is looked for after each call)
LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens


@dataclass
class MethodRun:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    target_forwards: int
    drafted: int | None = None            # None: the method does not expose it
    accepted: int | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    prefill_s: float | None = None        # seconds of the target's prompt pass (None: not exposed)


class BenchMethod(Protocol):
    name: str

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float,
            seed: int) -> MethodRun: ...


class ForwardCounter:
    """Counts calls of a module's forward with a pre-hook (removable)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


class HFMethod:
    """transformers ``generate`` in one of its modes (see the module docstring)."""

    def __init__(self, name: str, model, *, draft=None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None):
        if name not in HF_METHODS:
            raise ValueError(f"unknown transformers method {name!r}; choose one of {', '.join(HF_METHODS)}")
        if name == "hf-assisted" and draft is None:
            raise ValueError("hf-assisted needs a draft model")
        self.name = name
        self.model = model
        self.draft = draft
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodRun:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.model.device)  # [1, P]
        kwargs: dict = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if self.name == "hf-assisted":
            kwargs["assistant_model"] = self.draft
        elif self.name == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
        target_counter = ForwardCounter(self.model)
        draft_counter = ForwardCounter(self.draft) if self.name == "hf-assisted" else None
        try:
            torch.manual_seed(seed)
            start = device_clock(ids.device)
            with torch.inference_mode():
                out = self.model.generate(ids, **kwargs)  # [1, P + N]
            seconds = device_clock(ids.device) - start
        finally:
            target_counter.remove()
            if draft_counter is not None:
                draft_counter.remove()
        tokens = out[0, ids.shape[1]:].tolist()
        run = MethodRun(tokens=tokens, seconds=seconds, target_forwards=target_counter.count)
        if self.name != "hf-greedy":
            run.accepted = max(0, len(tokens) - target_counter.count)
        if draft_counter is not None:
            run.drafted = draft_counter.count
        elif self.name == "hf-greedy":
            run.drafted = run.accepted = None
        return run


class DecoderMethod:
    """One of our methods through `specops.decoder.Decoder.generate`."""

    def __init__(self, name: str, decoder, *, gamma: int = 4, schedule: str = "constant",
                 eos_token_id: int | None = None, **options):
        if name not in OUR_METHODS:
            raise ValueError(f"unknown specops method {name!r}; choose one of {', '.join(OUR_METHODS)}")
        self.name = name
        self.method, extra = VARIANTS.get(name, (name, {}))
        self.decoder = decoder
        self.gamma = gamma
        self.schedule = schedule
        self.eos_token_id = eos_token_id
        self.options = {**extra, **options}

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodRun:
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.decoder.generate(list(prompt_ids), method=self.method, gamma=self.gamma, schedule=self.schedule,
                                        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                        eos_token_id=self.eos_token_id, **self.options)
        seconds = time.perf_counter() - start
        s = out.stats
        speculative = self.method != "ar"
        return MethodRun(
            tokens=list(out.tokens), seconds=seconds, target_forwards=s.target_forwards,
            drafted=s.drafted if speculative else None, accepted=s.accepted if speculative else None,
            accepted_per_pos=list(s.accepted_per_pos), drafted_per_pos=list(getattr(s, "drafted_per_pos", [])),
            prefill_s=s.prefill_s,
        )


class ChainedAR:
    """``ar-chain`` (module docstring): greedy plain decoding, CHAIN_TOKENS tokens per C call."""

    name = "ar-chain"

    def __init__(self, decoder, *, eos_token_id: int | None = None):
        self.decoder = decoder
        self.eos_token_id = eos_token_id
        self.plain = DecoderMethod("ar", decoder, eos_token_id=eos_token_id)

    @staticmethod
    def unavailable_reason(target) -> str | None:
        """Why the target cannot chain (None: it can)."""
        if getattr(target, "draft_chain", None) is None:
            return "needs the fast Llama runner (FastLlamaRunner.draft_chain)"
        if not getattr(target, "c_layers", False):
            return "needs the C layer stack (fp32 CPU with the kernels built)"
        return None

    def run(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodRun:
        if temperature > 0:
            return self.plain.run(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        from specops.spec.request import check_room, eos_set
        from specops.models.runner import prompt_forward

        target = self.decoder.target
        eos = eos_set(self.eos_token_id)
        prompt = list(prompt_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            budget = check_room(len(prompt), target.max_context, max_new_tokens)
            target.reset(1)
            tokens = [prompt_forward(target, torch.tensor([prompt], dtype=torch.long)).last_choice()]
            forwards = 1
            while len(tokens) < budget and tokens[-1] not in eos:
                count = min(CHAIN_TOKENS, budget - len(tokens))
                chained = target.draft_chain([tokens[-1]], count)
                if chained is None:
                    raise RuntimeError("ar-chain: the target did not take the C chain")
                forwards += count
                for token in chained[0]:
                    tokens.append(token)
                    if token in eos:
                        break
        return MethodRun(tokens=tokens, seconds=time.perf_counter() - start, target_forwards=forwards)
