"""Decoding steps of one sequence on the batch-1 fast runner's C layer stack, each in one C
call (``specops_medusa_step`` in medusa.c, ``specops_chain_verify`` in verify.c; the library
`linear_lib` loads)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from specops.kernels.cpu_attention import MAX_MASK_NODES, mask_bits
from specops.kernels.cpu_medusa import MedusaWeights
from specops.kernels.linear_lib import _kernel, weight_flags


class _StepLoopArgs(ctypes.Structure):
    """The C struct ``StepLoop`` (steps.h), field for field."""

    _fields_ = [("layers", ctypes.c_void_p), ("n_layers", ctypes.c_int64), ("embed", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n_embed", "E", "Hq", "Hkv", "D", "I")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("cos_tab", ctypes.c_void_p),
        ("sin_tab", ctypes.c_void_p), ("kv_b", ctypes.c_int64), ("kv_h", ctypes.c_int64), ("norm", ctypes.c_void_p),
        ("head_w", ctypes.c_void_p), ("head_b", ctypes.c_void_p), ("V", ctypes.c_int64), ("head_flags", ctypes.c_int64),
        ("root_w", ctypes.c_void_p), ("root_flags", ctypes.c_int64), ("block_w", ctypes.c_void_p),
        ("block_b", ctypes.c_void_p), ("block_flags", ctypes.c_int64), ("K", ctypes.c_int64), ("L", ctypes.c_int64),
        ("lm_w", ctypes.c_void_p), ("lm_b", ctypes.c_void_p), ("lm_flags", ctypes.c_int64), ("F", ctypes.c_int64),
        ("ids", ctypes.c_void_p), ("TK", ctypes.c_int64), ("threads", ctypes.c_int64), ("max_nodes", ctypes.c_int64),
        ("buf", ctypes.c_void_p), ("work", ctypes.c_void_p)]


class StepLoop:
    """Decoding steps of one sequence on the batch-1 fast runner's C layer stack, each in one C
    call, with no Python between their parts (which runs with cold caches after each target
    forward: ~0.5 ms of a ~1.5 ms greedy Medusa step on the bundled models, measured):

    * `medusa_step` (``specops_medusa_step``, with Medusa ``weights``): the tree from the previous
      step's candidates, the layer stack over it, the greedy walk, the accepted path's cache
      entries compacted and the heads' next candidates;
    * `chain_verify` (``specops_chain_verify``): the forward over a pending token and a drafted
      block, and greedy acceptance.

    Every part is the kernel call the step-by-step code makes (`llama_layers`, the walk of
    `verify_tree_greedy`, `KVCache.compact_ascending`, `medusa_candidates`, `accept_greedy`),
    so outputs and cache are the same bit for bit. The target's arguments are those
    `llama_layers` takes; ``weights`` / ``num_heads`` the heads' as `medusa_candidates` (None /
    0: no Medusa steps); ``top_k`` the candidates kept per head (TK); ``max_nodes`` the most
    positions one step feeds. The tensors passed must outlive the loop."""

    def __init__(self, table: ctypes.Array, embed: Tensor, *, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, kv_strides: tuple[int, int],
                 norm: Tensor, head: Tensor, head_bias: Tensor | None, max_nodes: int,
                 weights: MedusaWeights | None = None, num_heads: int = 0, top_k: int = 1,
                 threads: int | None = None) -> None:
        e = embed.shape[1]
        vocab = head.shape[0]
        if not 1 <= max_nodes <= MAX_MASK_NODES:
            raise ValueError(f"StepLoop: max_nodes {max_nodes} not in 1..{MAX_MASK_NODES}")
        if weights is not None:
            f = weights.lm.shape[0]
            if not 1 <= top_k <= f or not 1 <= num_heads <= len(weights.blocks):
                raise ValueError(f"StepLoop: top_k {top_k} (1..{f}), num_heads {num_heads} (1..{len(weights.blocks)})")
        if embed.dtype != torch.float32 or not embed.is_contiguous():
            raise ValueError("StepLoop: the embedding must be contiguous fp32")
        per_node = 2 * e + vocab + 2 * head_dim + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate
        self._buf = torch.empty(max_nodes * per_node, dtype=torch.float32)
        self._work = torch.empty(6 * max_nodes, dtype=torch.int64)
        k = num_heads if weights is not None else 0
        self.cands = torch.zeros(max(k, 1) * top_k, dtype=torch.int64)  # [K * TK] the next tree's candidates
        self.result = torch.zeros(max_nodes + 2, dtype=torch.int64)  # [P, next, accepted tokens...]
        self._heads_s = ctypes.c_double(0.0)
        self._tokens = (ctypes.c_int64 * max_nodes)()
        self._pair = (ctypes.c_int64 * 2)()
        self._nodes = ctypes.c_int64(0)
        self._keep = (table, embed, cos, sin, norm, head, head_bias, weights)
        self.top_k, self.max_nodes, self.num_heads, self.hidden_size = top_k, max_nodes, k, e
        m = _StepLoopArgs()
        m.layers, m.n_layers, m.embed = ctypes.addressof(table), len(table), embed.data_ptr()
        m.n_embed, m.E, m.Hq, m.Hkv, m.D, m.I = embed.shape[0], e, heads, kv_heads, head_dim, intermediate
        m.eps, m.scale = float(eps), float(scale)
        m.cos_tab, m.sin_tab = cos.data_ptr(), sin.data_ptr()
        m.kv_b, m.kv_h = kv_strides
        m.norm, m.head_w = norm.data_ptr(), head.data_ptr()
        m.head_b = None if head_bias is None else head_bias.data_ptr()
        m.V, m.head_flags = vocab, weight_flags(head)
        if weights is not None:
            m.root_w = None if weights.root is None else weights.root.data_ptr()
            m.root_flags = 0 if weights.root is None else weight_flags(weights.root)
            m.block_w, m.block_b = ctypes.addressof(weights._w), ctypes.addressof(weights._b)
            m.block_flags, m.K, m.L = weight_flags(weights.blocks[0][0][0]), k, len(weights.blocks[0])
            m.lm_w = weights.lm.data_ptr()
            m.lm_b = None if weights.lm_bias is None else weights.lm_bias.data_ptr()
            m.lm_flags, m.F = weight_flags(weights.lm), weights.lm.shape[0]
            m.ids = None if weights.ids is None else weights.ids.data_ptr()
        m.TK, m.threads, m.max_nodes = top_k, int(threads or torch.get_num_threads()), max_nodes
        m.buf, m.work = self._buf.data_ptr(), self._work.data_ptr()
        self._args = m
        self._medusa = _kernel.lib.specops_medusa_step
        self._chain = _kernel.lib.specops_chain_verify
        self._ptrs = (ctypes.addressof(m), self.cands.data_ptr(), self.result.data_ptr(), ctypes.addressof(self._heads_s),
                      ctypes.addressof(self._tokens), ctypes.addressof(self._pair), ctypes.addressof(self._nodes))

    def medusa_step(self, start: int, tree: Tensor, root: int, branch: list[int] | None = None) -> tuple[float, int]:
        """One Medusa step after ``start`` cached positions over the tree ``tree`` ([4, N]
        int64: see `medusa_tree_words`) rooted at ``root``, with ``branch`` (drafted tokens after
        the root, e.g. a prompt-lookup match) merged into it as into a trie, as far as
        ``max_nodes`` allows; `result` then holds [P, next, the P - 1 accepted tokens] and
        `cands` the next candidates. Returns the seconds the heads took and the nodes the step
        fed (N plus the branch's new ones). The cache gains the P path entries at
        start..start+P-1 (the caller sets its length)."""
        if self.num_heads == 0:
            raise ValueError("StepLoop: built without Medusa heads")
        args, cands, result, heads_s = self._ptrs[:4]
        m = 0
        if branch:
            m = min(len(branch), self.max_nodes)
            self._tokens[:m] = branch[:m]
        rc = self._medusa(args, start, tree.shape[1], tree.data_ptr(), root, cands, result, heads_s,
                          self._ptrs[4] if m else None, m, self._ptrs[6])
        if rc == 3:
            raise ValueError("StepLoop: a token id or the tree size out of range")
        if rc != 0:
            raise MemoryError(f"CPU Medusa step failed (code {rc})")
        return self._heads_s.value, self._nodes.value

    def chain_verify(self, start: int, tokens: list[int]) -> tuple[int, int]:
        """The forward over ``tokens`` (the pending token, then the drafted ones) after ``start``
        cached positions and greedy acceptance: (drafted tokens accepted, next token). The
        cache gains the len(tokens) entries (the caller sets its length and cuts it back)."""
        t = len(tokens)
        if not 1 <= t <= self.max_nodes:
            raise ValueError(f"StepLoop: {t} tokens to verify, at most {self.max_nodes}")
        args, ids, pair = self._ptrs[0], self._ptrs[4], self._ptrs[5]
        self._tokens[:t] = tokens
        rc = self._chain(args, start, t, ids, pair)
        if rc == 3:
            raise ValueError("StepLoop: a token id out of range")
        if rc != 0:
            raise MemoryError(f"CPU verification step failed (code {rc})")
        return self._pair[0], self._pair[1]

    def hidden(self, tokens: int, row: int) -> Tensor:
        """A copy of the normed hidden state [E] of row ``row`` of the last step, which fed
        ``tokens`` positions (`chain_verify`'s tokens, `medusa_step`'s tree nodes)."""
        e = self.hidden_size
        return self._buf[(tokens + row) * e : (tokens + row + 1) * e].clone()

    def path_node(self, i: int) -> int:
        """The tree node at place ``i`` of the last `medusa_step`'s accepted path (0: the root)."""
        return int(self._work[2 * self.max_nodes + i])


def medusa_tree_words(src: list[int], depth: list[int], parent: list[int], mask: Tensor) -> Tensor:
    """A tree as `StepLoop.medusa_step` reads it: [4, N] int64 rows src (index of each node's
    token in the K x TK candidates; the root's unused), depth, parent (-1 for the root) and the
    ancestor mask's words (`mask_bits`)."""
    words = mask_bits(mask)
    return torch.stack([torch.tensor(src, dtype=torch.int64), torch.tensor(depth, dtype=torch.int64),
                        torch.tensor(parent, dtype=torch.int64), words]).contiguous()
