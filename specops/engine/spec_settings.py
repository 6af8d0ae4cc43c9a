"""Which speculation one request may use: the one settings type on the way to the engine.

`PolicyRuntime.resolve` builds it from the policy class's live settings (the store's
`EffectiveSettings`), the in-process path hands it to `Decoder.generate`, and the serving
engine takes it as it is (`Engine.add`). Torch-free, so the policy runtime can build it
without loading the decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("ar", "draft", "ngram", "medusa", "eagle", "auto")
DEFAULT_TREE_SIZE = 16
"""A tree's node bound when ``tree_size`` is None."""
MAX_EAGLE_TOPK = 32
"""The widest EAGLE-2 expansion (`specops.spec.eagle_tree.MAX_TOPK`)."""


@dataclass(slots=True)
class SpecSettings:
    """Which speculation a request may use; the engine picks the amount per step within it."""

    method: str = "ar"
    """"ar" | "draft" | "ngram" | "medusa" | "eagle" | "auto" (the engine picks one of the loaded
    speculative methods at admission from live results, and weighs prompt lookup against a chain
    drafter before every step: `specops.engine.auto_method`)."""
    gamma: int = 4
    """Upper bound on drafted tokens per step (draft, ngram, eagle; an EAGLE-2 tree's levels);
    0 = plain decoding."""
    medusa_heads: int | None = None
    """Medusa heads to use (None: all loaded)."""
    tree_size: int | None = None
    """Upper bound on tree nodes, root included (None: `DEFAULT_TREE_SIZE`): a Medusa tree's (a
    prompt-lookup branch's nodes count against it) and an EAGLE-2 tree's (``eagle_topk``)."""
    eagle_topk: int | None = None
    """Eagle, greedy requests: draft EAGLE-2's dynamic tree (`specops.spec.eagle_tree`) instead
    of a chain, expanding this many nodes per level and drafting this many children of each, at
    most ``gamma`` levels deep and ``tree_size`` nodes (`eagle_tree`); None: the chain. Sampled
    requests keep the chain (its rejection sampling is lossless), other methods ignore it."""
    lookup_branch: int | None = None
    """Medusa, greedy requests: the usual length of the prompt-lookup branch a step adds to its tree
    where the context's last three tokens occurred before (`specops.spec.medusa_branch`; longer
    after a match that runs back further); None: the library's `medusa_branch.LOOKUP_BRANCH`; 0:
    the heads' tree alone. Exact either way."""
    typical: bool = False
    """Medusa, sampled requests: LOSSY typical acceptance (`tree_verify.verify_tree_typical`)
    instead of exact rejection sampling; the output is no longer distributed as the target's.
    Greedy requests and other methods ignore it (greedy verification is exact already)."""
    deadline_s: float | None = None
    """Decode deadline in seconds from `Engine.add`; past it plain decoding (tokens kept)."""
    auto_key: str | None = None
    """Which requests share ``method="auto"``'s estimates (the server passes the request
    class; greedy and sampled requests are kept apart on top of it)."""
    observed: bool = False
    """This request's speculation is being measured (a canary revision's request, or a fallen-back
    class's probe): it speculates as set (``gamma`` drafted tokens, or a tree of ``tree_size``
    nodes, whenever its proposal has them), neither shrunk by the load-aware plan nor stopped by the
    batch-wide veto (`PlanSchedule.veto_steps`), so the canary analysis and the fallback read the setting
    under test. Planned by the engine instead, a bad setting was mostly declined: the analysis saw too
    few drafted tokens and came out inconclusive (`make demo` on a slow host, every run), and a
    fallen-back class's probes could not show it had recovered."""

    def check(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= 32:
            raise ValueError(f"gamma must be an integer in 0..32, got {g!r}")
        for name in ("medusa_heads", "tree_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64):
                raise ValueError(f"{name} must be an integer in 1..64 or None, got {v!r}")
        k = self.eagle_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_EAGLE_TOPK):
            raise ValueError(f"eagle_topk must be an integer in 1..{MAX_EAGLE_TOPK} or None, got {k!r}")
        b = self.lookup_branch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 64):
            raise ValueError(f"lookup_branch must be an integer in 0..64 or None, got {b!r}")
        if not isinstance(self.typical, bool):
            raise ValueError(f"typical must be a bool, got {self.typical!r}")
        d = self.deadline_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0 or math.isinf(d)):
            raise ValueError(f"deadline_s must be a finite number of seconds > 0 or None, got {d!r}")
        if not isinstance(self.observed, bool):
            raise ValueError(f"observed must be a bool, got {self.observed!r}")

    def eagle_tree(self) -> tuple[int, int, int] | None:
        """The EAGLE-2 tree a greedy request of these settings drafts, as (depth, topk, tree_size)
        (`specops.spec.eagle_tree.EagleTree`), or None for the chain: ``gamma`` levels, ``eagle_topk``
        wide, ``tree_size`` nodes cut to what such a tree drafts (``topk`` children of the root,
        ``topk * topk`` per level below). None too when the settings leave no drafts: ``gamma`` 0, or
        a ``tree_size`` of 1 (the root alone)."""
        k, depth = self.eagle_topk, self.gamma
        if self.method != "eagle" or k is None or depth < 1:
            return None
        size = min(DEFAULT_TREE_SIZE if self.tree_size is None else self.tree_size, 1 + k + (depth - 1) * k * k)
        return (depth, k, size) if size >= 2 else None
