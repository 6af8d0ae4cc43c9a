"""`specops serve`'s process set-up before torch loads: the OpenMP spin count (`quiet_omp_spin`)."""

from __future__ import annotations

import subprocess
import sys

from specops.serving.cli import OMP_SPIN_COUNT, quiet_omp_spin


def test_the_spin_count_is_set_only_where_the_user_chose_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh `specops serve` process
    env: dict[str, str] = {}
    assert quiet_omp_spin(env) and env == {"GOMP_SPINCOUNT": OMP_SPIN_COUNT}
    for mine in ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(mine)
        assert not quiet_omp_spin(env) and env == mine


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401  (libgomp has read its environment)

    env: dict[str, str] = {}
    assert not quiet_omp_spin(env) and env == {}


def test_the_cli_reaches_serve_before_torch_loads():
    """`specops serve` can still set it: importing the CLI (every command) does not load torch."""
    code = "import sys, specops.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
