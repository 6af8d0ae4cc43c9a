"""Asynchronous draft pipeline: the draft drafts block k+1 while the target verifies block k.

The synchronous loop (`draft.generate_draft`) alternates: draft γ tokens, verify them,
draft again. Here the draft model runs in its own thread (with its own torch intra-op
thread count) and, while the target verifies block ``k = [d_1 .. d_G]``, drafts
optimistically as if block k were fully accepted: it feeds ``d_G`` and samples
``e_1 .. e_{G'+1}`` (``e_1`` is its guess for the target's bonus token). After the
verification:

* all of block k accepted and the target's next token equals ``e_1``: the proposals
  ``e_2 .. e_{G'+1}`` were drafted from exactly the sequence now held, so they are the
  next block, with no draft time on the critical path;
* otherwise (partial acceptance, or a different bonus token) the optimistic block is
  dropped, the draft cache is cut back to the accepted prefix, and the draft restarts
  from the corrected token (a synchronous draft, as in the synchronous pipeline).

This is the "post-verify" half of PEARL (Liu et al., parallel speculative decoding with
adaptive draft length, ICLR 2025), restricted so that losslessness is unchanged:
every verified block was drafted from q conditioned on the sequence it is verified
against, and is verified by the same rejection rule (`TargetVerifier.verify`), so
greedy output equals plain greedy decoding and sampled output is distributed as the
target. The draft samples with its own generator (seeded from the request's), and it
does a fixed amount of work per verification, so seeded runs are reproducible.

Timing: ``stats.draft_s`` counts only draft time on the critical path (synchronous
restarts and waits for the optimistic block); draft forwards run in the thread are
all counted in ``stats.draft_forwards``, used or dropped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specops.spec.draft import _draft_block, check_vocab
from specops.spec.errors import InvalidRequestError
from specops.models.runner import ModelRunner, prompt_forward
from specops.spec.sampling import SamplingConfig
from specops.spec.schedule import ConstantSchedule, GammaSchedule
from specops.spec.clock import device_clock
from specops.spec.request import prompt_list
from specops.spec.speculation import DRAFT_CONTEXT, TargetVerifier, draft_room
from specops.spec.stats import DecodeStats

PIPELINES = ("sync", "async")


def check_pipeline(pipeline: object, draft_threads: object, threads_given: bool = False) -> None:
    """Raise `InvalidRequestError` for an unknown pipeline or a bad draft thread count
    (``threads_given``: the caller set ``draft_threads``, which only the async pipeline uses)."""
    if pipeline not in PIPELINES:
        raise InvalidRequestError(f"pipeline must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
    if isinstance(draft_threads, bool) or not isinstance(draft_threads, int) or draft_threads < 1:
        raise InvalidRequestError(f"draft_threads must be an integer >= 1, got {draft_threads!r}")
    if threads_given and pipeline != "async":
        raise InvalidRequestError("draft_threads applies only to pipeline='async'")


class _DraftWorker:
    """One thread that owns the draft runner while a block is drafted ahead."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specops-draft",
                                        initializer=self._init_thread)
        self._ready = threading.Event()

    def _init_thread(self) -> None:
        torch.set_num_threads(self._threads)  # intra-op threads of this (draft) thread only
        self._ready.set()

    def submit(self, fn, *args):
        return self._pool.submit(self._run, fn, *args)

    @staticmethod
    def _run(fn, *args):
        with torch.inference_mode():
            return fn(*args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _draft_after(
    draft: ModelRunner,
    sequence: list[int],
    count: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[list[int], torch.Tensor | None]:  # drafted tokens, q: [1, count, V] (sampling only)
    """``count`` draft tokens after ``sequence``; the draft cache is first cut to a prefix of it.

    The caller guarantees the draft cache holds a prefix of ``sequence`` up to its
    length or beyond (entries past ``len(sequence) - 1`` are dropped)."""
    draft.truncate(min(draft.cache_len, len(sequence) - 1))
    return _draft_block(draft, sequence, count, sampling, generator)


def generate_draft_async(
    target: ModelRunner,
    draft: ModelRunner,
    prompt_ids: torch.Tensor,  # [B, T] long, B == 1
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    schedule: GammaSchedule | None = None,
    deadline_s: float | None = None,
    draft_threads: int = 1,
) -> tuple[list[int], DecodeStats]:
    """Draft-model speculation with the draft drafting ahead in its own thread (module docstring)."""
    check_vocab(target, draft)
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_pipeline("async", draft_threads)
    schedule = schedule if schedule is not None else ConstantSchedule(4)
    prompt = prompt_list(prompt_ids)
    stats = DecodeStats(method="draft")
    stats.start()
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    draft_gen = torch.Generator(device=target.device).manual_seed(seed)  # the draft thread's own randomness
    v = TargetVerifier(target, prompt, sampling=sampling, generator=generator, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s)
    v.prefill()
    draft.reset(1)
    if len(prompt) > 1 and draft_room(draft.max_context, len(prompt)):  # else it never drafts (below)
        t0 = device_clock(draft.device)
        prompt_forward(draft, torch.tensor([prompt[:-1]], dtype=torch.long, device=draft.device), logits=False)
        dt = device_clock(draft.device) - t0
        stats.draft_forwards += 1
        stats.draft_s += dt
        stats.prefill_s += dt

    worker = _DraftWorker(draft_threads)
    block: list[int] = []
    q: torch.Tensor | None = None  # [1, G, V]
    block_s = 0.0  # critical-path draft seconds of the current block
    try:
        while not v.done:
            stats.gamma = schedule.next_gamma()
            # the block (γ tokens) and the optimistic one after it (γ + 1) must fit the draft's context
            room = max(0, draft_room(draft.max_context, len(v.tokens)) - 1) // 2
            if room == 0 and stats.fallback_reason is None:
                stats.fallback_reason = DRAFT_CONTEXT
            gamma = min(stats.gamma, v.max_draft(), room)
            if gamma == 0:  # budget's last token, past the deadline or the draft's context: a plain target step
                v.verify([], None)
                block, q = [], None
                continue
            if len(block) >= gamma:  # the optimistic block survived: reuse (cut to this γ)
                block = block[:gamma]
                q = None if q is None else q[:, :gamma]
            else:  # restart from the corrected token
                t0 = time.perf_counter()
                block, q = _draft_after(draft, v.tokens, gamma, sampling, draft_gen)
                block_s += time.perf_counter() - t0
                stats.draft_forwards += gamma
            # draft the next block optimistically (block fully accepted) while the target verifies
            ahead_len = gamma + 1
            future = worker.submit(_draft_after, draft, v.tokens + block, ahead_len, sampling, draft_gen)
            verify_before = stats.verify_s
            result = v.verify(block, q)
            t0 = time.perf_counter()
            ahead, q_ahead = future.result()  # the draft runner is free again after this
            block_s += time.perf_counter() - t0
            stats.draft_forwards += ahead_len
            stats.draft_s += block_s
            schedule.update(len(block), result.raw_accepted, block_s, stats.verify_s - verify_before)
            block_s = 0.0
            hit = (not v.done and result.raw_accepted == len(block) and result.emitted[-1] == ahead[0])
            if hit:
                block, q = ahead[1:], (None if q_ahead is None else q_ahead[:, 1:])
            else:
                block, q = [], None
                if not v.done:  # keep only the accepted prefix in the draft cache
                    draft.truncate(min(draft.cache_len, len(v.tokens) - 1))
    finally:
        worker.close()
    stats.finish(v.stop_reason())
    return v.output, stats
