"""The public decoding API: `Decoder` and `GenerateOutput`.

```python
dec = Decoder(target_model, draft=draft_model)             # loaded transformers models (or runners)
dec = Decoder.from_pretrained("bundled")                     # the shipped tiny pair
out = dec.generate(prompt_ids, method="draft", gamma=4, max_new_tokens=128)
out.tokens, out.stats
```

`Decoder.generate` validates the request, builds a `SamplingConfig`, a seeded
`torch.Generator` and a γ schedule, and calls one function per method through the
`METHODS` table (`autoregressive.generate_ar`, `draft.generate_draft`,
`ngram.generate_ngram`, `medusa_decode.generate_medusa`, `eagle.generate_eagle`).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specops.models.loading import load_runner
from specops.models.runner import IMPLS, ModelRunner, UnsupportedModelError, returns_layers
from specops.spec.errors import (
    ContextLengthError,
    InvalidRequestError,
    MissingComponentError,
    ModelLoadError,
    UnknownMethodError,
    VocabMismatchError,
)
from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.schedule import GammaSchedule, make_schedule
from specops.spec.stats import DecodeStats

log = logging.getLogger(__name__)

BUNDLED = "bundled"
CALIBRATION_TOKENS = 8  # plain steps timed once per Decoder for the speed-up estimate


@dataclass
class GenerateOutput:
    """The result of one `Decoder.generate` call."""

    tokens: list[int]
    """New tokens only (the prompt is not repeated)."""
    stats: DecodeStats
    """Counters and timings of this request."""
    tokenizer: Any = field(default=None, repr=False, compare=False)
    """The decoder's tokenizer (None without one); used by `text`."""

    @property
    def text(self) -> str | None:
        """``tokens`` decoded with the decoder's tokenizer (decoded on access, not while timing)."""
        return None if self.tokenizer is None else self.tokenizer.decode(self.tokens)


@dataclass
class DecodeRequest:
    """A validated ``generate`` call, handed to a method through the `METHODS` table."""

    prompt_ids: torch.Tensor  # [B, T] long on the target's device
    sampling: SamplingConfig
    generator: torch.Generator
    max_new_tokens: int
    eos_token_id: int | list[int] | None
    schedule: GammaSchedule
    heads: int | None = None
    tree: Any = None
    deadline_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def loop_args(self, *, speculative: bool = True) -> dict[str, Any]:
        """The keyword arguments every method's loop takes: sampling, generator, budget and EOS,
        and for a speculative loop its γ schedule and deadline."""
        args: dict[str, Any] = dict(sampling=self.sampling, generator=self.generator,
                                    max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id)
        if speculative:
            args.update(schedule=self.schedule, deadline_s=self.deadline_s)
        return args


def _run_ar(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.autoregressive import generate_ar

    return generate_ar(dec.target, req.prompt_ids, **req.loop_args(speculative=False))


def _run_draft(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.draft import generate_draft

    if dec.draft is None:
        raise MissingComponentError("method 'draft' needs a draft model: Decoder(target, draft=...)")
    if req.options.get("pipeline", "sync") == "async":
        from specops.spec.async_draft import generate_draft_async

        return generate_draft_async(dec.target, dec.draft, req.prompt_ids, **req.loop_args(),
                                    draft_threads=req.options.get("draft_threads", 1))
    return generate_draft(dec.target, dec.draft, req.prompt_ids, **req.loop_args())


def _corpus(dec: Decoder, req: DecodeRequest) -> tuple[Any, dict[str, Any]]:
    """The decoder's n-gram store for a greedy request unless ``corpus=False`` is among the
    options; the other options. A sampled request drafts from its own context only: at
    temperature 1 a corpus chain is kept with the probability the target gives its tokens,
    well below the greedy agreement its ``min_prob`` is set for (on the bundled mixed suite's
    hot prompts `auto` ran 13-19% slower with the store than without, three alternated runs)."""
    options = dict(req.options)
    corpus = options.pop("corpus", True)
    if not isinstance(corpus, bool):
        raise InvalidRequestError(f"corpus must be true or false, got {corpus!r}")
    return (dec.ngram_store if corpus and req.sampling.greedy else None), options


def _run_ngram(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.ngram import generate_ngram

    store, options = _corpus(dec, req)
    return generate_ngram(dec.target, req.prompt_ids, **req.loop_args(), store=store, **options)


def _run_medusa(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.medusa_decode import generate_medusa

    return generate_medusa(dec.target, req.prompt_ids, heads=dec.medusa, **req.loop_args(speculative=False),
                           num_heads=req.heads, tree=req.tree, deadline_s=req.deadline_s, **req.options)


def _run_auto(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.auto import generate_auto

    store, options = _corpus(dec, req)
    return generate_auto(dec.target, req.prompt_ids, draft=dec.draft, heads=dec.medusa, estimates=dec.auto_estimates,
                         **req.loop_args(), store=store, eagle=dec.eagle, **options)


EAGLE_TRAIN_COMMAND = "specops train eagle --model NAME"


def _run_eagle(dec: Decoder, req: DecodeRequest) -> tuple[list[int], DecodeStats]:
    from specops.spec.eagle import generate_eagle
    from specops.spec.eagle_tree import tree_shape

    return generate_eagle(dec.target, dec.eagle, req.prompt_ids, **req.loop_args(),
                          tree=tree_shape(req.options.get("eagle_tree")))


# method name -> function(decoder, request) -> (tokens, stats). One entry per method.
METHODS: dict[str, Callable[[Decoder, DecodeRequest], tuple[list[int], DecodeStats]]] = {
    "ar": _run_ar,
    "draft": _run_draft,
    "ngram": _run_ngram,
    "medusa": _run_medusa,
    "auto": _run_auto,
    "eagle": _run_eagle,
}
# methods that need a component, and the component's attribute on the Decoder
REQUIRES: dict[str, str] = {"draft": "draft", "medusa": "medusa", "eagle": "eagle"}
# method-specific keyword options `generate(**options)` may pass through
OPTIONS: dict[str, frozenset[str]] = {
    "draft": frozenset({"pipeline", "draft_threads"}),  # pipeline "sync" | "async" (specops.spec.async_draft)
    "ngram": frozenset({"max_ngram", "min_ngram", "by_match", "corpus"}),  # corpus: use the decoder's ngram_store
    "medusa": frozenset({"typical", "lookup_branch"}),
    "auto": frozenset({"max_ngram", "min_ngram", "corpus"}),
    "eagle": frozenset({"eagle_tree"}),  # (depth, topk, tree_size): EAGLE-2's dynamic tree (specops.spec.eagle_tree)
}


DRAFT_KERNEL_WEIGHTS = "bf16"  # a draft model's CPU kernel weights: it only proposes, so half the bytes per token


def _as_runner(model: Any, *, impl: str, max_context: int | None, role: str) -> ModelRunner:
    """A runner for a transformers model, or the object itself when it already is one."""
    if isinstance(model, ModelRunner):
        return model
    if getattr(model, "config", None) is None:
        raise TypeError(f"{role} must be a transformers causal LM or a ModelRunner, got {type(model).__name__}")
    if role == "target":
        runner = _bf16_kernel_target(model, impl=impl, max_context=max_context)
        if runner is not None:
            return runner
    return load_runner(model, max_context=max_context, impl=impl,
                       kernel_weights=DRAFT_KERNEL_WEIGHTS if role == "draft" else "fp32")


def _load_model(path: str | Path, *, dtype: torch.dtype, device: str | torch.device, role: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as exc:  # transformers raises OSError, ValueError, EnvironmentError, ...
        raise ModelLoadError(f"cannot load the {role} model from {str(path)!r}: {exc}") from exc
    return model.to(device).eval()


def _bf16_kernel_target(model: Any, *, impl: str, max_context: int | None) -> ModelRunner | None:
    """A bfloat16 target on the CPU with the C kernels: the fast runner over a float32 copy of
    ``model`` (every value a bf16 one) with bf16 kernel weights (`FastLlamaRunner`
    ``kernel_weights``), so its layer stack streams the bf16 weights (half the bytes of fp32)
    and accumulates in fp32, where transformers' bf16 CPU matmuls run far from the memory's
    speed. None where that does not apply or the fast runner cannot take the model (it then
    runs in bf16 as loaded)."""
    from specops.models.fast_llama import FastLlamaRunner
    from specops.kernels import cpu_linear

    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if (impl == "hf" or weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or not cpu_linear.available()):
        return None
    try:
        return FastLlamaRunner(copy.deepcopy(model).float(), max_context=max_context, kernel_weights="bf16")
    except UnsupportedModelError as exc:
        if impl == "fast":
            raise
        log.info("the bf16 kernel path is unavailable (%s); the target runs in bf16 as loaded", exc)
        return None


DRAFT_VOCAB_NAME = "draft_vocab.json"  # in a draft model's folder: the tokens its greedy drafting ranks


def draft_vocab_in(folder: str | Path) -> list[int] | None:
    """The ``tokens`` list of a draft model folder's ``draft_vocab.json`` (`Decoder`'s
    ``draft_vocab``), or None when the folder has none."""
    path = Path(folder) / DRAFT_VOCAB_NAME
    if not path.is_file():
        return None
    try:
        tokens = json.loads(path.read_text())["tokens"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the draft vocabulary {str(path)!r}: {exc}") from exc
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise ModelLoadError(f"{str(path)!r}: 'tokens' must be a non-empty list of token ids")
    return tokens


def _load_tokenizer(path: str | Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # a model folder without tokenizer files is fine
        log.info("no tokenizer loaded from %s: %s", path, exc)
        return None


class Decoder:
    """A target model, optionally a draft and Medusa heads, and the decoding methods over them."""

    def __init__(
        self,
        target: Any,
        draft: Any = None,
        medusa: Any = None,
        *,
        fallback: bool = False,
        impl: str = "auto",
        max_context: int | None = None,
        tokenizer: Any = None,
        draft_vocab: Any = None,
        ngram_store: Any = None,
        eagle: Any = None,
    ) -> None:
        """``target`` / ``draft``: loaded transformers causal LMs (or `ModelRunner`s).

        ``draft_vocab``: token ids the draft model's greedy drafting ranks (its LM head runs over
        those rows only: `FastLlamaRunner.set_draft_vocab`; outputs stay exact, a token outside
        is never proposed); it needs a draft runner with ``set_draft_vocab`` (the fast runner).

        ``fallback=True``: a draft that cannot be used (a vocabulary mismatch, a model no
        runner can run; in `from_pretrained` also one that fails to load) is dropped with a warning and
        ``method="draft"`` then runs plain decoding, with the reason in the stats.
        ``impl``: "auto" | "fast" | "hf" (see `specops.models.loading.load_runner`); "auto" runs
        the target through transformers (`HFRunner`) when ``eagle`` is an EAGLE-3 drafter, which
        reads intermediate hidden states the fast runner does not return ("fast" refuses one).
        ``ngram_store``: a `specops.spec.ngram_store.NgramStore` for the target's tokenizer: the
        n-gram drafter (methods "ngram" and "auto") drafts its corpus chains where the context has
        no match (``generate(..., corpus=False)``: prompt lookup only).
        ``eagle``: an `specops.models.eagle_model.EagleDrafter` or an
        `specops.models.eagle3_model.Eagle3Drafter` for method "eagle" (bound here to ``target``
        when it is a transformers model; one passed with a runner must be bound).
        """
        if impl not in IMPLS:
            raise InvalidRequestError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.fallback = bool(fallback)
        self.target_model = None if isinstance(target, ModelRunner) else target
        target_impl = "hf" if impl == "auto" and getattr(eagle, "reads_layers", False) else impl
        self.target = _as_runner(target, impl=target_impl, max_context=max_context, role="target")
        self.draft: ModelRunner | None = None
        self.draft_error: str | None = None
        self.medusa = medusa
        self.eagle = None if eagle is None else _check_eagle(eagle, self.target_model, self.target)
        self.tokenizer = tokenizer
        self.plain_token_s: float | None = None
        from specops.spec.auto import AutoEstimates

        self.auto_estimates = AutoEstimates()  # method "auto": running estimates across requests
        self.ngram_store = None
        if ngram_store is not None:
            from specops.spec.ngram_store import NgramStore

            if not isinstance(ngram_store, NgramStore):
                raise InvalidRequestError(f"ngram_store must be an NgramStore, got {type(ngram_store).__name__}")
            try:
                ngram_store.check_tokenizer(tokenizer, self.target.vocab_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            self.ngram_store = ngram_store
        if draft is not None and draft is target:
            raise InvalidRequestError(
                "draft and target are the same runner, which would share one KV cache; "
                "pass the model (each gets its own runner) or a second runner"
            )
        if draft is not None:
            from specops.spec.draft import check_vocab

            try:
                runner = _as_runner(draft, impl=impl, max_context=max_context, role="draft")
                check_vocab(self.target, runner)
            except VocabMismatchError as exc:
                self._drop_draft(exc)
            except (TypeError, ValueError) as exc:  # not a model, unsupported config, context too large
                self._drop_draft(ModelLoadError(f"cannot use the draft model: {exc}"))
            else:
                self.draft = runner
        if draft_vocab is not None:
            if self.draft is None:
                if draft is None:
                    raise InvalidRequestError("draft_vocab needs a draft model")
            elif not hasattr(self.draft, "set_draft_vocab"):
                raise InvalidRequestError(f"draft_vocab needs a draft runner that ranks a vocabulary subset "
                                          f"(the fast runner), not {type(self.draft).__name__}")
            else:
                try:
                    self.draft.set_draft_vocab(draft_vocab)
                except ValueError as exc:
                    raise InvalidRequestError(f"draft_vocab: {exc}") from None

    def _drop_draft(self, error: Exception) -> None:
        """Raise ``error`` unless ``fallback`` was asked for; then warn and run without a draft."""
        if not self.fallback:
            raise error
        reason = str(error)
        self.draft_error = reason
        message = f"draft model unusable, method 'draft' falls back to plain decoding: {reason}"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        draft: str | Path | None = None,
        medusa: str | Path | None = None,
        *,
        fallback: bool = False,
        impl: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_context: int | None = None,
        eagle: str | Path | None = None,
    ) -> Decoder:
        """Load a target (a folder, a hub id in the local cache, or ``"bundled"``) and optional parts.

        ``"bundled"`` is the tiny pair under ``specops/assets/``; its draft (and Medusa
        heads, when present) load unless ``draft`` / ``medusa`` name others. A draft folder
        may hold ``draft_vocab.json`` (``{"tokens": [ids]}``): the tokens its greedy drafting
        ranks (``draft_vocab`` of `Decoder`; the bundled draft ships the 1024 most frequent).
        A target folder may hold ``ngram_store.npz`` (`specops.spec.ngram_store`; the
        bundled target ships one): the n-gram drafter's corpus table.
        A registered model's name (``specops models list``) loads its cached folder, pulled
        on first use (`specops.models.resolve_model`; bfloat16 loads its ``bf16/`` copy).
        ``eagle``: an EAGLE drafter folder (`specops.models.eagle_io`) for method "eagle"; for
        a registered model's name, the drafter ``specops train eagle --model NAME`` cached
        (``$SPECOPS_CACHE_DIR/eagle/NAME``) loads when there is one, and so do the Medusa heads
        ``specops train heads --model NAME --chat`` cached (``$SPECOPS_CACHE_DIR/medusa/NAME``)
        unless ``medusa`` names others.
        """
        from specops.models import ModelsError, resolve_model
        from specops.models.resolve import is_registered

        if is_registered(path):
            from specops.models import eagle_io, medusa_heads

            if eagle is None:
                cached = eagle_io.default_dir(str(path))
                eagle = cached if eagle_io.is_drafter_dir(cached) else None
            if medusa is None:
                cached = medusa_heads.default_dir(str(path))
                medusa = cached if medusa_heads.is_heads_dir(cached) else None
        try:
            path = resolve_model(path, dtype=dtype)
            draft = resolve_model(draft, dtype=dtype)
        except ModelsError as exc:
            raise ModelLoadError(str(exc)) from None
        tokenizer_path: str | Path = path
        auto_medusa = False
        if str(path) == BUNDLED:
            from specops.assets import DRAFT_DIR, MEDUSA_DIR, TARGET_DIR, TOKENIZER_DIR

            if not (TARGET_DIR / "config.json").is_file():
                raise ModelLoadError(f"the bundled models are missing from {TARGET_DIR}; run `specops train tiny`")
            path, tokenizer_path = TARGET_DIR, TOKENIZER_DIR
            draft = DRAFT_DIR if draft is None else draft
            if medusa is None and MEDUSA_DIR.is_dir():
                medusa, auto_medusa = MEDUSA_DIR, True
        target_model = _load_model(path, dtype=dtype, device=device, role="target")
        draft_model = None
        draft_error: ModelLoadError | None = None
        if draft is not None:
            try:
                draft_model = _load_model(draft, dtype=dtype, device=device, role="draft")
            except ModelLoadError as exc:
                if not fallback:
                    raise
                draft_error = exc
        heads = None
        if medusa is not None:
            try:
                heads = _load_medusa(medusa, target_model, device=device)
            except ModelLoadError as exc:
                if not auto_medusa:
                    raise
                log.warning("bundled Medusa heads not loaded: %s", exc)
        drafter = None
        if eagle is not None:
            from specops.models.eagle_io import load_drafter

            try:
                drafter = load_drafter(eagle, base=target_model, device=device)
            except Exception as exc:  # a bad artifact must name itself
                raise ModelLoadError(f"cannot load the EAGLE drafter from {str(eagle)!r}: {exc}") from exc
        draft_vocab = draft_vocab_in(draft) if draft_model is not None else None
        from specops.spec.ngram_store import store_in

        ngram_store = store_in(path) if Path(path).is_dir() else None
        dec = cls(
            target_model,
            draft=draft_model,
            medusa=heads,
            fallback=fallback,
            impl=impl,
            max_context=max_context,
            tokenizer=_load_tokenizer(tokenizer_path),
            draft_vocab=draft_vocab,
            ngram_store=ngram_store,
            eagle=drafter,
        )
        if draft_error is not None:
            dec._drop_draft(draft_error)
        return dec

    # -- generation ------------------------------------------------------------------
    def _prompt_tensor(self, prompt_ids: Any) -> torch.Tensor:  # -> [1, T] long
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt_ids)
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
                prompt_ids = prompt_ids[0]
            if prompt_ids.dim() != 1:
                raise InvalidRequestError(f"prompt_ids must be a 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
            if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
                raise InvalidRequestError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
            ids = [int(t) for t in prompt_ids.tolist()]
        else:
            try:
                ids = list(prompt_ids)
            except TypeError:
                raise InvalidRequestError(
                    f"prompt_ids must be a list of ints or a 1-D LongTensor, got {type(prompt_ids).__name__}"
                ) from None
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidRequestError(f"prompt_ids must hold ints, found {t!r}")
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token id")
        vocab = self.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.target.max_context:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens is longer than the model's context allows "
                f"({self.target.max_context} positions, at least one of them for the output)"
            )
        return torch.tensor([ids], dtype=torch.long, device=self.target.device)  # [1, T]

    def generate(
        self,
        prompt_ids: Any,
        method: str = "ar",
        gamma: int = 4,
        schedule: str = "constant",
        gamma_min: int = 1,
        gamma_max: int = 8,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        heads: int | None = None,
        tree: Any = None,
        deadline_s: float | None = None,
        **options: Any,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` new tokens after ``prompt_ids``.

        ``prompt_ids``: list of ints or a 1-D LongTensor (or text, with a tokenizer).
        ``method``: "ar" | "draft" | "ngram" | "medusa" | "auto" (per step, whichever of
        plain / ngram / draft / medusa / eagle the running estimates say pays most; lossless) | "eagle"
        (an EAGLE feature drafter, `specops.spec.eagle`; ``eagle_tree=(depth, topk, tree_size)``:
        greedy requests draft EAGLE-2's dynamic tree of that shape instead of a γ chain, exact as
        the chain; sampled ones keep the chain, `specops.spec.eagle_tree`). ``gamma`` and ``schedule``
        ("constant" | "heuristic" | "goodput", bounded by ``gamma_min``..``gamma_max``)
        set the draft length of speculative methods. ``temperature == 0`` is greedy;
        otherwise top-k / top-p filter target and draft alike. ``seed`` makes sampling
        reproducible. Decoding stops after ``eos_token_id`` (kept in the output);
        None means no early stop. ``heads`` / ``tree``: Medusa only. ``deadline_s``:
        decode deadline; past it a speculative request continues with plain decoding
        (``stats.fallback_reason == "deadline"``). ``options``: method-specific extras
        (`OPTIONS`, e.g. ``max_ngram`` for ngram).
        """
        if not isinstance(method, str) or method not in METHODS:
            known = ", ".join(sorted(METHODS))
            raise UnknownMethodError(f"unknown method {method!r}; choose one of {known}")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sched = make_schedule(schedule, gamma, gamma_min, gamma_max)
        if method != "medusa" and (heads is not None or tree is not None):
            given = " and ".join(n for n, v in (("heads", heads), ("tree", tree)) if v is not None)
            raise InvalidRequestError(f"{given} apply to method 'medusa' only, not {method!r}")
        unknown = sorted(set(options) - OPTIONS.get(method, frozenset()))
        if unknown:
            allowed = ", ".join(sorted(OPTIONS.get(method, ()))) or "none"
            raise InvalidRequestError(f"unknown option(s) {', '.join(unknown)} for method {method!r} (allowed: {allowed})")
        if method == "draft" and options:
            from specops.spec.async_draft import check_pipeline

            check_pipeline(options.get("pipeline", "sync"), options.get("draft_threads", 1), "draft_threads" in options)
        if deadline_s is not None:
            from specops.spec.request import check_deadline

            check_deadline(deadline_s)
        ids = self._prompt_tensor(prompt_ids)
        generator = make_generator(seed, self.target.device)
        request = DecodeRequest(
            prompt_ids=ids,
            sampling=sampling,
            generator=generator,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            schedule=sched,
            heads=heads,
            tree=tree,
            deadline_s=deadline_s,
            options=options,
        )
        run = METHODS[method]
        fallback_reason = None
        component = REQUIRES.get(method)
        if component is not None and getattr(self, component) is None:
            if component == "draft" and self.draft_error is not None:
                fallback_reason = "draft_unavailable"
                log.info("method 'draft' runs plain decoding: %s", self.draft_error)
                run = _run_ar
            elif method == "eagle":
                raise MissingComponentError(
                    f"method 'eagle' needs an EAGLE drafter: train one with `{EAGLE_TRAIN_COMMAND}` (cached for "
                    "from_pretrained(NAME)), or pass Decoder(target, eagle=...) / from_pretrained(..., eagle=PATH)"
                )
            elif method == "medusa":
                from specops.models.medusa_heads import TRAIN_COMMAND

                raise MissingComponentError(
                    f"method 'medusa' needs Medusa heads: train them with `{TRAIN_COMMAND}` (cached for "
                    "from_pretrained(NAME)), or pass Decoder(target, medusa=...) / from_pretrained(..., medusa=PATH)"
                )
            else:
                raise MissingComponentError(
                    f"method {method!r} needs {component} (Decoder(target, {component}=...) or from_pretrained)"
                )
        if run is not _run_ar and self.plain_token_s is None:
            self._calibrate(ids)
        with torch.inference_mode():
            tokens, stats = run(self, request)
        if fallback_reason is not None:
            stats.fallback_reason = fallback_reason
        if stats.method == "ar" and stats.plain_token_s is not None:
            self.plain_token_s = stats.plain_token_s if self.plain_token_s is None else (
                0.8 * self.plain_token_s + 0.2 * stats.plain_token_s
            )
        if stats.plain_token_s is None:
            stats.plain_token_s = self.plain_token_s
        return GenerateOutput(tokens=tokens, stats=stats, tokenizer=self.tokenizer)

    def _calibrate(self, prompt: torch.Tensor) -> None:  # prompt: [1, T]
        """Time a few plain single-token forwards once, for the speed-up estimate."""
        from specops.spec.autoregressive import generate_ar

        room = self.target.max_context - prompt.shape[1]
        with torch.inference_mode():
            _, stats = generate_ar(
                self.target,
                prompt,
                sampling=SamplingConfig(),
                generator=make_generator(0, self.target.device),
                max_new_tokens=max(1, min(CALIBRATION_TOKENS, room)),
            )
        self.plain_token_s = stats.plain_token_s


def _check_eagle(drafter: Any, model: Any, runner: ModelRunner):
    """``drafter`` bound to ``model`` (the target's transformers model; None when the target came
    as a runner, then it must be bound already) and checked against the target's vocabulary."""
    from specops.models.eagle3_model import Eagle3Drafter
    from specops.models.eagle_model import EagleDrafter, EagleError

    if not isinstance(drafter, (EagleDrafter, Eagle3Drafter)):
        raise InvalidRequestError(f"eagle must be an EagleDrafter or Eagle3Drafter "
                                  f"(specops.models.eagle_io.load_drafter), got {type(drafter).__name__}")
    if drafter.config.vocab_size != runner.vocab_size:
        raise VocabMismatchError(f"EAGLE drafter vocabulary ({drafter.config.vocab_size} tokens) differs from the "
                                 f"target's ({runner.vocab_size} tokens)")
    try:
        if model is not None:
            drafter.bind(model)
        elif not drafter.bound:
            raise EagleError("with a runner as the target, pass a drafter already bound to its model "
                             "(EagleDrafter.bind(model))")
    except EagleError as exc:
        raise InvalidRequestError(f"cannot use the EAGLE drafter: {exc}") from None
    if drafter.reads_layers and not returns_layers(runner):
        raise InvalidRequestError(f"cannot use the EAGLE drafter: an EAGLE-3 drafter reads the target's hidden states "
                                  f"of layers {list(drafter.feature_layers)}, which {type(runner).__name__} does not "
                                  "return; load the target with impl='hf' (or 'auto')")
    return drafter.eval()


def _load_medusa(path: str | Path, base, *, device: str | torch.device):
    from specops.models.medusa_heads import MedusaHeads

    try:  # heads pick their fastest dtype (they only propose; the output stays exact)
        return MedusaHeads.from_pretrained(path, base=base, device=device)
    except Exception as exc:  # a bad artifact must name itself
        raise ModelLoadError(f"cannot load Medusa heads from {str(path)!r}: {exc}") from exc
