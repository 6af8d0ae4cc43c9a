"""The engine's default KV budget, sized from the model and from the memory the machine has.

Without ``--kv-cache-mb`` the budget is the smaller of:

* what the batch can use: ``max_batch`` sequences at the model's full context, twice over
  (the first half lets a full batch reach the context's end without waiting for blocks; the
  second keeps finished prompts' blocks for the prefix cache meanwhile);
* `KV_MEMORY_FRACTION` of the memory available when the engine starts, after the weights are
  loaded: on a GPU the device's free memory; on the CPU the kernel's ``MemAvailable``, capped
  by the container's cgroup limit (what is left below ``memory.max``) where there is one.

The cache is allocated at once, so a budget larger than the machine fails at start (or swaps)
instead of at the first long request; the engine logs which bound it took (`describe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KV_MEMORY_FRACTION = 0.5
"""Share of the available memory the default KV budget may take; the rest is headroom for
activations, the HTTP layer, the prefix cache's growth elsewhere and the operating system."""

MIB = 2**20


def auto_kv_cache_mb(bytes_per_slot: int, max_batch: int, max_context: int,
                     available_bytes: int | None = None) -> float:
    """The default KV budget in MiB: ``max_batch`` sequences at ``max_context`` tokens, twice
    over, capped at `KV_MEMORY_FRACTION` of ``available_bytes`` (None: no cap)."""
    want = 2 * max_batch * max_context * bytes_per_slot / MIB
    if available_bytes is None:
        return want
    return min(want, KV_MEMORY_FRACTION * available_bytes / MIB)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def cgroup_headroom_bytes(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left below this process's cgroup v2 memory limit (None without a limit)."""
    limit, used = _read_int(root / "memory.max"), _read_int(root / "memory.current")
    if limit is None or used is None:
        return None
    return max(0, limit - used)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping (None where unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes(device) -> int | None:
    """Memory the KV cache can come from on ``device`` (a torch.device): the GPU's free memory,
    or the host's available memory within the cgroup's limit; None where it cannot be read."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    found = [b for b in (mem_available_bytes(), cgroup_headroom_bytes()) if b is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class KVBudget:
    """The KV budget an engine chose, and why."""

    mb: float
    want_mb: float  # max_batch sequences at full context, twice over
    available_mb: float | None  # memory available at start (None: unknown, or an explicit budget)
    explicit: bool  # given by the caller (--kv-cache-mb)

    def describe(self, blocks: int, block_size: int) -> str:
        head = f"KV cache {self.mb:.0f} MiB: {blocks} blocks of {block_size} tokens ({blocks * block_size} token slots)"
        if self.explicit:
            return f"{head}, as given"
        if self.available_mb is None:
            return f"{head}: the batch at full context twice over (available memory unknown)"
        bound = "the batch at full context twice over" if self.mb >= self.want_mb else (
            f"{KV_MEMORY_FRACTION:.0%} of the {self.available_mb:.0f} MiB available "
            f"(the batch at full context twice over would take {self.want_mb:.0f} MiB)")
        return f"{head}: {bound}"


def choose_kv_budget(kv_cache_mb: float | None, bytes_per_slot: int, max_batch: int, max_context: int,
                     available_bytes: int | None) -> KVBudget:
    """``kv_cache_mb`` as given, or the default (`auto_kv_cache_mb`) from ``available_bytes``."""
    want = auto_kv_cache_mb(bytes_per_slot, max_batch, max_context)
    if kv_cache_mb is not None:
        return KVBudget(mb=kv_cache_mb, want_mb=want, available_mb=None, explicit=True)
    avail_mb = None if available_bytes is None else available_bytes / MIB
    return KVBudget(mb=auto_kv_cache_mb(bytes_per_slot, max_batch, max_context, available_bytes), want_mb=want,
                    available_mb=avail_mb, explicit=False)
