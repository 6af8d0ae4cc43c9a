"""The prompts ``specops bench serve`` sends: drawn from the mix, tagged fresh per batch, and counted
per class of the server's policy."""

from __future__ import annotations

import functools
import random
import secrets
from typing import Any

from specops.bench.serve.config import MIX_KINDS, ServeBenchConfig


@functools.lru_cache(maxsize=8)
def _suite_pools(seed: int) -> dict[str, list[tuple[str, float]]]:
    """The bundled suites' prompts by mix kind (parsed once: each cell draws from them)."""
    from specops.bench.suites import HOT_TEMPERATURE, builtin_suite

    return {"code": [(p.text, 0.0) for p in builtin_suite("code", seed=seed)],
            "prose": [(p.text, 0.0) for p in builtin_suite("prose", seed=seed)],
            "hot": [(p.text, HOT_TEMPERATURE) for p in builtin_suite("code", seed=seed + 1)]}


def build_prompts(cfg: ServeBenchConfig, count: int) -> list[tuple[str, float]]:
    """``count`` (prompt, temperature) pairs drawn from the mix (the same list for every mode)."""
    from specops.bench.suites import load_prompts_file

    rng = random.Random(cfg.seed)
    if cfg.prompts_file:
        pool = [(p.text, p.temperature) for p in load_prompts_file(cfg.prompts_file)]
        return [pool[i % len(pool)] for i in range(count)]
    pools = _suite_pools(cfg.seed)
    kinds = [k for k in MIX_KINDS if cfg.mix.get(k, 0) > 0]
    weights = [cfg.mix[k] for k in kinds]
    return [rng.choice(pools[rng.choices(kinds, weights)[0]]) for _ in range(count)]


class PromptTags:
    """What makes each batch of traffic fresh: unless ``warm`` (``--warm-prefix``), every measured
    cell and every batch of unmeasured traffic (warm-up, settle) gets its own first line,
    ``#SERIAL-RUN`` (SERIAL counts the batches, RUN is random per bench run, so a running server's
    cache holds nothing from an earlier run). A server's prefix cache chains each block's key to
    the blocks before it, so prompts whose first block differs share no cached block: a cell finds
    none of its prompts from another repeat, mode or settle batch there, only repeats of a prompt
    within itself (the mix draws with replacement). The tag is a Python comment line; class rules
    that look at a prompt's start (``prefix``, ``^`` regexes) see it, the built-in mix's classes
    are the same with and without it. ``warm``: batches go out as drawn, the same texts each
    repeat (and settle traffic replays the cell's own prompts), so those figures are of a warm
    prefix cache."""

    def __init__(self, warm: bool, run: str | None = None) -> None:
        self.warm = warm
        self.run = run if run is not None else secrets.token_hex(3)
        self.serial = 0

    def tag(self, serial: int) -> str:
        return f"#{serial}-{self.run}\n"

    def fresh(self, prompts: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """``prompts`` as the next batch sends them: behind a tag no batch had before (as they are when warm)."""
        if self.warm:
            return list(prompts)
        self.serial += 1
        tag = self.tag(self.serial)
        return [(tag + text, temperature) for text, temperature in prompts]

    def example(self, prompts: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """``prompts`` as a batch would send them, without using up a tag (to classify them)."""
        return list(prompts) if self.warm else [(self.tag(0) + text, t) for text, t in prompts]


def mix_classes(policy: Any, cfg: ServeBenchConfig, counts: dict[int, int],
                tags: PromptTags | None = None) -> dict[str, dict[str, int]]:
    """How each concurrency's cell of prompts splits into ``policy``'s classes, per class in policy
    order (as `specops policy classify` counts them: the requests carry no labels or turn, and
    length rules see the prompt's characters / ``CHARS_PER_TOKEN``), the prompts as ``tags``
    sends them (default: as drawn)."""
    from specops.policies.cli_classify import Sample, classify

    tags = tags or PromptTags(warm=True)
    out: dict[str, dict[str, int]] = {}
    for c, n in counts.items():
        names = [classify(policy, Sample(text, temperature, {})).request_class
                 for text, temperature in tags.example(build_prompts(cfg, n))]
        out[str(c)] = {rc.name: names.count(rc.name) for rc in policy.classes}
    return out
