"""``specops bench decode``: every decoding method on the same prompts, in one process.

Protocol (mission.md, "Evaluating speed honestly"): one process, same prompts, same
models; every method is warmed up first; then ``repeats`` rounds over all prompts, each
prompt decoded by every method in turn (interleaved, so drifting machine load hits all
methods alike). Per method: ``tokens_per_s`` (median over rounds of new tokens / seconds
over all prompts), ``speedup`` (vs ``hf-greedy``), ``speedup_vs_ar`` (vs our own plain
decoding, ``ar``), ``acceptance_rate`` (accepted /
drafted), ``mean_accepted_len`` (new tokens per target forward), ``exact_match``
(greedy outputs identical to ``hf-greedy`` on every greedy prompt).

In bfloat16, verifying k tokens in one forward rounds differently from k single-token
forwards, so outputs may legitimately diverge from bf16 greedy; `divergences` then
records where, with the target's top-2 logit gap at that position (a near-tie is the
expected cause), instead of claiming exactness.

The llama.cpp peers join the same rows: llama.cpp's own ``llama-server``
(`specops.bench.llamacpp_server_peer`, built by ``make peers``) and its Python binding
(`specops.bench.llamacpp_peer`, the ``peers`` extra). Where one cannot run (not built, or a
target that cannot be converted to GGUF) the report lists it under ``unavailable`` with the
reason (never an error). ``llama.cpp-spec`` is tuned on the first prompts before the timed
rounds (`llamacpp_server_peer.tune_spec`; the trials are in the report).

With ``ar`` among the methods the report's ``bandwidth`` holds the memory-bandwidth ceiling on
plain decoding (`specops.bench.bandwidth`): a measured read bandwidth over the bytes of
weights a T = 1 forward streams, and ar's decode-only tokens/s as a share of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from specops.bench.peers import (ALL_METHODS, HF_METHODS, LLAMA_CPP_METHODS, BenchMethod, ChainedAR, DecoderMethod,
                                 HFMethod, MethodRun)
from specops.bench.llamacpp_peer import build_llama_cpp_methods, llama_cpp_version
from specops.bench.llamacpp_server_peer import LlamaServerMethod, build_server_methods, tune_spec
from specops.bench.suites import SUITES, BenchPrompt, builtin_suite, load_prompts_file
from specops.models.heap import frozen_heap

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REFERENCE = "hf-greedy"
WARMUP_TOKENS = 16
SERVER_CONTEXT = 4096  # llama-server's context (its KV cache is allocated for all of it)
TUNE_PROMPTS = 3  # greedy prompts `llama.cpp-spec` is tuned on
SETTLE_S = 0.01
"""Idle seconds before each timed run (outside its timing), so every method starts on quiet
cores. Methods are interleaved per prompt, and the transformers baselines run torch's OpenMP
team, whose workers spin for ~3 ms after their last region (libgomp's default spin count);
the next method's C kernels then shared a core with them. That slowed the start of `ar`
(the run right after `hf-greedy`) and of no speculative method."""


class BenchError(ValueError):
    """Raised for an invalid benchmark configuration."""


@dataclass
class BenchConfig:
    """One ``specops bench decode`` run."""

    suite: str = "code"
    methods: list[str] = field(default_factory=lambda: ["hf-greedy", "hf-assisted", "hf-lookup", "ar", "draft", "ngram"])
    max_new_tokens: int = 128
    repeats: int = 3
    model: str | None = None          # target folder or registered name (specops models list); None = bundled
    draft: str | None = None          # draft folder or registered name; None = bundled draft (with the bundled target)
    medusa: str | None = None         # Medusa heads folder; None = bundled heads / those cached for a registered --model
    eagle: str | None = None          # EAGLE drafter folder; None = the one cached for a registered --model
    eagle_tree: tuple[int, int, int] = (5, 4, 16)  # method eagle-tree's (depth, topk, tree_size) (`EagleTree`)
    prompts_file: str | None = None   # replaces the suite
    gamma: int = 4
    schedule: str = "constant"
    dtype: str = "float32"
    device: str = "cpu"               # where the models run: "cpu", "cuda", "cuda:1", ...
    seed: int = 0
    threads: int = 2
    limit: int | None = None          # use only the first N prompts
    greedy: bool = False              # every prompt decoded greedily, sampled kinds included (an exactness sweep)
    progress: bool = True
    measure_bandwidth: bool = True    # with ar: the memory-bandwidth ceiling on plain decoding (`bandwidth`)

    def validate(self) -> None:
        if self.suite not in SUITES:
            raise BenchError(f"unknown suite {self.suite!r}; choose one of {', '.join(SUITES)}")
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise BenchError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
        if not self.methods:
            raise BenchError("no methods given")
        if len(set(self.methods)) != len(self.methods):
            raise BenchError("a method is listed twice")
        if self.dtype not in DTYPES:
            raise BenchError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_new_tokens", "repeats", "gamma", "threads"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise BenchError(f"limit must be >= 1, got {self.limit}")
        if "eagle-tree" in self.methods:
            from specops.spec.eagle_tree import tree_shape

            try:
                tree_shape(tuple(self.eagle_tree))
            except ValueError as exc:
                raise BenchError(str(exc)) from None
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise BenchError(f"device must be cpu or cuda[:N], got {self.device!r} ({exc})") from None
        if device.type not in ("cpu", "cuda"):
            raise BenchError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise BenchError(f"device {self.device!r}: this torch sees no CUDA device")
            if (device.index or 0) >= torch.cuda.device_count():
                raise BenchError(f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
            if any(m in LLAMA_CPP_METHODS for m in self.methods):
                raise BenchError("the llama.cpp peers run on the CPU: leave them out of --methods with --device cuda")


@dataclass
class MethodResult:
    """One row of the benchmark table (JSON keys are these field names)."""

    method: str
    tokens_per_s: float
    speedup: float | None
    speedup_vs_ar: float | None       # tokens/s over ``ar``'s in the same run (None without ar)
    speedup_vs_ar_chain: float | None  # ... over the ``ar-chain`` reference's (None without it)
    acceptance_rate: float | None
    mean_accepted_len: float
    exact_match: bool | None          # None: no greedy prompt, or no hf-greedy reference
    exact_prompts: str                # "k/n" greedy prompts identical to hf-greedy
    new_tokens: int
    tokens_per_s_runs: list[float]
    acceptance_by_pos: list[float]    # index = draft position (our speculative methods)
    by_kind: dict[str, dict]
    prefill_share: float | None = None  # the prompt passes' share of the method's time (None: not exposed)
    decode_tokens_per_s: float | None = None  # median over rounds of new tokens / (seconds - prompt passes)


@dataclass
class Models:
    """What the benchmark decodes with."""

    target: object
    draft: object | None
    medusa: object | None
    tokenizer: object
    eos_token_id: int | None
    max_context: int
    target_dir: Path | None = None    # the target's folder (llama.cpp converts it to GGUF); None: in memory
    draft_vocab: list[int] | None = None  # the draft folder's draft_vocab.json, as `Decoder.from_pretrained` reads it
    ngram_store: Any = None  # the target folder's ngram_store.npz, as `Decoder.from_pretrained` reads it
    eagle: Any = None  # the EAGLE drafter (method eagle)


def load_models(cfg: BenchConfig) -> Models:
    """Load target / draft / (Medusa heads) / tokenizer; default: the bundled pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specops.assets import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
    from specops.models import ModelsError, resolve_model

    dtype = DTYPES[cfg.dtype]
    try:  # a registered model's name: its cached folder, pulled on first use
        model = resolve_model(cfg.model, dtype=cfg.dtype, progress=cfg.progress)
        draft_ref = resolve_model(cfg.draft, dtype=cfg.dtype, progress=cfg.progress)
    except ModelsError as exc:
        raise BenchError(str(exc)) from None
    target_path = Path(model) if model else TARGET_DIR
    draft_path = Path(draft_ref) if draft_ref else (DRAFT_DIR if cfg.model is None else None)
    tokenizer_path = target_path if cfg.model else TOKENIZER_DIR
    if not (target_path / "config.json").is_file():
        raise BenchError(f"no model at {target_path} (config.json missing)" +
                         ("; run `specops train tiny`" if cfg.model is None else ""))
    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype).to(cfg.device).eval()
    needs_draft = any(m in ("draft", "hf-assisted") for m in cfg.methods)
    draft = None
    if needs_draft or ("auto" in cfg.methods and draft_path is not None):  # auto uses a draft when there is one
        if draft_path is None:
            raise BenchError("methods draft / hf-assisted need --draft PATH with a custom --model")
        draft = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=dtype).to(cfg.device).eval()
    medusa = None
    medusa_path = heads_path(cfg)
    if "medusa" in cfg.methods or ("auto" in cfg.methods and medusa_path is not None):
        medusa = load_heads(cfg, medusa_path, target)
    wants_eagle = {"eagle", "eagle-tree"} & set(cfg.methods)
    # auto uses an EAGLE drafter when there is one (--eagle, or the one cached for a registered --model)
    eagle = load_eagle(cfg, target) if wants_eagle or ("auto" in cfg.methods and eagle_at_hand(cfg)) else None
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    eos = tokenizer.eos_token_id
    max_context = int(getattr(target.config, "max_position_embeddings", 0) or 0) or 1 << 30
    from specops.decoder.api import draft_vocab_in
    from specops.spec.ngram_store import store_in

    return Models(target, draft, medusa, tokenizer, eos, max_context, target_dir=target_path,
                  draft_vocab=draft_vocab_in(draft_path) if draft is not None else None,
                  ngram_store=store_in(target_path), eagle=eagle)


def heads_path(cfg: BenchConfig) -> Path | None:
    """The Medusa heads for methods medusa and auto: ``cfg.medusa``, else the bundled heads for the
    bundled target, else the heads `specops train heads --model NAME --chat` cached for a registered
    ``cfg.model``; None when there are none."""
    from specops.assets import MEDUSA_DIR
    from specops.models.medusa_heads import default_dir, is_heads_dir
    from specops.models.resolve import is_registered

    if cfg.medusa is not None:
        return Path(cfg.medusa)
    if cfg.model is None:
        return MEDUSA_DIR if MEDUSA_DIR.exists() else None
    if is_registered(cfg.model) and is_heads_dir(default_dir(cfg.model)):
        return default_dir(cfg.model)
    return None


def load_heads(cfg: BenchConfig, path: Path | None, target):
    """The heads at ``path`` (from `heads_path`) bound to ``target``; a `BenchError` saying how to get
    heads when there are none."""
    from specops.decoder import MedusaHeads
    from specops.models.medusa_heads import TRAIN_COMMAND, MedusaError, default_dir
    from specops.models.resolve import is_registered

    if path is None:
        if cfg.model is None:
            from specops.assets import MEDUSA_DIR

            raise BenchError(f"method medusa needs heads: none at {MEDUSA_DIR} (give --medusa PATH)")
        if is_registered(cfg.model):
            train = TRAIN_COMMAND.replace("NAME", cfg.model)
            raise BenchError(f"method medusa needs heads: none cached in {default_dir(cfg.model)}; train them with "
                             f"`{train}` or give --medusa PATH")
        raise BenchError("method medusa needs --medusa PATH with a custom --model (or leave medusa out of --methods)")
    if not path.exists():
        raise BenchError(f"method medusa needs heads: none at {path} (give --medusa PATH)")
    try:  # heads pick their fastest dtype
        return MedusaHeads.from_pretrained(path, base=target, device=cfg.device)
    except MedusaError as exc:
        raise BenchError(f"cannot load the Medusa heads: {exc}") from None


def eagle_at_hand(cfg: BenchConfig) -> bool:
    """Whether an EAGLE drafter is given (``cfg.eagle``) or cached for a registered ``cfg.model``."""
    from specops.models.eagle_io import default_dir, is_drafter_dir
    from specops.models.resolve import is_registered

    if cfg.eagle is not None:
        return True
    return cfg.model is not None and is_registered(cfg.model) and is_drafter_dir(default_dir(cfg.model))


def load_eagle(cfg: BenchConfig, target):
    """The EAGLE drafter for method eagle: ``cfg.eagle``, else the one `specops train eagle` cached for
    a registered ``cfg.model``."""
    from specops.models.eagle_io import default_dir, is_drafter_dir, load_drafter
    from specops.models.eagle_model import EagleError
    from specops.models.resolve import is_registered

    path = cfg.eagle
    if path is None:
        cached = default_dir(cfg.model) if cfg.model is not None and is_registered(cfg.model) else None
        if cached is None or not is_drafter_dir(cached):
            name = cfg.model if cached is not None else "NAME"
            raise BenchError(f"method eagle needs a drafter: train one with `specops train eagle --model {name}` "
                             "or give --eagle PATH")
        path = cached
    try:
        return load_drafter(path, base=target, device=cfg.device)
    except EagleError as exc:
        raise BenchError(f"cannot load the EAGLE drafter: {exc}") from None


def build_methods(cfg: BenchConfig, models: Models) -> tuple[list[BenchMethod], dict[str, str]]:
    """The methods to run, in the order given, with ``hf-greedy`` always first (the reference),
    and {method: reason} for the peers that cannot run here."""
    names = [REFERENCE] + [m for m in cfg.methods if m != REFERENCE]
    peers, unavailable = build_llama_cpp_methods(names, models.target_dir, dtype=cfg.dtype, threads=cfg.threads,
                                                 n_ctx=models.max_context, eos_token_id=models.eos_token_id)
    servers, not_started = build_server_methods(names, models.target_dir, dtype=cfg.dtype, threads=cfg.threads,
                                                n_ctx=min(models.max_context, SERVER_CONTEXT),
                                                eos_token_id=models.eos_token_id)
    peers, unavailable = [*peers, *servers], {**unavailable, **not_started}
    peers_by_name = {m.name: m for m in peers}
    ours = [m for m in names if m not in HF_METHODS and m not in LLAMA_CPP_METHODS]
    decoder = None
    if ours:
        from specops.decoder import Decoder

        drafting = {"draft", "auto"} & set(ours)
        decoder = Decoder(models.target, draft=models.draft if drafting else None, medusa=models.medusa,
                          tokenizer=models.tokenizer, draft_vocab=models.draft_vocab if drafting else None,
                          ngram_store=models.ngram_store, eagle=models.eagle)
    if "ar-chain" in names:
        reason = ChainedAR.unavailable_reason(decoder.target)
        if reason is not None:
            unavailable["ar-chain"] = reason
            names = [m for m in names if m != "ar-chain"]
    methods: list[BenchMethod] = []
    for name in names:
        if name in HF_METHODS:
            methods.append(HFMethod(name, models.target, draft=models.draft, eos_token_id=models.eos_token_id))
        elif name in LLAMA_CPP_METHODS:
            if name in peers_by_name:
                methods.append(peers_by_name[name])
        elif name == "ar-chain":
            methods.append(ChainedAR(decoder, eos_token_id=models.eos_token_id))
        else:
            tree = {"eagle_tree": tuple(cfg.eagle_tree)} if name == "eagle-tree" else {}
            methods.append(DecoderMethod(name, decoder, gamma=cfg.gamma, schedule=cfg.schedule,
                                         eos_token_id=models.eos_token_id, **tree))
    return methods, unavailable


def encode_prompts(prompts: Sequence[BenchPrompt], tokenizer, *, max_context: int, max_new_tokens: int) -> list[list[int]]:
    """Token ids per prompt, keeping the last tokens when prompt + output would not fit."""
    room = max_context - max_new_tokens - 1
    if room < 1:
        raise BenchError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in a {max_context}-token context")
    ids = []
    for p in prompts:
        tokens = tokenizer.encode(p.text, add_special_tokens=False)
        if not tokens:
            raise BenchError(f"prompt encodes to no tokens: {p.text[:40]!r}")
        ids.append(tokens[-room:])
    return ids


def _device_name(device: str) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def run_benchmark(cfg: BenchConfig, *, models: Models | None = None,
                  prompts: Sequence[BenchPrompt] | None = None) -> dict:
    """Run the benchmark; returns the JSON-ready report (``results``: one row per method)."""
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    models = models or load_models(cfg)
    if prompts is None:
        if cfg.prompts_file:
            prompts = load_prompts_file(cfg.prompts_file)
        else:  # a chat model's tokenizer picks the chat-model suites (specops.bench.suites)
            prompts = builtin_suite(cfg.suite, seed=cfg.seed, tokenizer=models.tokenizer)
    prompts = list(prompts)[: cfg.limit] if cfg.limit else list(prompts)
    if cfg.greedy:  # every output is then checked against transformers' greedy one
        prompts = [dataclasses.replace(p, temperature=0.0) for p in prompts]
    prompt_ids = encode_prompts(prompts, models.tokenizer, max_context=models.max_context,
                                max_new_tokens=cfg.max_new_tokens)
    methods, unavailable = build_methods(cfg, models)
    try:
        return _run_methods(cfg, models, prompts, prompt_ids, methods, unavailable)
    finally:
        for method in methods:
            if isinstance(method, LlamaServerMethod):
                method.close()


def _tune_servers(methods: Sequence[BenchMethod], prompts: Sequence[BenchPrompt], prompt_ids: list[list[int]],
                  max_new_tokens: int) -> dict[str, list[dict]]:
    """Tune ``llama.cpp-spec`` on the first greedy prompts against plain decoding's output
    (``ar``'s where it runs, else the reference's)."""
    spec = next((m for m in methods if m.name == "llama.cpp-spec"), None)
    greedy = [ids for p, ids in zip(prompts, prompt_ids) if p.temperature == 0][:TUNE_PROMPTS]
    if spec is None or not greedy:
        return {}
    plain = next((m for m in methods if m.name == "ar"), None) or next(m for m in methods if m.name == REFERENCE)
    reference = [plain.run(ids, max_new_tokens=max_new_tokens, temperature=0.0, seed=0).tokens for ids in greedy]
    return {spec.name: tune_spec(spec, greedy, reference, max_new_tokens=max_new_tokens)}


def _run_methods(cfg: BenchConfig, models: Models, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                 methods: list[BenchMethod], unavailable: dict[str, str]) -> dict[str, Any]:
    for name, reason in unavailable.items():
        log.warning("%s unavailable: %s", name, reason)
    tuning = _tune_servers(methods, prompts, prompt_ids, cfg.max_new_tokens)

    for method in methods:  # warm-up: first calls pay for lazy init, allocation, calibration
        method.run(prompt_ids[0], max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens), temperature=0.0,
                   seed=cfg.seed)

    # runs[method][repeat][prompt]; methods interleaved per prompt so drifting load hits them alike
    runs: dict[str, list[list[MethodRun]]] = {m.name: [[] for _ in range(cfg.repeats)] for m in methods}
    bar = tqdm(total=cfg.repeats * len(methods) * len(prompts), desc="bench decode", disable=not cfg.progress,
               dynamic_ncols=True)
    with frozen_heap():  # the loaded models out of full GC passes (a 175 ms stall each, in any method's run)
        for repeat in range(cfg.repeats):
            for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
                for method in methods:
                    bar.set_postfix(method=method.name, repeat=repeat + 1)
                    time.sleep(SETTLE_S)
                    runs[method.name][repeat].append(method.run(ids, max_new_tokens=cfg.max_new_tokens,
                                                                temperature=prompt.temperature,
                                                                seed=cfg.seed + 1000 * repeat + i))
                    bar.update(1)
    bar.close()

    results = [asdict(r) for r in summarize(runs, prompts)]
    names = [m.name for m in methods]
    report = {
        "config": asdict(cfg),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": cfg.threads,
                    "device": _device_name(cfg.device),
                    "processor": platform.processor() or platform.machine(), "llama_cpp_python": llama_cpp_version(),
                    "llama_server": _llama_server_version(methods),
                    "load_avg_1_5_15m": [round(x, 2) for x in os.getloadavg()]},
        "prompts": len(prompts),
        "prompt_kinds": sorted({p.kind for p in prompts}),
        "results": results,
        "unavailable": [{"method": name, "reason": reason} for name, reason in unavailable.items()],
        "divergences": divergences(runs, prompts, prompt_ids, models.target),
        "costs": measure_costs(methods),
        "bandwidth": measure_bandwidth(cfg, models, results) if cfg.measure_bandwidth and "ar" in names else None,
        "peer_configs": {m.name: m.config for m in methods if isinstance(m, LlamaServerMethod)},
        "peer_tuning": tuning,
    }
    return report


def measure_bandwidth(cfg: BenchConfig, models: Models, results: Sequence[dict]) -> dict | None:
    """The memory-bandwidth ceiling on plain decoding (`specops.bench.bandwidth`): the read
    bandwidth of ``cfg.device`` at the benchmark's thread count over the bytes of the target's
    weights a T = 1 forward reads, and ar's row as a share of it. None where the buffer cannot be
    allocated (said in the log)."""
    from specops.bench.bandwidth import bandwidth_ceiling, read_bandwidth, streamed_weight_bytes

    if not isinstance(models.target, torch.nn.Module):
        return None
    try:
        measured = read_bandwidth(threads=cfg.threads, device=cfg.device)
    except (RuntimeError, MemoryError) as exc:  # out of memory for the buffer
        log.warning("memory bandwidth not measured: %s", exc)
        return None
    return bandwidth_ceiling(measured, streamed_weight_bytes(models.target), results)


def _llama_server_version(methods: Sequence[BenchMethod]) -> str | None:
    if not any(isinstance(m, LlamaServerMethod) for m in methods):
        return None
    from specops.bench.llamacpp_build import binary_version, find_binary

    path = find_binary("llama-server")
    return binary_version(path) if path else None


COST_SIZES = (1, 2, 4, 8)  # verify widths T whose cost c(T)/c(1) the report prints
COST_PREFIX = 256  # cached positions under the timed forwards (a mid-request decode step)


def measure_costs(methods: Sequence[BenchMethod]) -> dict | None:
    """Our target's verify cost c(T)/c(1) after a 256-token prefix, and one draft-model token
    relative to one target T = 1 forward (fastest of several timings; None without our methods).
    The target is timed as greedy decoding verifies: one C call per block on the fast runner
    (`measure_verify_cost(one_call=True)`, ``verify_how``), else `forward`.
    A draft token is timed as decoding drafts it (`auto.draft_token_s`: per token of a C chain
    of 4 on the fast fp32 CPU runner, else one forward and argmax)."""
    decoder = next((m.decoder for m in methods if isinstance(m, DecoderMethod)), None)
    if decoder is None:
        return None
    from specops.spec.auto import draft_token_cost
    from specops.spec.tree_size import measure_verify_cost

    target = decoder.target
    prefix = min(COST_PREFIX, target.max_context - COST_SIZES[-1])
    with torch.inference_mode():
        curve = measure_verify_cost(target, sizes=COST_SIZES, prefix_len=prefix, repeats=15, one_call=True)
        draft_s, draft_how = draft_token_cost(decoder.draft) if decoder.draft is not None else (None, None)
    out = {
        "prefix": prefix,
        "target_token_s": curve.at(1),
        "verify_relative": {str(t): round(curve.relative(t), 3) for t in COST_SIZES},
        "verify_how": curve.how,
        "draft_token_s": draft_s,
        "draft_token_relative": None if draft_s is None else round(draft_s / curve.at(1), 3),
        "draft_token_how": draft_how,
    }
    model = getattr(target, "model", None)
    weight = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:  # the C kernel's case
        floor = multiply_add_floor(model, COST_SIZES[-1])
        if floor is not None:
            out["multiply_add"] = {**floor, "floor_relative": round(floor["floor_s"] / curve.at(1), 3)}
    return out


def multiply_add_rate(threads: int | None = None, rows: int = 8, k: int = 256, sizes: tuple[int, int] = (256, 768),
                      calls: int = 20, repeats: int = 15) -> float | None:
    """Multiply-adds per second of the C linear kernel (`cpu_linear`) at ``rows`` rows of x, on
    fp32 weights small enough to stay in cache (two output sizes ``sizes`` over ``k`` inputs; the
    rate is the difference of their fastest timings, so the fixed cost of a call drops out). A
    forward's matrices, whose weights also stream from memory, cannot multiply faster than
    this. None where the kernel is not built."""
    from specops.kernels import cpu_linear

    if not cpu_linear.available():
        return None
    threads = threads or torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    best = []
    for n in sizes:
        w = cpu_linear.pack(torch.randn(n, k, generator=gen))
        x, y = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
        fastest = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                cpu_linear.unchecked(x, w, None, None, y, None, 1e-6, False, threads)
            fastest = min(fastest, (time.perf_counter() - t0) / calls)
        best.append(fastest)
    spent = best[1] - best[0]
    return rows * k * (sizes[1] - sizes[0]) / spent if spent > 0 else None


def multiply_add_floor(model: torch.nn.Module, rows: int) -> dict | None:
    """The least time ``rows`` positions' matrices can take at the measured rate
    (`multiply_add_rate`): ``rows`` x the multiply-adds of every linear layer a position passes
    (the weights of the model's `nn.Linear`s, the tied LM head included), attention and
    norms left out. Beside c(1), it bounds c(rows)/c(1) from below for the C kernel at the
    rate measured then (on shared cores the rate moves: 15-37 G/s on one 2-core host in one
    session). A one-position forward is bound by streaming the weights; a several-position
    one also by multiplying them, which this floor isolates."""
    threads = torch.get_num_threads()
    rate = multiply_add_rate(threads, rows=rows)
    if rate is None:
        return None
    macs = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return {"rate_per_s": rate, "macs_per_position": macs, "rows": rows, "floor_s": rows * macs / rate,
            "threads": threads}


def _acceptance(rs: Sequence[MethodRun]) -> float | None:
    drafted = [r.drafted for r in rs]
    if any(d is None for d in drafted) or not sum(drafted):
        return None
    return sum(r.accepted or 0 for r in rs) / sum(drafted)


def summarize(runs: dict[str, list[list[MethodRun]]], prompts: Sequence[BenchPrompt]) -> list[MethodResult]:
    """Turn raw runs into table rows (see the module docstring for the definitions)."""
    greedy = [i for i, p in enumerate(prompts) if p.temperature == 0]
    reference = runs.get(REFERENCE)
    ref_tps = None
    results = []
    for name, rounds in runs.items():
        tps_runs = [sum(len(r.tokens) for r in rs) / max(sum(r.seconds for r in rs), 1e-9) for rs in rounds]
        tps = statistics.median(tps_runs)
        if name == REFERENCE:
            ref_tps = tps
        flat = [r for rs in rounds for r in rs]
        new_tokens = sum(len(r.tokens) for r in flat)
        exact_match, exact_prompts = None, "0/0"
        if reference is not None and greedy:
            same = sum(all(rounds[k][i].tokens == reference[0][i].tokens for k in range(len(rounds))) for i in greedy)
            exact_match, exact_prompts = same == len(greedy), f"{same}/{len(greedy)}"
        width = max((len(r.drafted_per_pos) for r in flat), default=0)
        drafted_pos = [sum(r.drafted_per_pos[j] for r in flat if j < len(r.drafted_per_pos)) for j in range(width)]
        accepted_pos = [sum(r.accepted_per_pos[j] for r in flat if j < len(r.accepted_per_pos)) for j in range(width)]
        by_kind = {}
        for kind in sorted({p.kind for p in prompts}):
            idx = [i for i, p in enumerate(prompts) if p.kind == kind]
            rs = [rounds[k][i] for k in range(len(rounds)) for i in idx]
            by_kind[kind] = {
                "tokens_per_s": round(sum(len(r.tokens) for r in rs) / max(sum(r.seconds for r in rs), 1e-9), 2),
                "acceptance_rate": _round(_acceptance(rs)),
                "mean_accepted_len": round(sum(len(r.tokens) for r in rs) / max(1, sum(r.target_forwards for r in rs)), 3),
            }
        results.append(MethodResult(
            method=name, tokens_per_s=round(tps, 2), speedup=None, speedup_vs_ar=None, speedup_vs_ar_chain=None,
            acceptance_rate=_round(_acceptance(flat)),
            mean_accepted_len=round(new_tokens / max(1, sum(r.target_forwards for r in flat)), 3),
            exact_match=exact_match, exact_prompts=exact_prompts, new_tokens=new_tokens,
            tokens_per_s_runs=[round(t, 2) for t in tps_runs],
            acceptance_by_pos=[round(a / d, 4) if d else 0.0 for a, d in zip(accepted_pos, drafted_pos)],
            by_kind=by_kind, prefill_share=_prefill_share(flat), decode_tokens_per_s=_decode_tps(rounds),
        ))
    ar_tps = next((r.tokens_per_s for r in results if r.method == "ar"), None)
    chain_tps = next((r.tokens_per_s for r in results if r.method == "ar-chain"), None)
    for r in results:
        r.speedup = round(r.tokens_per_s / ref_tps, 3) if ref_tps else None
        r.speedup_vs_ar = round(r.tokens_per_s / ar_tps, 3) if ar_tps else None
        r.speedup_vs_ar_chain = round(r.tokens_per_s / chain_tps, 3) if chain_tps else None
    return results


def _decode_tps(rounds: Sequence[Sequence[MethodRun]]) -> float | None:
    """Median over rounds of new tokens per second after the prompt passes (decode only), where
    every run exposes its prompt pass."""
    if any(r.prefill_s is None for rs in rounds for r in rs):
        return None
    rates = [sum(len(r.tokens) for r in rs) / max(sum(r.seconds - r.prefill_s for r in rs), 1e-9) for rs in rounds]
    return round(statistics.median(rates), 2) if rates else None


def _prefill_share(runs: Sequence[MethodRun]) -> float | None:
    """The prompt passes' share of the runs' seconds, where every run exposes it."""
    if not runs or any(r.prefill_s is None for r in runs):
        return None
    total = sum(r.seconds for r in runs)
    return round(sum(r.prefill_s for r in runs) / total, 4) if total > 0 else None


def _round(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


@torch.no_grad()
def divergences(runs: dict[str, list[list[MethodRun]]], prompts: Sequence[BenchPrompt],
                prompt_ids: Sequence[Sequence[int]], target) -> list[dict]:
    """Where each method's greedy output first differs from ``hf-greedy`` (first round),
    with the target's top-2 logit gap at that position (computed by one full forward
    over the prompt + the shared prefix, in the target's dtype)."""
    reference = runs.get(REFERENCE)
    if reference is None:
        return []
    found = []
    for name, rounds in runs.items():
        if name == REFERENCE:
            continue
        for i, prompt in enumerate(prompts):
            if prompt.temperature != 0:
                continue
            ours, ref = rounds[0][i].tokens, reference[0][i].tokens
            pos = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            if pos is None:
                if len(ours) == len(ref):
                    continue
                pos = min(len(ours), len(ref))
            ids = torch.tensor([list(prompt_ids[i]) + ref[:pos]], dtype=torch.long, device=target.device)  # [1, P+pos]
            logits = target(input_ids=ids, use_cache=False).logits[0, -1].float()  # [V]
            top = torch.topk(logits, 2).values
            found.append({"method": name, "prompt": i, "position": pos, "top2_gap": round(float(top[0] - top[1]), 5),
                          "ours": ours[pos] if pos < len(ours) else None, "reference": ref[pos] if pos < len(ref) else None})
    return found


def format_table(report: dict) -> str:
    """A fixed-width text table of the report's results."""
    chained = any(r.get("speedup_vs_ar_chain") is not None for r in report["results"])
    head = (f"{'method':<24} {'tok/s':>8} {'decode':>8} {'vs hf-greedy':>12} {'vs ar':>7}"
            + (f" {'vs ar-chain':>11}" if chained else "") + f" {'accept':>7} {'tok/fwd':>8} {'exact':>7}")
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        spd = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        vs_ar = "-" if r.get("speedup_vs_ar") is None else f"{r['speedup_vs_ar']:.2f}x"
        vs_chain = "-" if r.get("speedup_vs_ar_chain") is None else f"{r['speedup_vs_ar_chain']:.2f}x"
        exact = "-" if r["exact_match"] is None else ("yes" if r["exact_match"] else f"{r['exact_prompts']}")
        dec = "-" if r.get("decode_tokens_per_s") is None else f"{r['decode_tokens_per_s']:.1f}"
        lines.append(f"{r['method']:<24} {r['tokens_per_s']:>8.1f} {dec:>8} {spd:>12} {vs_ar:>7}"
                     + (f" {vs_chain:>11}" if chained else "") + f" {acc:>7} {r['mean_accepted_len']:>8.2f} {exact:>7}")
    for row in report.get("unavailable") or []:
        lines.append(f"{row['method']:<24} unavailable: {row['reason']}")
    for name, config in (report.get("peer_configs") or {}).items():
        lines.append(f"{name}: llama-server {config}")
    costs = report.get("costs")
    if costs:
        curve = " ".join(f"c({t})/c(1)={rel:.2f}" for t, rel in costs["verify_relative"].items())
        how = f" ({costs['verify_how']})" if costs.get("verify_how") else ""
        line = f"target T=1 forward {costs['target_token_s'] * 1e3:.2f} ms{how}; verify cost {curve}"
        if costs.get("draft_token_relative") is not None:
            line += (f"; one draft token = {costs['draft_token_relative']:.3f} of a target T=1 forward"
                     f" ({costs.get('draft_token_how') or 'forward'})")
        lines.append(line)
        mad = costs.get("multiply_add")
        if mad:
            lines.append(f"the target's matrices at T={mad['rows']} need {mad['rows'] * mad['macs_per_position'] / 1e6:.3g}M"
                         f" multiply-adds: at the C kernel's rate on weights in cache ({mad['rate_per_s'] / 1e9:.1f} G/s,"
                         f" {mad['threads']} threads) at least {mad['floor_s'] * 1e3:.2f} ms, so"
                         f" c({mad['rows']})/c(1) >= {mad['floor_relative']:.2f} before attention")
    ar = next((r for r in report["results"] if r["method"] == "ar"), None)
    if ar is not None and ar.get("prefill_share"):
        share = ar["prefill_share"]
        bound = " / ".join(f"{1 / (share + (1 - share) / n):.2f}" for n in (2, 3))
        lines.append(f"ar's prompt passes: {100 * share:.0f}% of its time, which speculation does not shorten "
                     f"(decoding after the prompt 2x / 3x as fast reads {bound}x ar)")
    if report.get("bandwidth"):
        from specops.bench.bandwidth import format_bandwidth

        lines.append(format_bandwidth(report["bandwidth"]))
    device = (report.get("machine") or {}).get("device", "cpu")
    if device != "cpu":
        lines.append(f"models on {device}")
    div = report.get("divergences") or []
    if div:
        gaps = sorted(d["top2_gap"] for d in div)
        lines.append(f"divergences from hf-greedy: {len(div)} (median top-2 logit gap {statistics.median(gaps):.4f})")
    return "\n".join(lines)
