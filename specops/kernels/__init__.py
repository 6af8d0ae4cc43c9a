"""specops.kernels: tree attention and KV compaction, each a Triton kernel beside a
plain PyTorch reference (CUDA tensors use Triton, CPU tensors the reference).

- ``tree_attention(q, k, v, tree_mask, scale=None, impl="auto")``: q [B, Hq, T, D],
  k/v [B, Hkv, L+T, D], tree_mask [T, T] bool -> [B, Hq, T, D].
- ``kv_compact(k_cache, v_cache, start, keep, impl="auto")``: caches [B, Hkv, Lmax, D],
  row start+keep[i] -> start+i, in place.
- ``paged_attention(q, k_store, v_store, q_index, visible, kv_slots, out, scale, mask=None,
  impl="auto")``: a ragged batch's attention read in place from a paged KV store (the
  serving engine's GPU path; `specops.kernels.paged_attention`).
"""

from specops.kernels._triton_compat import patch_interpreter_index
from specops.kernels.kv_compact import kv_compact, kv_compact_reference
from specops.kernels.paged_attention import paged_attention, paged_attention_reference
from specops.kernels.tree_attention import MAX_TREE_NODES, tree_attention, tree_attention_reference

__all__ = ["MAX_TREE_NODES", "kv_compact", "kv_compact_reference", "paged_attention", "paged_attention_reference",
           "tree_attention", "tree_attention_reference"]

# Triton <= 3.6's interpreter fails loops with runtime bounds under NumPy >= 2.4 (see
# _triton_compat); patched here, before any launch, for whichever kernel module is imported.
patch_interpreter_index()
