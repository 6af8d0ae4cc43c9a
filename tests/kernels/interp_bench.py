"""The kernel benchmark's loop end to end on CPU, with Triton in the interpreter.

Run by ``test_triton_interpreter.py`` in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import time

import pytest

from specops.kernels.bench import KernelBenchConfig, format_table, run_kernel_bench
from specops.kernels.tree_attention import triton_interpreting

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (see test_triton_interpreter.py)")


def wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def test_bench_grid_on_cpu():
    config = KernelBenchConfig(nodes=(3, 8), prefixes=(0, 40), heads_q=4, heads_kv=2, head_dim=16,
                               dtype="float16", copy_bytes=1 << 16, flex_compile=False)
    report = run_kernel_bench(config, device="cpu", timer=wall_ms)
    assert len(report.rows) == 2 * 2 * 4 and not report.skipped
    assert {(r.nodes, r.prefix) for r in report.rows} == {(3, 0), (3, 40), (8, 0), (8, 40)}
    for row in report.rows:
        assert row.ms > 0 and row.gbps > 0 and row.speedup_vs_baseline > 0
        assert row.max_abs_err < 5e-3, row  # every implementation agrees with the reference
    fastest = min(report.row(8, 40, "sdpa").ms, report.row(8, 40, "flex").ms)
    assert report.row(8, 40, "triton").speedup_vs_baseline == pytest.approx(fastest / report.row(8, 40, "triton").ms)
    assert report.row(8, 40, "triton").backend == "interpreter"
    assert report.goals() == []  # the T=64, L=16k point was not run
    assert "cpu" in format_table(report)
