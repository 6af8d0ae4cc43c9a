"""The default KV budget: the batch at full context twice over, within a stated share of the
memory available at start (the host's MemAvailable within the cgroup's limit), logged."""

from __future__ import annotations

import logging

import pytest
import torch

from specops.decoder import Decoder
from specops.engine import kv_budget
from specops.engine.batch_forward import bytes_per_token
from specops.engine.engine import Engine
from specops.engine.kv_budget import (KV_MEMORY_FRACTION, auto_kv_cache_mb, cgroup_headroom_bytes,
                                       choose_kv_budget, mem_available_bytes)
from tests.decoder.tiny_models import tiny_other

MIB = 2**20


def test_the_default_is_capped_by_a_share_of_the_available_memory():
    want = 2 * 16 * 4096 * 1024 / MIB  # 128 MiB
    assert auto_kv_cache_mb(1024, 16, 4096) == want
    assert auto_kv_cache_mb(1024, 16, 4096, available_bytes=10 * 2**30) == want
    assert auto_kv_cache_mb(1024, 16, 4096, available_bytes=100 * MIB) == KV_MEMORY_FRACTION * 100
    big = choose_kv_budget(None, 2**20, 16, 131_072, available_bytes=24 * 2**30)  # an 8B-sized slot
    assert big.mb == KV_MEMORY_FRACTION * 24 * 1024 and "50% of the 24576 MiB available" in big.describe(10, 16)
    given = choose_kv_budget(64.0, 2**20, 16, 131_072, available_bytes=None)
    assert given.mb == 64.0 and given.describe(4, 16).endswith("as given")


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    assert mem_available_bytes(meminfo) == 20_000_000 * 1024
    assert mem_available_bytes(tmp_path / "absent") is None
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert cgroup_headroom_bytes(tmp_path) == 3 * 2**30
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_headroom_bytes(tmp_path) is None


def test_the_engine_sizes_its_default_cache_from_free_memory_and_says_so(monkeypatch, caplog):
    torch.set_num_threads(1)
    dec = Decoder(tiny_other("qwen2", seed=3, vocab=96))
    per_slot = bytes_per_token(dec.target)
    avail = 2 * 64 * per_slot  # half of it holds 64 token slots: far below 4 sequences at full context
    monkeypatch.setattr(kv_budget, "mem_available_bytes", lambda *a: avail)
    monkeypatch.setattr(kv_budget, "cgroup_headroom_bytes", lambda *a: None)
    with caplog.at_level(logging.INFO, logger="specops.engine.engine"):
        eng = Engine(dec, max_batch=4, kv_cache_mb=None, block_size=8, calibrate=False)
    assert eng.pool.capacity_slots == 64 and eng.max_model_len == 64
    assert any("KV cache" in r.message and "available" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="kv_cache_mb"):
        Engine(dec, max_batch=4, kv_cache_mb=0, calibrate=False)
