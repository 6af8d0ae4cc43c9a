"""The memory-bandwidth ceiling on plain decoding, as ``specops bench decode`` prints it.

Plain decoding (``ar``) runs one T = 1 forward per token, and a T = 1 forward streams every
weight of the target once: at best it is as fast as memory delivers those bytes. Three
parts:

* `read_bandwidth`: a STREAM-like read benchmark: the sum of a float32 buffer much larger
  than the last-level cache (at least `MIN_BUFFER_BYTES`, and `CACHE_MULTIPLE` x the
  cache), with the benchmark's thread count, best of several timings;
* `streamed_weight_bytes`: the bytes of weights one T = 1 forward reads (every parameter
  tensor once, at the dtype it is loaded in; a tied LM head shares the embedding table, so
  the table counts once; an input embedding table of its own is read one row per token);
* `bandwidth_ceiling`: bandwidth / bytes per token = a tokens/s ceiling, and ar's measured
  speed as a share of it (ar's decode-only figure where the report has one, else its
  end-to-end tokens/s, labelled).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch

MIN_BUFFER_BYTES = 1 << 30
CACHE_MULTIPLE = 32  # the buffer is at least this many times the last-level cache
REPEATS = 5
_CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(root: Path = _CACHE_ROOT) -> int | None:
    """Size of the CPU's highest cache level (Linux sysfs), None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def buffer_bytes() -> int:
    """The read benchmark's buffer: `MIN_BUFFER_BYTES`, or `CACHE_MULTIPLE` x the last-level cache
    when that is larger."""
    return max(MIN_BUFFER_BYTES, CACHE_MULTIPLE * (last_level_cache_bytes() or 0))


def read_bandwidth(*, nbytes: int | None = None, threads: int | None = None, repeats: int = REPEATS,
                   device: str = "cpu") -> dict[str, Any]:
    """Bytes per second read by summing a float32 buffer of ``nbytes`` (default `buffer_bytes`) on
    ``device`` with ``threads`` torch threads (default: torch's current count), the fastest of
    ``repeats`` timings after one untimed pass. The buffer is filled first, so every page is
    mapped to memory of its own (an untouched allocation would read one shared zero page)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    nbytes = buffer_bytes() if nbytes is None else int(nbytes)
    if nbytes < 4:
        raise ValueError(f"the buffer needs at least one float32 (4 bytes), got {nbytes}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    previous = torch.get_num_threads()
    threads = threads or previous
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        read = buf.numel() * buf.element_size()
        float(buf.sum())
        best = math.inf
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            total = buf.sum()
            if cuda:
                torch.cuda.synchronize(dev)
            else:
                float(total)
            best = min(best, time.perf_counter() - t0)
        del buf
    finally:
        torch.set_num_threads(previous)
    return {"bytes_per_s": read / best, "buffer_bytes": read, "best_s": best, "repeats": repeats,
            "threads": None if cuda else threads,
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one T = 1 forward of ``model`` reads: each distinct parameter tensor once
    (`parameters()` yields a tensor shared by two modules once, so a tied LM head and embedding
    table count once), except an input embedding table not shared with the LM head, of which a
    token reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = getattr(embed, "weight", None)
    if table is not None and getattr(head, "weight", None) is not table and table.dim() == 2:
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def bandwidth_ceiling(bandwidth: dict[str, Any], weight_bytes: int, results: Sequence[dict]) -> dict[str, Any]:
    """``bandwidth`` (from `read_bandwidth`) over ``weight_bytes`` per token = a tokens/s ceiling on
    plain decoding, with ``ar``'s row of ``results`` (a report's rows) as a share of it:
    ``ar_measure`` "decode" (its decode-only tokens/s, prompt passes left out) where the row has
    that figure, else "end-to-end"; the ar fields are None without an ar row."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes must be > 0, got {weight_bytes}")
    ceiling = bandwidth["bytes_per_s"] / weight_bytes
    ar = next((r for r in results if r.get("method") == "ar"), None)
    ar_tps, measure = None, None
    if ar is not None:
        if ar.get("decode_tokens_per_s") is not None:
            ar_tps, measure = ar["decode_tokens_per_s"], "decode"
        else:
            ar_tps, measure = ar["tokens_per_s"], "end-to-end"
    return {
        "bytes_per_s": round(bandwidth["bytes_per_s"]),
        "threads": bandwidth.get("threads"),
        "device": bandwidth.get("device", "cpu"),
        "buffer_bytes": bandwidth.get("buffer_bytes"),
        "repeats": bandwidth.get("repeats"),
        "weight_bytes_per_token": int(weight_bytes),
        "ceiling_tokens_per_s": round(ceiling, 3),
        "ar_tokens_per_s": ar_tps,
        "ar_measure": measure,
        "ar_fraction_of_ceiling": None if ar_tps is None else round(ar_tps / ceiling, 4),
    }


def format_bandwidth(b: dict[str, Any]) -> str:
    """The report's ``bandwidth`` entry as one line."""
    how = f"{b['threads']} threads" if b.get("threads") else b.get("device", "cpu")
    line = (f"memory bandwidth {b['bytes_per_s'] / 1e9:.1f} GB/s (read, {how}); "
            f"weights {b['weight_bytes_per_token'] / 1e6:.1f} MB/token → ceiling {b['ceiling_tokens_per_s']:.1f} tok/s")
    if b.get("ar_tokens_per_s") is not None:
        line += (f"; ar {b['ar_measure']} {b['ar_tokens_per_s']:.1f} tok/s = "
                 f"{100 * b['ar_fraction_of_ceiling']:.0f}% of it")
    return line
