"""Verifying a whole candidate tree from one target forward: greedy and lossless sampling.

The target has scored every tree node in one pass, so row ``i`` of its output is the
target's distribution for the token *after* node ``i``. Verification walks down from
the root: at the current node it decides which child (if any) the target accepts,
moves there, and repeats; when no child is accepted it emits one more token from
the current node's distribution. Terms as in `specops.spec.verify`:

accepted path
    root, then every accepted node, in order. The root is the token the target itself
    chose in the previous step, so it is always accepted.
recovered / bonus token
    the token emitted after the last accepted node: the target's argmax (greedy), a
    sample of the residual distribution left after rejecting every child (sampling),
    or a plain sample when the node is a leaf.

Greedy: a child is accepted when its token equals the target's argmax at its parent;
siblings carry distinct tokens, so at most one child can match (Medusa, Cai et al.
2024, arXiv 2401.10774).

Sampling: *recursive rejection sampling* over the siblings (SpecInfer, Miao et al.
2024, arXiv 2305.09781; multi-draft speculative sampling, Sun et al. 2023, arXiv
2310.15141). With the residual ``r`` initialised to the target's distribution ``p``
at the current node, child ``c`` (token ``x_c``, drafted from ``q_c``) is accepted with
probability ``min(1, r(x_c) / q_c(x_c))``; on rejection ``r <- norm(max(0, r - q_c))``
and the next sibling is tried; when all are rejected the recovered token is drawn
from ``r``. By induction over the siblings the emitted token is distributed exactly
as ``p`` (Leviathan et al. 2023, arXiv 2211.17192, Theorem 1 applied per sibling), so
the whole generation is distributed as sampling the target alone. Medusa's top-k
candidates are deterministic: ``q_c = one_hot(x_c)``.

Typical acceptance (Medusa §3.3) is available only as an explicitly *lossy* mode: it
accepts any candidate the target finds plausible enough, which changes the output
distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specops.spec.sampling import SamplingConfig, draw, probabilities
from specops.spec.tree import TreeBuffers
from specops.kernels import cpu_linear


@dataclass(frozen=True)
class TreeVerification:
    """Outcome of verifying one tree."""

    path: list[int]  # accepted node indices, root (0) first
    next_token: int  # recovered or bonus token following the last accepted node


def _check(tokens: Tensor, scores: Tensor, buffers: TreeBuffers, name: str) -> None:
    n = buffers.num_nodes
    if tokens.shape != (n,):
        raise ValueError(f"tree tokens must be [N] = [{n}], got {tuple(tokens.shape)}")
    if scores.dim() != 2 or scores.shape[0] != n:
        raise ValueError(f"{name} must be [N, V] = [{n}, V], got {tuple(scores.shape)}")


def verify_tree_greedy(
    tokens: Tensor,  # [N] long: node tokens, root first
    logits: Tensor,  # [N, V] target logits at every node
    buffers: TreeBuffers,
    choice: list[int] | None = None,  # [N] the logits' row argmax when the forward computed it (`RunnerOutput.argmax`)
) -> TreeVerification:
    """Longest path whose every token equals the target's argmax at its parent."""
    _check(tokens, logits, buffers, "logits")
    if choice is None:
        choice = cpu_linear.argmax(logits).tolist()  # [N]
    elif len(choice) != buffers.num_nodes:
        raise ValueError(f"choice must hold one argmax per node ({buffers.num_nodes}), got {len(choice)}")
    toks = tokens.tolist()
    path, node = [0], 0
    while True:
        nxt = next((c for c in buffers.children[node] if toks[c] == choice[node]), None)
        if nxt is None:
            return TreeVerification(path=path, next_token=choice[node])
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tokens: Tensor,  # [N] long
    target_probs: Tensor,  # [N, V] filtered target distribution after every node
    buffers: TreeBuffers,
    generator: torch.Generator,
    draft_probs: Tensor | None = None,  # [N, V] q of each node's token (row 0 unused); None = point masses
) -> TreeVerification:
    """Lossless recursive rejection sampling down the tree (see the module docstring).

    Random numbers come from ``generator`` in a fixed order (at each node one uniform per
    child, drawn together on the generator's device, then one categorical draw), so a
    seeded request is reproducible.
    """
    _check(tokens, target_probs, buffers, "target_probs")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must be [N, V] = {tuple(target_probs.shape)}, got {tuple(draft_probs.shape)}")
    toks = tokens.tolist()
    path, node = [0], 0
    while True:
        residual = target_probs[node].double()  # [V]
        accepted = None
        children = buffers.children[node]
        # one uniform per sibling, drawn together on the generator's device (one sync, not one per child)
        uniforms = torch.rand(len(children), generator=generator, dtype=torch.float64,
                              device=generator.device).tolist() if children else []
        for child, u in zip(children, uniforms):
            x = toks[child]
            q_x = 1.0 if draft_probs is None else float(draft_probs[child, x])
            if u * q_x < float(residual[x]):
                accepted = child
                break
            if draft_probs is None:
                residual = residual.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(residual - draft_probs[child].double(), min=0.0)
            mass = float(residual.sum())
            if mass <= 0.0:  # r == q up to rounding: rejection had probability ~0
                residual = target_probs[node].double()
            else:
                residual = residual / mass
        if accepted is None:
            token = int(draw(residual.float()[None], generator)[0])
            return TreeVerification(path=path, next_token=token)
        path.append(accepted)
        node = accepted


@dataclass(frozen=True)
class TypicalAcceptance:
    """LOSSY: accept a candidate when p(x) > min(threshold, alpha * exp(-H(p))) (Medusa §3.3).

    The output is no longer distributed as the target's; use only where the caller
    has explicitly asked for speed over exactness.
    """

    threshold: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0 or not 0.0 < self.alpha:
            raise ValueError(f"typical acceptance needs 0 < threshold <= 1 and alpha > 0, got {self}")


def verify_tree_typical(
    tokens: Tensor,  # [N] long
    target_probs: Tensor,  # [N, V]
    buffers: TreeBuffers,
    generator: torch.Generator,
    rule: TypicalAcceptance,
) -> TreeVerification:
    """LOSSY typical acceptance: follow the most probable plausible child at each node."""
    _check(tokens, target_probs, buffers, "target_probs")
    toks = tokens.tolist()
    path, node = [0], 0
    while True:
        p = target_probs[node]  # [V]
        entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
        floor = min(rule.threshold, rule.alpha * math.exp(-entropy))
        plausible = [(float(p[toks[c]]), c) for c in buffers.children[node] if float(p[toks[c]]) > floor]
        if not plausible:
            token = int(draw(p[None], generator)[0])
            return TreeVerification(path=path, next_token=token)
        node = max(plausible)[1]
        path.append(node)


def judge_tree(
    tokens: Tensor,  # [N] long: node tokens, root first
    logits: Tensor,  # [N, V] target logits at every node
    buffers: TreeBuffers,
    sampling: SamplingConfig,
    generator: torch.Generator,
    typical: TypicalAcceptance | None = None,
    choice: list[int] | None = None,  # [N] the logits' row argmax, where the forward computed it
) -> TreeVerification:
    """The one acceptance rule of a tree step, for `Decoder.generate` and the serving engine alike:
    greedy walks the argmax (`verify_tree_greedy`); sampled walks by recursive rejection sampling
    over the target's filtered distribution (`verify_tree_sampling`, lossless), or by ``typical``
    acceptance where the request asked for that LOSSY rule (`verify_tree_typical`)."""
    if sampling.greedy:
        return verify_tree_greedy(tokens, logits, buffers, choice)
    probs = probabilities(logits, sampling)  # [N, V]
    if typical is None:
        return verify_tree_sampling(tokens, probs, buffers, generator)
    return verify_tree_typical(tokens, probs, buffers, generator, typical)
