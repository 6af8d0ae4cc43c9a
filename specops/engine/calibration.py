"""Startup calibration of the serving engine's cost models.

`calibrate` times batched forwards of the target (verify: t = 1, 3, 5 new tokens) and of the
draft model (one drafting round: t = 1, 2) at the batch sizes the engine can run, on scratch
blocks, so the planner starts from measured costs; it keeps learning from real steps after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specops.engine.batch_forward import FeedItem, SeqKV
from specops.engine.kv_pool import BlockPool
from specops.engine.proposers import CLOCK_IDS
from specops.engine.spec_planner import CostModel

CALIBRATION_PREFIX = 32
"""Cached tokens before the timed positions of a calibration forward."""
CALIBRATION_FORWARDS = 6
"""Timed forwards per (B, t) shape; the cost model drops each shape's first (its one-time
costs) and the median of the rest seeds the point (fewer let one noisy reading bend the
startup curve)."""


def calibrate(engine: Any) -> None:
    """Time batched forwards of B sequences x t new tokens (on scratch blocks) to seed an
    engine's cost models: the target's verify cost (t = 1, 3, 5) and the draft model's round
    (t = 1, 2)."""
    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= engine.max_batch} | {engine.max_batch})
    calibrate_backend(engine.target, engine.pool, engine.cost, sizes, (1, 3, 5), engine.cost_clock)
    if engine.draft is not None:
        calibrate_backend(engine.draft, engine.draft_pool, engine.draft_cost, sizes, (1, 2), engine.cost_clock,
                          drafting=True)


def calibrate_backend(backend: Any, pool: BlockPool, cost: CostModel, sizes: list[int], lengths: tuple[int, ...],
                      clock: Callable[[], float], drafting: bool = False) -> None:
    """Feed ``cost`` with timed forwards of ``backend`` at each (batch size, new tokens) shape.
    ``drafting``: time the draft model's rounds as `draft_blocks` runs them where it can, one
    round of the backend's C chain (each sequence's last row through the LM head, over the draft
    vocabulary when the runner has one), not a forward with logits for every row, which costs
    several times the round it would stand for."""
    if not getattr(backend, "paged", False):
        return  # the generic path learns its cost from real steps only
    chain, clock_id = (getattr(backend, "draft_chain", None), CLOCK_IDS.get(clock)) if drafting else (None, None)
    # untimed first: the largest shape, then the smallest (the process's first forwards start the
    # kernels' threads and fault in the pool's pages: slower than warm forwards for several calls)
    shapes = [(sizes[-1], lengths[-1], False)] * 2 + [(sizes[0], lengths[0], False)] * 2
    shapes += [(b, t, True) for b in sizes for t in lengths for _ in range(CALIBRATION_FORWARDS)]
    for b, t, timed in shapes:
        kvs = [SeqKV(computed=CALIBRATION_PREFIX) for _ in range(b)]
        if not all(pool.grow(kv.blocks, CALIBRATION_PREFIX + t) for kv in kvs):
            for kv in kvs:
                pool.release(kv.blocks)
            return
        done = None
        if chain is not None and clock_id is not None:
            done = chain([FeedItem(kv=kv, tokens=[0] * t, rows=[t - 1]) for kv in kvs], [1] * b, clock_id)
            if done is not None and timed:
                cost.observe(b, b * t, done[1][0])
        if done is None:
            items = [FeedItem(kv=kv, tokens=[0] * t, rows=list(range(t))) for kv in kvs]
            t0 = clock()
            backend.forward(items)
            if timed:
                cost.observe(b, b * t, clock() - t0)
        for kv in kvs:
            backend.release(kv)
