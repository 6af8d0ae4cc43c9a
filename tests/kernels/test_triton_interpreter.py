"""Run the Triton kernels in Triton's CPU interpreter, one subprocess per test file.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when Triton-using modules
are first imported, so it cannot be switched on inside this pytest process (other
tests may already have imported the kernels). Each ``interp_*.py`` file runs in a
fresh interpreter with TRITON_INTERPRET=1; its failures fail the test here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
FILES = sorted(p.name for p in HERE.glob("interp_*.py"))


def test_interpreter_files_exist():
    assert {"interp_tree_attention.py", "interp_kv_compact.py", "interp_bench.py", "interp_paged_attention.py"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_in_triton_interpreter(name):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(HERE / name)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert " passed" in output and " skipped" not in output, output[-3000:]
