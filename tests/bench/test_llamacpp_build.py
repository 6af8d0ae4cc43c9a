"""The llama.cpp binaries' cache and lookup (the build itself runs in `make peers`)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from specops.bench import llamacpp_build as lb


def _fake_build(root, version=lb.LLAMA_CPP_PYTHON_VERSION, **override):
    vdir = root / version
    (vdir / "bin").mkdir(parents=True)
    for name in lb.TARGETS:
        path = vdir / "bin" / name
        path.write_text("#!/bin/sh\necho fake\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    info = dict(lb._build_key(version), **override)
    (vdir / "build-info.json").write_text(json.dumps(info))
    return vdir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_LLAMA_CACHE", str(tmp_path))
    for var in lb.ENV_OVERRIDES.values():
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_a_valid_cache_is_reused_without_building(cache, monkeypatch):
    vdir = _fake_build(cache)
    monkeypatch.setattr(lb, "_run", lambda *a, **k: pytest.fail("built although the cache is valid"))
    assert lb.build() == vdir / "bin"
    assert lb.find_binary("llama-server") == str(vdir / "bin" / "llama-server")


@pytest.mark.parametrize("override", [{"cpu_flags": "another-cpu"}, {"cmake_flags": ["-DGGML_NATIVE=OFF"]}])
def test_a_cache_for_another_cpu_or_flags_is_not_valid(cache, override):
    _fake_build(cache, **override)
    assert not lb.cached_build_ok()


def test_a_cache_missing_a_binary_is_not_valid(cache):
    vdir = _fake_build(cache)
    (vdir / "bin" / "llama-bench").unlink()
    assert not lb.cached_build_ok()


def test_env_override_wins_and_a_bad_one_is_an_error(cache, tmp_path, monkeypatch):
    _fake_build(cache)
    mine = tmp_path / "my-server"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    monkeypatch.setenv("SPECOPS_LLAMA_SERVER", str(mine))
    assert lb.find_binary("llama-server") == str(mine)
    monkeypatch.setenv("SPECOPS_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(lb.LlamaBuildError, match="SPECOPS_LLAMA_SERVER"):
        lb.find_binary("llama-server")
    with pytest.raises(ValueError, match="unknown llama.cpp binary"):
        lb.find_binary("llama-foo")


def test_print_path_cli(cache, capsys):
    assert lb.main(["--print-path", "llama-server"]) == 1
    assert "make peers" in capsys.readouterr().err
    vdir = _fake_build(cache)
    assert lb.main(["--print-path", "llama-server"]) == 0
    assert capsys.readouterr().out.strip() == str(vdir / "bin" / "llama-server")


def test_missing_cmake_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setattr(lb.shutil, "which", lambda name: None)
    with pytest.raises(lb.LlamaBuildError, match="cmake is not installed"):
        lb.build()
    assert os.listdir(cache) == []
