"""A batched, paged forward for Llama-family models, over `FastLlamaRunner`'s fused weights.

Where `FastLlamaRunner` runs one sequence on a contiguous cache, `PagedLlama` runs a
*ragged batch*: B sequences, each with its own number of new tokens, its own cached
prefix and its own attention pattern among the new tokens (causal, or a Medusa tree).
Its KV storage is one tensor of ``num_blocks * block_size`` token slots per layer; which
slots a sequence owns is the caller's business (`specops.engine.kv_pool`).

One forward:

1. the N new tokens of all sequences are flattened: every linear layer (fused q/k/v,
   o, gate/up, down, LM head) runs once over ``[N, E]``, so batching pays where the
   weights are read;
2. rotary embeddings use each token's own position id (prefix length + depth for
   tree nodes);
3. each token's key/value goes to its slot (``write_slots``) before attention;
4. attention runs per *group* of sequences (the caller groups them so padding stays
   small: short decode/verify blocks together, a long prefill alone): it pads the
   group's queries to ``[G, Tq]`` and gathers each sequence's keys/values from its slots
   into ``[G, Lk]``; a bool mask ``[G, 1, Tq, Lk]`` says which keys each query sees
   (prefix, then causal or tree); padded rows see slot 0 and are dropped. On CPU in
   fp32, a group whose mask is "each query sees a prefix of its keys" (plain decoding,
   chain drafts; ``visible`` set, up to ``KERNEL_MAX_TQ`` queries per sequence) skips
   the gather: `specops.kernels.cpu_paged` reads the keys and values in place. On CUDA
   with Triton (``gpu_kernel``), every group of up to ``GPU_KERNEL_MAX_TQ`` queries per
   sequence, trees included (``visible`` plus the tree's mask), runs
   `specops.kernels.paged_attention`, which does the same on the GPU;
5. logits are computed only for the rows the caller asks for (``logit_rows``).

On fp32 CPU with the C kernels built (the runner's ``c_layers``), a batch of any size
(decoding steps, drafts, trees of up to 64 nodes, prefills) skips all of the above:
`forward_ragged` runs the whole layer stack, the final norm and the LM head in one C call (`cpu_linear.paged_layers`), which
reads every sequence's keys through its block table and writes each token's key/value to
its slot; no attention groups, no padding, no mask tensors, ~1/3 of a plain step's Python
and dispatch overhead gone. Prefills included: since the weight panels its linear kernel
runs at about oneDNN's multiply-add rate at prompt sizes, and it skips the LM head of rows
nobody reads (in-process batch-16 serving of the bench prompts: 1.07-1.28x the tokens/s of
sending batches over 128 tokens to the oneDNN path). It makes the same kernel calls as the
runner's single-sequence forward, so each sequence's logits equal `FastLlamaRunner.forward`'s bit for bit.

Compaction of an accepted tree path is `copy_slots` (one gather + one scatter over all
layers). Results equal `FastLlamaRunner.forward` up to float rounding (different matmul
row counts and SDPA's masked path round differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specops.kernels import cpu_linear, cpu_paged
from specops.kernels.paged_attention import paged_attention as paged_attention_kernel
from specops.kernels.paged_attention import triton_available


@dataclass
class AttnGroup:
    """Sequences whose attention runs as one padded SDPA call."""

    q_index: Tensor  # [G, Tq] long: flat index of sequence g's t-th new token (padding: 0)
    kv_slots: Tensor  # [G, Lk] long: cache slots of sequence g's keys, prefix then new (padding: 0)
    mask: Tensor | None  # [G, 1, Tq, Lk] bool: query t of sequence g may see key j (None: ``visible`` says it)
    padded_rows: Tensor  # [n_g] long: rows of the padded [G * Tq] output that are real tokens
    flat_rows: Tensor  # [n_g] long: the flat token index of each of those rows
    # [G, Tq] long: query t sees keys [0, visible) (0: padding), set for a kernel group (`kernel_group`); a tree
    # group on the GPU kernel has its mask too, which further restricts them
    visible: Tensor | None = None


@dataclass
class PagedBatch:
    """The flattened inputs of one ragged forward (see the module docstring)."""

    input_ids: Tensor  # [N] long: new tokens of all sequences, sequence by sequence
    positions: Tensor  # [N] long: rotary position of each token
    write_slots: Tensor  # [N] long: cache slot each token's key/value goes to
    groups: list[AttnGroup]  # attention groups; together they cover every flat token once
    logit_rows: Tensor  # [R] long: flat tokens whose logits (and hidden states) are returned

    def check(self) -> None:
        n = self.input_ids.shape[0]
        for name, t in (("positions", self.positions), ("write_slots", self.write_slots)):
            if tuple(t.shape) != (n,):
                raise ValueError(f"PagedBatch.{name} must be [{n}], got {list(t.shape)}")
        covered = 0
        for g in self.groups:
            b, tq = g.q_index.shape
            lk = g.kv_slots.shape[1]
            if g.mask is None and (g.visible is None or tuple(g.visible.shape) != (b, tq)):
                raise ValueError("an attention group needs a mask, or visible key counts [G, Tq]")
            mask_ok = g.mask is None or (tuple(g.mask.shape) == (b, 1, tq, lk) and g.mask.dtype == torch.bool)
            if g.kv_slots.shape[0] != b or not mask_ok:
                raise ValueError(f"attention group shapes disagree: q {list(g.q_index.shape)}, "
                                 f"kv {list(g.kv_slots.shape)}, mask "
                                 f"{None if g.mask is None else (list(g.mask.shape), g.mask.dtype)}")
            covered += g.flat_rows.shape[0]
        if covered != n:
            raise ValueError(f"attention groups cover {covered} tokens, the batch has {n}")


def kv_bytes_per_token(runner) -> int:
    """Bytes of KV cache one token slot takes in every layer of a `FastLlamaRunner`."""
    elem = torch.empty((), dtype=runner.dtype).element_size()
    return len(runner.layers) * 2 * runner.n_kv_heads * runner.head_dim * elem


KERNEL_MAX_TQ = 16  # queries per sequence up to which the CPU kernel runs (longer prefills: SDPA)
GPU_KERNEL_MAX_TQ = 64  # the same for the Triton kernel on CUDA (one program per query: prefills stay on SDPA)


class PagedLlama:
    """Ragged batched forwards over a `FastLlamaRunner`'s weights and a paged KV store."""

    def __init__(self, runner, num_blocks: int, block_size: int) -> None:
        self.r = runner
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots = num_blocks * block_size
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self.hidden_size = runner.hidden_size
        # [NL, 2, S, Hkv, D]: every layer's keys and values, slot-major
        self.store = torch.zeros(len(runner.layers), 2, self.slots, runner.n_kv_heads, runner.head_dim,
                                 dtype=runner.dtype, device=runner.device)
        # the in-place CPU kernel for fp32 on CPU when it builds here; otherwise SDPA over gathered KV
        self.cpu_kernel = self.device.type == "cpu" and runner.dtype == torch.float32 and cpu_paged.available()
        # on CUDA: the Triton paged-attention kernel (any supported dtype; trees too)
        self.gpu_kernel = self.device.type == "cuda" and triton_available()
        self._half_bytes = self.slots * runner.n_kv_heads * runner.head_dim * self.store.element_size()  # one [S, Hkv, D]
        # a batch runs the whole layer stack in one C call (`forward_ragged`) where the runner's
        # single-sequence forward does (fp32 CPU, SwiGLU layers on the C kernels)
        self.c_layers = bool(getattr(runner, "c_layers", False))
        halves = [(self.store[i, 0], self.store[i, 1]) for i in range(len(runner.layers))]  # [S, Hkv, D] each
        self._c_table = runner.c_layer_table(halves) if self.c_layers else None

    def kernel_group(self, tq: int, tree: bool) -> bool:
        """Whether a group of ``tq`` queries per sequence runs on a paged-attention kernel (the
        CPU one takes prefix-shaped masks only; the GPU one trees too, with their mask)."""
        if self.gpu_kernel:
            return tq <= GPU_KERNEL_MAX_TQ
        return self.cpu_kernel and not tree and tq <= KERNEL_MAX_TQ

    def _rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [N] -> 2 x [N, Hq+2Hkv, D]
        r = self.r
        if r._cos_heads is not None:  # index_select: cheaper than advanced indexing on CPU
            return r._cos_heads.index_select(0, positions), r._sin_heads.index_select(0, positions)
        return r._per_head(r._cos[positions][None])[0], r._per_head(r._sin[positions][None], sin=True)[0]

    def forward(self, batch: PagedBatch, need_hidden: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logits [R, V] float32 (and hidden states [R, E] after the final norm) at ``logit_rows``."""
        batch.check()
        r = self.r
        hq, hkv, d, e = r.n_heads, r.n_kv_heads, r.head_dim, r.hidden_size
        n = batch.input_ids.shape[0]
        half = d // 2
        gqa = hq != hkv
        width = hq + 2 * hkv
        # kernel groups (``visible`` set): on CPU, index tensors converted once for all layers (q rows are
        # qkv's, stride width * d; layer i's keys and values are the contiguous [S, Hkv, D] halves of
        # store[i]); on CUDA the Triton kernel, a tree's mask as [G, Tq, Lk] bytes
        kernel = [g.visible is not None for g in batch.groups]
        on_gpu = self.gpu_kernel
        if any(g.mask is None for g in batch.groups) and not on_gpu and not (
                self.store.dtype == torch.float32 and self.store.device.type == "cpu"):
            raise ValueError("an attention group without a mask needs a paged-attention kernel (fp32 on CPU, or CUDA)")
        store_ptr = self.store.data_ptr()
        calls = [cpu_paged.PreparedCall(g.q_index, g.visible, g.kv_slots, n=n, hq=hq, hkv=hkv, d=d, q_stride=width * d,
                                        scale=r.scale) if k and not on_gpu else None
                 for g, k in zip(batch.groups, kernel)]
        masks = [g.mask[:, 0].to(torch.uint8).contiguous() if k and on_gpu and g.mask is not None else None
                 for g, k in zip(batch.groups, kernel)]
        with torch.inference_mode():
            cos, sin = self._rotary(batch.positions)  # [N, H', D] each
            x = F.embedding(batch.input_ids, r.embed)  # [N, E]
            for i, layer in enumerate(r.layers):
                qkv = layer.qkv.normed(x, layer.ln1, r.eps).view(n, width, d)  # [N, H', D]
                qkv = torch.addcmul(qkv * cos, qkv.roll(half, -1), sin)  # rotary on q and k
                kv_new = qkv[:, hq:].view(n, 2, hkv, d).transpose(0, 1)  # [2, N, Hkv, D]
                store = self.store[i]  # [2, S, Hkv, D]
                store.index_copy_(1, batch.write_slots, kv_new)
                q_all = qkv[:, :hq]  # [N, Hq, D]
                o = x.new_empty(n, hq * d) if (len(batch.groups) > 1 or kernel[0]) else None
                for g, call, on_kernel, mask in zip(batch.groups, calls, kernel, masks):
                    if call is not None:  # prefix-shaped masks: keys and values read in place
                        k_ptr = store_ptr + (2 * i) * self._half_bytes
                        call(qkv.data_ptr(), k_ptr, k_ptr + self._half_bytes, o)
                        continue
                    if on_kernel:  # CUDA: the Triton kernel reads keys and values in place
                        paged_attention_kernel(q_all, store[0], store[1], g.q_index, g.visible, g.kv_slots, o,
                                               r.scale, mask=mask, impl="triton")
                        continue
                    b, tq = g.q_index.shape
                    # index_select, not advanced indexing: ~5x faster on CPU for this gather
                    kv = store.index_select(1, g.kv_slots.reshape(-1)).view(2, b, -1, hkv, d)  # [2, G, Lk, Hkv, D]
                    k = kv[0].transpose(1, 2)  # [G, Hkv, Lk, D]
                    v = kv[1].transpose(1, 2)  # [G, Hkv, Lk, D]
                    q = q_all.index_select(0, g.q_index.reshape(-1)).view(b, tq, hq, d).transpose(1, 2)  # [G, Hq, Tq, D]
                    og = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=r.scale, enable_gqa=gqa)
                    og = og.transpose(1, 2).reshape(b * tq, hq * d)  # [G*Tq, Hq*D]
                    if og.shape[0] != g.padded_rows.shape[0]:  # drop padded rows
                        og = og.index_select(0, g.padded_rows)  # [n_g, Hq*D]
                    if o is None:
                        o = og  # a single group lists every sequence in flat order
                    else:
                        o.index_copy_(0, g.flat_rows, og)
                x = layer.o.add_to(x, o)  # [N, E]
                x = r._mlp(layer, x, r.eps)  # [N, E]: the fast runner's MLP block, residual added
            rows = x.index_select(0, batch.logit_rows)  # [R, E]
            rows = F.rms_norm(rows, (e,), r.norm, r.eps)  # [R, E]
            logits = r.lm_head(rows)  # [R, V]
            if logits.dtype != torch.float32:
                logits = logits.float()
        return logits, (rows if need_hidden else None)

    def forward_ragged(self, input_ids: Tensor, batch: cpu_linear.RaggedBatch, logit_rows: Tensor,
                       need_hidden: bool = False, head_rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """`forward` in one C call (`cpu_linear.paged_layers`; ``c_layers`` must be set):
        ``input_ids`` [N] flat, ``batch`` says which sequence, cache slots and attention pattern
        each token has. Each sequence's logits equal the fast runner's single-sequence
        forward bit for bit (the same kernel calls). Returns logits [R, V] and hidden [R, E].

        ``head_rows`` [R'] (indices into ``logit_rows``): only those rows get logits ([R', V]),
        the others their hidden states alone (an EAGLE sequence's prompt pass needs every
        position's hidden state and one row's logits); the LM head then runs after the call, the
        same kernel on the same normed rows."""
        r = self.r
        if not self.c_layers:
            raise ValueError("forward_ragged needs the runner's C layer stack (fp32 CPU, SwiGLU, kernels built)")
        n = input_ids.shape[0]
        if batch.tables.size and (int(batch.tables.min()) < 0 or int(batch.tables.max()) >= self.num_blocks):
            raise ValueError(f"a block table names a block outside 0..{self.num_blocks - 1}")
        if logit_rows.numel() and (int(logit_rows.min()) < 0 or int(logit_rows.max()) >= n):
            raise ValueError(f"logit rows must lie in 0..{n - 1}")
        with torch.inference_mode():
            x = cpu_linear.embedding(input_ids, r.embed)  # [N, E] (torch's OpenMP team left asleep)
            hidden, logits = cpu_linear.paged_layers(
                self._c_table, x, batch, logit_rows, heads=r.n_heads, kv_heads=r.n_kv_heads, head_dim=r.head_dim,
                intermediate=r.layers[0].down.weight.shape[1], eps=r.eps, scale=r.scale, cos=r._cos, sin=r._sin,
                norm=r.norm, head=r.lm_head.weight, head_bias=r.lm_head.bias,
                logits=head_rows is None)  # [R, E], [R, V] | None
            if head_rows is not None:  # [R', V]
                logits = cpu_linear.unchecked(hidden[head_rows].contiguous(), r.lm_head.weight, r.lm_head.bias,
                                              None, None, None, 0.0, False)
        return logits, (hidden if need_hidden else None)

    def draft_ragged(self, tokens: list[int], batch: cpu_linear.RaggedBatch, gammas: list[int],
                     clock_id: int | None = None, *, uniforms: Any = None, inv_temps: Any = None,
                     q_out: Tensor | None = None) -> tuple[list[list[int]], list[float] | None]:
        """Drafting in one C call (`cpu_linear.paged_draft`; ``c_layers`` must be set):
        ``batch``'s first, start and tables say what each sequence feeds in round 0; then
        ``gammas[s]`` tokens per sequence, each fed back but the last: argmax tokens, equal to a
        loop of `forward_ragged` rounds and argmaxes, or, for the sequences ``inv_temps`` marks,
        draws from softmax(logits * inv_temp) with their ``uniforms``, q rows into ``q_out``.
        A call that samples nothing ranks the runner's draft vocabulary alone where it has one
        (`FastLlamaRunner.draft_head`), as the runner's own greedy chains do: its argmaxes are
        then over those rows of the logits (on the bundled draft, 1,024 of 4,096 rows)."""
        r = self.r
        if not self.c_layers:
            raise ValueError("draft_ragged needs the runner's C layer stack (fp32 CPU, SwiGLU, kernels built)")
        if batch.tables.size and (int(batch.tables.min()) < 0 or int(batch.tables.max()) >= self.num_blocks):
            raise ValueError(f"a block table names a block outside 0..{self.num_blocks - 1}")
        head, bias, head_ids = r.lm_head.weight, r.lm_head.bias, None
        shortlist = getattr(r, "draft_head", None)
        if inv_temps is None and shortlist is not None:  # greedy: the draft vocabulary's rows
            head, bias, head_ids = shortlist
        with torch.inference_mode():
            return cpu_linear.paged_draft(
                self._c_table, r.embed, tokens, batch.first, batch.start, gammas, batch.tables, batch.block_size,
                heads=r.n_heads, kv_heads=r.n_kv_heads, head_dim=r.head_dim,
                intermediate=r.layers[0].down.weight.shape[1], eps=r.eps, scale=r.scale, cos=r._cos, sin=r._sin,
                norm=r.norm, head=head, head_bias=bias, clock_id=clock_id,
                uniforms=uniforms, inv_temps=inv_temps, q_out=q_out, head_ids=head_ids)

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:  # src, dst: [n] long slot ids
        """Move the entries of slots ``src`` to slots ``dst`` in every layer (gathered first)."""
        with torch.inference_mode():
            moved = self.store.index_select(2, src)  # [NL, 2, n, Hkv, D]
            self.store.index_copy_(2, dst, moved)
