"""``specops bench serve``'s configuration: the modes, a cell's request count, the options' parsing,
the config object and one request's result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODES = ("off", "fixed", "adaptive")
TWIN = "off-twin"
"""``--twin``: a second server measured as ``off``. Two identical server processes differed by
5-10% at 16 streams in one run (1.01-1.21x per repeat), and the mode ratios are
taken between processes; ``off-twin / off`` prints that spread beside them. With
``--one-server`` it is a fourth mode of the one server, set like ``off``: ``off-twin / off``
is then how far two cells of the same thing differ in one process (the cells' own noise)."""
# Fewest requests in a cell by default (and 8 per unit of concurrency). At concurrency 1,
# 8 requests are ~1 s of traffic: the same cell's repeats varied 309-524 tok/s, and a
# ratio of two such medians was noise; 24 still varied ±15% between repeats.
MIN_CELL_REQUESTS = 48
REQUESTS_PER_SLOT = 8
# From concurrency 2 on, also up to BATCHED_CELL_REQUESTS (32 per slot below that): 48 requests at
# concurrency 4 were a 5-6 s cell on the bundled models (c1's 48 took ~14 s, c16's 128 ~11 s), the
# shortest of a run, and its repeats spread the most (adaptive / off at c4 0.98-1.18x in one run).
BATCHED_CELL_REQUESTS = 128


def cell_requests(concurrency: int) -> int:
    """A cell's requests by default (``--num-prompts`` unset): at concurrency 1, 4 and 16 on the
    bundled models 48, 128 and 128, each ~10-15 s of traffic."""
    batched = min(32 * concurrency, BATCHED_CELL_REQUESTS) if concurrency > 1 else 0
    return max(MIN_CELL_REQUESTS, REQUESTS_PER_SLOT * concurrency, batched)


MIX_KINDS = ("code", "prose", "hot")
DEFAULT_MIX = "code:0.5,prose:0.3,hot:0.2"
"""``--mix``'s default weights (`parse_mix`)."""
MIX_SUITE = "mix"
CHAT_SUITE = "chat"
SUITES = (MIX_SUITE, CHAT_SUITE)
"""``--suite``: ``mix``, the bundled code / prose suites as ``/v1/completions`` text in the ``--mix``
weights (or a ``--prompts`` file); ``chat``, the chat-model suites' conversations (multi-turn chat,
code, factual Q&A, creative at temperature 0.8) as ``/v1/chat/completions`` messages, each labelled
with its class (`specops.bench.serve.prompts.ChatPrompt`)."""


class BenchServeError(RuntimeError):
    """A configuration or server problem (one readable line)."""


@dataclass
class ServeBenchConfig:
    base_url: str | None = None
    redis_url: str | None = None
    namespace: str = "specops"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    num_prompts: int | None = None          # per cell; None: `cell_requests`
    request_rate: float = math.inf
    max_tokens: int = 64
    mix: dict[str, float] = field(default_factory=lambda: parse_mix(DEFAULT_MIX))
    prompts_file: str | None = None
    suite: str = MIX_SUITE                  # SUITES
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    api_key: str | None = None
    seed: int = 0
    warmup: int = 2
    repeats: int = 1                        # runs of every cell; rows are the median run
    controller_interval_s: float = 2.0
    adaptive_warmup_s: float = 45.0         # traffic before measuring (adaptive: controller ticks + alert for_s)
    server_args: list[str] = field(default_factory=list)
    model: str | None = None                # started servers: this target alone (`bench.serve.model`); None: bundled
    twin: bool = False                      # also a second `off` server (TWIN), started servers only
    one_server: bool = False                # started: one server for every mode (see `run_bench_serve`)
    settle_s: float | None = None           # one_server: traffic before each cell (None: the controller's window)
    warm_prefix: bool = False               # replay the same prompt texts in every repeat and in the settle traffic
    progress: bool = True

    @property
    def window_s(self) -> float:
        """The started controller's telemetry window (``--window``)."""
        return max(5.0, 5 * self.controller_interval_s)

    @property
    def settle_seconds(self) -> float:
        return self.window_s if self.settle_s is None else self.settle_s

    @property
    def prompts_label(self) -> str:
        """``warm`` (`warm_prefix`: the cells' prompts replayed, found in the prefix cache) or ``fresh``."""
        return "warm" if self.warm_prefix else "fresh"

    @property
    def all_modes(self) -> list[str]:
        """The measured modes: ``modes`` and, with ``twin``, TWIN."""
        return [*self.modes, TWIN] if self.twin else list(self.modes)


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    observed: bool = False  # a canary's or a fallback probe's: speculating as set, the planner's veto aside
    fallen_back: bool = False  # decoded plainly because its class is fallen back
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_mix(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.strip().partition(":")
        if not sep or name not in MIX_KINDS:
            raise ValueError(f"--mix wants KIND:WEIGHT with KIND in {', '.join(MIX_KINDS)}, got {part!r}")
        try:
            out[name] = float(weight)
        except ValueError:
            raise ValueError(f"--mix weight of {name} is not a number: {weight!r}") from None
        if out[name] < 0:
            raise ValueError(f"--mix weight of {name} must be >= 0")
    if not out or sum(out.values()) <= 0:
        raise ValueError("--mix needs a positive total weight")
    return out


def parse_slo(text: str) -> tuple[float | None, float | None]:
    ttft = tpot = None
    for part in text.split(","):
        name, sep, ms = part.strip().partition(":")
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(f"--slo wants ttft:MS,tpot:MS, got {part!r}")
        try:
            value = float(ms) / 1000.0
        except ValueError:
            raise ValueError(f"--slo {name} is not a number of milliseconds: {ms!r}") from None
        if value <= 0:
            raise ValueError(f"--slo {name} must be > 0 ms")
        ttft, tpot = (value, tpot) if name == "ttft" else (ttft, value)
    return ttft, tpot
