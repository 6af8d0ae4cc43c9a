"""`specops serve`'s process set-up: the OpenMP spin count before torch loads (`quiet_omp_spin`),
and the GIL switch interval."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specops.server.cli import OMP_SPIN_COUNT, quiet_omp_spin


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


def test_serve_hands_the_gil_back_within_half_a_millisecond(monkeypatch):
    """`specops serve` shortens the interpreter's switch interval before it serves (the engine
    thread waits that long for the GIL after each C call while the event loop runs Python)."""
    from click.testing import CliRunner

    import specops.server.server as server
    from specops.server.cli import GIL_SWITCH_INTERVAL_S, serve_command

    seen = []
    monkeypatch.setattr(server, "run_server", lambda cfg: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    try:
        result = CliRunner().invoke(serve_command, ["--port", "0"])
        assert result.exit_code == 0, result.output
    finally:
        sys.setswitchinterval(before)
    assert seen == [GIL_SWITCH_INTERVAL_S] and GIL_SWITCH_INTERVAL_S < before


def test_serve_loads_the_models_in_the_dtype_asked(monkeypatch):
    from click.testing import CliRunner

    import specops.server.server as server
    from specops.server.cli import serve_command

    with pytest.raises(server.ServeError, match="dtype must be one of float32, bfloat16"):
        server.run_server(server.ServeConfig(dtype="float16"))  # refused before anything starts
    seen = []
    monkeypatch.setattr(server, "run_server", lambda cfg: seen.append(cfg.dtype))
    before = sys.getswitchinterval()
    try:
        assert CliRunner().invoke(serve_command, ["--port", "0", "--dtype", "bfloat16"]).exit_code == 0
        assert CliRunner().invoke(serve_command, ["--port", "0"]).exit_code == 0
        bad = CliRunner().invoke(serve_command, ["--port", "0", "--dtype", "float16"])
    finally:
        sys.setswitchinterval(before)
    assert seen == ["bfloat16", "float32"] and bad.exit_code == 2 and "--dtype" in bad.output
