"""Whole forwards of a Llama-family layer stack on CPU in one C call each (``layers.c``, in
the library `linear_lib` loads): the batch-1 fast runner's stack (`llama_layers`), drafting
loops over it (`llama_draft`), and the same stack over a ragged batch on a block-paged store
(`paged_layers`, `paged_draft`). Each computes bit for bit what the per-call path (`cpu_linear`,
`cpu_attention`) computes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specops.kernels.cpu_attention import _check_mask
from specops.kernels.linear_lib import WEIGHTS_BF16, _kernel


class LayerWeights(ctypes.Structure):
    """One layer's pointers for `llama_layers` (fields as the C struct ``LayerWeights``)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gu_w", "gu_b",
                                                       "down_w", "down_b", "k_cache", "v_cache")] + [
        ("flags", ctypes.c_int64)]


def layer_table(layers: list[dict[str, Tensor | None]]) -> ctypes.Array:
    """The C array of `LayerWeights` for `llama_layers`: one dict per layer with the fields'
    tensors (contiguous fp32 CPU, or the four ``*_w`` matrices all bfloat16; the ``*_w``
    matrices `pack`ed; biases may be None). The tensors must outlive the table."""
    table = (LayerWeights * len(layers))()
    for row, layer in zip(table, layers):
        bf16 = layer["qkv_w"].dtype == torch.bfloat16
        for name, kind in LayerWeights._fields_:
            if kind is not ctypes.c_void_p:
                continue
            tensor = layer.get(name)
            want = torch.bfloat16 if bf16 and name.endswith("_w") else torch.float32
            if tensor is not None and (tensor.dtype != want or tensor.device.type != "cpu"):
                raise ValueError(f"{name} must be a {want} CPU tensor")
            setattr(row, name, None if tensor is None else tensor.data_ptr())
        row.flags = WEIGHTS_BF16 if bf16 else 0
    return table


def llama_layers(table: ctypes.Array, x: Tensor, *, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float, cos: Tensor, sin: Tensor, kv_strides: tuple[int, int], start: int,
                 norm: Tensor, head: Tensor, head_bias: Tensor | None = None, mask: Tensor | None = None,
                 threads: int | None = None, logit_rows: int | None = None,
                 argmax: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer of a Llama-family stack over T new tokens of one sequence, the final norm
    and the LM head in one call (see ``specops_llama_layers`` in layers.c): x [T, E]
    (contiguous) is the residual stream (updated in place). Returns the normed hidden states
    [T, E], the logits [R, V] of the last R = ``logit_rows`` positions (None: all T; a
    prompt pass asks for 1 or 0) and, with ``argmax``, each logit row's `argmax` [R] long
    (computed in the same call), else None. Arguments as `rope_cache_attention`; ``kv_strides`` the
    caches' (sequence, head) strides; ``head`` [V, E], `pack`ed. Unchecked beyond the mask and
    ``logit_rows``: the fast runner calls it with the shapes it built the table for."""
    _check_mask(mask, x.shape[0])
    t, e = x.shape
    rows = t if logit_rows is None else int(logit_rows)
    if not 0 <= rows <= t:
        raise ValueError(f"logit_rows must be in 0..{t}, got {logit_rows}")
    vocab = head.shape[0]
    hidden = torch.empty(t, e, dtype=torch.float32)
    logits = torch.empty(rows, vocab, dtype=torch.float32)
    choice = torch.empty(rows, dtype=torch.int64) if argmax and rows else None
    scratch = torch.empty(t * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    rc = _kernel.lib.specops_llama_layers(table, len(table), x.data_ptr(), t, e, heads, kv_heads, head_dim,
                                          intermediate, float(eps), float(scale), cos.data_ptr(), sin.data_ptr(),
                                          kv_strides[0], kv_strides[1], start,
                                          None if mask is None else mask.data_ptr(), scratch.data_ptr(),
                                          int(threads or torch.get_num_threads()), norm.data_ptr(), head.data_ptr(),
                                          None if head_bias is None else head_bias.data_ptr(), vocab,
                                          hidden.data_ptr(), logits.data_ptr(),
                                          WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, rows,
                                          None if choice is None else choice.data_ptr())
    if rc != 0:
        raise MemoryError(f"CPU layer-stack kernel failed (code {rc})")
    return hidden, logits, choice


def llama_draft(table: ctypes.Array, embed: Tensor, tokens: list[int], count: int, *, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor,
                 kv_strides: tuple[int, int], start: int, norm: Tensor, head: Tensor, head_bias: Tensor | None = None,
                 threads: int | None = None, uniforms: Tensor | None = None,
                 temperature: float = 1.0, head_ids: Tensor | None = None) -> tuple[list[int], Tensor | None]:
    """Drafting in one C call (``specops_llama_draft`` in layers.c): `llama_layers` over
    ``tokens`` after ``start`` cached positions, then ``count - 1`` single-token steps, each
    feeding back the token chosen from the last logits: their argmax, or with ``uniforms``
    ([count] float64 in [0, 1)) a draw from q = softmax(logits / temperature). Returns the
    ``count`` tokens and, when sampling, q [count, V] (else None); the cache gains
    ``len(tokens) + count - 1`` positions (the caller advances its length). ``embed``
    [vocab, E] fp32 contiguous, ``cos`` / ``sin`` the runner's whole [positions, D] tables.
    With ``head_ids`` [F] long (greedy only), ``head`` holds those tokens' rows of the LM head
    (a draft vocabulary, `FastLlamaRunner.set_draft_vocab`) and the argmax row r drafts token
    head_ids[r]. Unchecked beyond the token ids and uniforms: the fast runner calls it with the
    shapes it built the table for and room in its cache."""
    t = len(tokens)
    vocab, e = head.shape[0], embed.shape[1]
    if t < 1 or count < 1:
        raise ValueError(f"llama_draft needs >= 1 token and count >= 1, got {t} tokens, count {count}")
    if head_ids is not None and (uniforms is not None or head_ids.shape != (vocab,) or head_ids.dtype != torch.int64
                                 or not head_ids.is_contiguous()):
        raise ValueError("head_ids must be a contiguous int64 [F] tensor naming the head's rows, for greedy drafting")
    # ids in and tokens out as ctypes arrays, the float buffers as one tensor: this runs between
    # two target forwards, where each small tensor op costs several times its warm time
    limit = embed.shape[0] if head_ids is not None else min(vocab, embed.shape[0])
    if min(tokens) < 0 or max(tokens) >= limit:
        raise ValueError(f"token ids must be in [0, {limit})")
    ids = (ctypes.c_int64 * t)(*tokens)
    q = None
    if uniforms is not None:
        if uniforms.dtype != torch.float64 or uniforms.shape != (count,) or not uniforms.is_contiguous():
            raise ValueError(f"uniforms must be a contiguous float64 tensor of shape ({count},)")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        q = torch.empty(count, vocab, dtype=torch.float32)
    out = (ctypes.c_int64 * count)()

    def part(n: int) -> int:  # floats, rounded up to whole 64-byte lines
        return -(-n // 16) * 16

    sizes = (part(t * e), part(t * e), part(vocab),  # x, hidden, logits, then scratch
             t * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate))
    buf = torch.empty(sum(sizes), dtype=torch.float32)
    x = buf.data_ptr()
    hidden, logits = x + 4 * sizes[0], x + 4 * (sizes[0] + sizes[1])
    scratch = logits + 4 * sizes[2]
    rc = _kernel.lib.specops_llama_draft(table, len(table), embed.data_ptr(), ids, t, count, x,
                                          e, heads, kv_heads, head_dim, intermediate, float(eps), float(scale),
                                          cos.data_ptr(), sin.data_ptr(), kv_strides[0], kv_strides[1], start,
                                          scratch, int(threads or torch.get_num_threads()), norm.data_ptr(),
                                          head.data_ptr(), None if head_bias is None else head_bias.data_ptr(), vocab,
                                          hidden, logits, WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, out,
                                          None if uniforms is None else uniforms.data_ptr(), 1.0 / float(temperature),
                                          None if q is None else q.data_ptr(),
                                          None if head_ids is None else head_ids.data_ptr())
    if rc != 0:
        raise MemoryError(f"CPU drafting kernel failed (code {rc})")
    return list(out), q


@dataclass
class RaggedBatch:
    """Where the flat tokens of a ragged batch belong, for `paged_layers` (numpy, C layouts).

    Sequence s owns flat tokens ``first[s] .. first[s+1]-1``; they follow ``start[s]`` cached
    entries; cache position p of s is slot ``tables[s, p // block_size] * block_size +
    p % block_size``; its new tokens see each other causally, or, where ``masked[s]``, by
    ``words[n]`` (`mask_bits` of its [T, T] tree mask, T <= 64). ``positions[n]`` is token
    n's rotary position (cache position for chains, prefix + depth for tree nodes)."""

    positions: np.ndarray  # [N] int32
    first: np.ndarray  # [S + 1] int64
    start: np.ndarray  # [S] int64
    tables: np.ndarray  # [S, blocks] int32
    block_size: int
    words: np.ndarray  # [N] int64 (uint64 bits)
    masked: np.ndarray  # [S] int8

    def keys(self) -> int:
        """The most keys any token attends to."""
        return int((self.start + np.diff(self.first)).max())


def paged_layers(table: ctypes.Array, x: Tensor, batch: RaggedBatch, rows: Tensor, *, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, norm: Tensor,
                 head: Tensor, head_bias: Tensor | None = None, threads: int | None = None,
                 logits: bool = True) -> tuple[Tensor, Tensor | None]:
    """`llama_layers` over a ragged batch of sequences on a block-paged store (see
    ``specops_paged_layers`` in layers.c): x [N, E] (contiguous fp32, updated in place) holds
    the embeddings of every sequence's new tokens, flat; ``table`` is `layer_table` with each
    layer's k_cache / v_cache its [slots, Hkv, D] half of the store; ``cos`` / ``sin`` the
    runner's [positions, D] rotary tables. Each token's key and value go to its cache slot,
    and its outputs equal the single-sequence stack's bit for bit. Returns the normed hidden
    states [R, E] and logits [R, V] of the flat rows ``rows`` [R] (``logits`` False: None, the LM
    head skipped)."""
    n, e = x.shape
    s = batch.start.shape[0]
    if batch.positions.shape != (n,) or batch.first.shape != (s + 1,) or batch.words.shape != (n,):
        raise ValueError("a ragged batch's positions, first and words disagree with x")
    if int(batch.positions.max(initial=0)) >= cos.shape[0]:
        raise ValueError(f"a rotary position is past the table's {cos.shape[0]}")
    rows = rows.contiguous()
    r = rows.shape[0]
    vocab = head.shape[0]
    hidden = torch.empty(r, e, dtype=torch.float32)
    out = torch.empty(r, vocab, dtype=torch.float32) if logits else None
    scratch = torch.empty(n * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    tables = np.ascontiguousarray(batch.tables, dtype=np.int32)
    arrays = [np.ascontiguousarray(a, dtype=t) for a, t in ((batch.positions, np.int32), (batch.first, np.int64),
                                                            (batch.start, np.int64), (batch.words, np.int64),
                                                            (batch.masked, np.int8))]
    pos, first, start, words, masked = arrays
    rc = _kernel.lib.specops_paged_layers(
        table, len(table), x.data_ptr(), n, e, heads, kv_heads, head_dim, intermediate, float(eps), float(scale),
        cos.data_ptr(), sin.data_ptr(), pos.ctypes.data, s, first.ctypes.data, start.ctypes.data,
        tables.ctypes.data, tables.shape[1], batch.block_size, words.ctypes.data, masked.ctypes.data, batch.keys(),
        scratch.data_ptr(), int(threads or torch.get_num_threads()), norm.data_ptr(),
        head.data_ptr(), None if head_bias is None else head_bias.data_ptr(), vocab,
        rows.data_ptr(), r, hidden.data_ptr(), None if out is None else out.data_ptr(),
        WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0)
    if rc == 3:
        raise ValueError("CPU paged layer-stack kernel refused the batch's shapes")
    if rc != 0:
        raise MemoryError(f"CPU paged layer-stack kernel failed (code {rc})")
    return hidden, out


def paged_draft(table: ctypes.Array, embed: Tensor, tokens: list[int], first: np.ndarray, start: np.ndarray,
                gammas: list[int], tables: np.ndarray, block_size: int, *, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, norm: Tensor, head: Tensor,
                head_bias: Tensor | None = None, threads: int | None = None,
                clock_id: int | None = None, uniforms: np.ndarray | None = None,
                inv_temps: np.ndarray | None = None, q_out: Tensor | None = None,
                head_ids: Tensor | None = None) -> tuple[list[list[int]], list[float] | None]:
    """Drafting of a ragged batch in one call (``specops_paged_draft`` in layers.c):
    round 0 feeds sequence s its ``tokens[first[s]:first[s+1]]`` after ``start[s]`` cached
    ones, each later round one token, the last one chosen, to the sequences still short of
    their ``gammas[s]`` (>= 1) tokens. A token is the argmax, or, for a sequence s with
    ``inv_temps[s] > 0`` ([S] float32: 1 / temperature, 0 = greedy), a draw from q =
    softmax(logits * inv_temps[s]) with the uniform ``uniforms[s, r]`` ([S, G] float64 in
    [0, 1), G = max(gammas)), q written to ``q_out[s, r]`` ([S, G, V] fp32, contiguous; the
    rows of greedy sequences and past each ``gammas[s]`` are left as they were). ``table``,
    ``embed`` [vocab, E], ``tables`` [S, blocks] and the shapes are `paged_layers`' (the draft
    model's). With ``head_ids`` [F] long (greedy only: no ``inv_temps``), ``head`` holds
    those tokens' rows of the LM head (a draft vocabulary, `FastLlamaRunner.set_draft_vocab`)
    and the argmax row r drafts token head_ids[r]. Returns each sequence's tokens and, with
    ``clock_id`` (a ``time.CLOCK_*`` id), each round's seconds on that clock; the same tokens
    and cache as a loop of `paged_layers` rounds and argmaxes, bit for bit."""
    s = len(gammas)
    n0 = len(tokens)
    first = np.ascontiguousarray(first, dtype=np.int64)
    start = np.ascontiguousarray(start, dtype=np.int64)
    tables = np.ascontiguousarray(tables, dtype=np.int32)
    if first.shape != (s + 1,) or start.shape != (s,) or tables.ndim != 2 or tables.shape[0] != s:
        raise ValueError("paged_draft: first, start and tables disagree with gammas")
    if s < 1 or min(gammas) < 1 or np.any(np.diff(first) < 1) or first[0] != 0 or first[-1] != n0:
        raise ValueError("paged_draft: every sequence feeds at least one token and drafts at least one")
    last = start + np.diff(first) + np.asarray(gammas, dtype=np.int64) - 2  # the last position each one feeds
    if int(last.max()) >= cos.shape[0]:
        raise ValueError(f"a rotary position is past the table's {cos.shape[0]}")
    if not embed.is_contiguous() or embed.dtype != torch.float32:
        raise ValueError("embed must be contiguous fp32")
    g = max(gammas)
    m = max(n0, s)
    e = embed.shape[1]
    vocab = head.shape[0]
    if (uniforms is None) != (inv_temps is None) or (inv_temps is None) != (q_out is None):
        raise ValueError("paged_draft: sampling needs uniforms, inv_temps and q_out together")
    if head_ids is not None and (inv_temps is not None or head_ids.shape != (vocab,) or head_ids.dtype != torch.int64
                                 or not head_ids.is_contiguous()):
        raise ValueError("paged_draft: head_ids must be a contiguous int64 [F] tensor naming the head's rows, "
                         "for greedy drafting only")
    if inv_temps is not None:
        uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
        inv_temps = np.ascontiguousarray(inv_temps, dtype=np.float32)
        if uniforms.shape != (s, g) or inv_temps.shape != (s,):
            raise ValueError(f"paged_draft: uniforms must be [{s}, {g}] and inv_temps [{s}]")
        if not (np.all(np.isfinite(inv_temps)) and np.all(inv_temps >= 0)):
            raise ValueError("paged_draft: inv_temps must be finite and >= 0 (0: greedy)")
        if uniforms.size and not (float(uniforms.min()) >= 0.0 and float(uniforms.max()) < 1.0):
            raise ValueError("paged_draft: uniforms must be in [0, 1)")
        if q_out.dtype != torch.float32 or tuple(q_out.shape) != (s, g, vocab) or not q_out.is_contiguous():
            raise ValueError(f"paged_draft: q_out must be a contiguous fp32 tensor of shape ({s}, {g}, {vocab})")
    toks = np.ascontiguousarray(tokens, dtype=np.int64)
    gam = np.ascontiguousarray(gammas, dtype=np.int64)
    out = np.zeros((s, g), dtype=np.int64)
    rounds = np.zeros(g, dtype=np.float64) if clock_id is not None else None
    x = torch.empty(m, e, dtype=torch.float32)
    hidden = torch.empty(s, e, dtype=torch.float32)
    logits = torch.empty(s, vocab, dtype=torch.float32)
    scratch = torch.empty(m * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    rc = _kernel.lib.specops_paged_draft(
        table, len(table), embed.data_ptr(), toks.ctypes.data, s, first.ctypes.data, start.ctypes.data,
        gam.ctypes.data, tables.ctypes.data, tables.shape[1], block_size, e, heads, kv_heads, head_dim, intermediate,
        float(eps), float(scale), cos.data_ptr(), sin.data_ptr(), x.data_ptr(), scratch.data_ptr(),
        int(threads or torch.get_num_threads()), norm.data_ptr(), head.data_ptr(),
        None if head_bias is None else head_bias.data_ptr(), vocab, hidden.data_ptr(), logits.data_ptr(),
        WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, out.ctypes.data, g,
        -1 if clock_id is None else int(clock_id), None if rounds is None else rounds.ctypes.data,
        None if uniforms is None else uniforms.ctypes.data, None if inv_temps is None else inv_temps.ctypes.data,
        None if q_out is None else q_out.data_ptr(), None if head_ids is None else head_ids.data_ptr())
    if rc == 3:
        raise ValueError("CPU paged drafting kernel refused the batch's shapes")
    if rc != 0:
        raise MemoryError(f"CPU paged drafting kernel failed (code {rc})")
    return [out[i, : gammas[i]].tolist() for i in range(s)], None if rounds is None else rounds.tolist()
