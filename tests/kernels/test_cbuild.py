"""Where the CPU kernels' libraries come from (`specops.kernels.cbuild`): the kernel cache,
keyed by the compiler's own target features and checked against each build's metadata
before loading, and a prebuilt set of instruction-set variants chosen by the running CPU."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specops.kernels import cbuild

X86 = platform.machine().lower() in cbuild.X86_MACHINES
ROOT = Path(__file__).resolve().parents[2]

SEVEN = "int seven(void) { return 7; }\n"
# which -march a build had: 4 with AVX-512 (BW), 3 with AVX2, 1 without
LEVEL = """int seven(void) { return 7; }
int level(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 4;
#elif defined(__AVX2__)
    return 3;
#else
    return 1;
#endif
}
"""

V2 = "cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3"
V3 = V2 + " avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"


def cpuinfo(flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 {flags}\n\n"
            f"processor\t: 1\nflags\t\t: fpu sse sse2 {V4}\n")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh kernel cache and a count of the compiler runs."""
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "home"))
    runs: list[Path] = []
    real = cbuild._compile

    def counting(cc, flags, source, out):
        runs.append(source)
        real(cc, flags, source, out)

    monkeypatch.setattr(cbuild, "_compile", counting)
    return runs


def _source(tmp_path: Path, text: str = SEVEN, name: str = "seven.c") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _foreign(tmp_path: Path, value: int) -> Path:
    """A library with the same symbol that is not the build asked for."""
    src = _source(tmp_path, f"int seven(void) {{ return {value}; }}\n", f"foreign{value}.c")
    out = tmp_path / f"foreign{value}.so"
    subprocess.run([cbuild.compiler(), "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=60)
    return out


@pytest.mark.skipif(not X86, reason="x86-64 levels")
def test_target_features_are_the_compilers_own_and_name_the_instruction_sets():
    cc = cbuild.compiler()
    base = cbuild.target_features(cc, cbuild.variant_flags("x86-64"))
    v3 = cbuild.target_features(cc, cbuild.variant_flags("x86-64-v3"))
    assert "__AVX2__" not in base and "#define __AVX2__ 1" in v3.splitlines()
    assert "__VERSION__" in base  # the compiler's version is part of it
    native = cbuild.target_features(cc, cbuild.CFLAGS)
    assert ("#define __AVX2__ 1" in native.splitlines()) == ("avx2" in cbuild.cpu_flags())


def test_a_cache_shared_by_two_cpus_holds_a_build_for_each(tmp_path, cache, monkeypatch):
    """Two CPUs whose compilers target different instruction sets never share a build, even
    where /proc/cpuinfo is missing (macOS) and the platform's names are the same; the same
    CPU reuses its build."""
    source = _source(tmp_path)
    monkeypatch.setattr(cbuild, "cpu_flags", lambda cpuinfo=None: frozenset())  # no /proc/cpuinfo
    monkeypatch.setattr(cbuild, "target_features", lambda cc, flags=cbuild.CFLAGS: "#define __AVX2__ 1")
    first = cbuild.cached_build(source, "seven")
    assert cbuild.cached_build(source, "seven") == first and len(cache) == 1  # same CPU: the cached build
    monkeypatch.setattr(cbuild, "target_features",
                        lambda cc, flags=cbuild.CFLAGS: "#define __AVX2__ 1\n#define __AVX512F__ 1")
    second = cbuild.cached_build(source, "seven")
    assert second != first and len(cache) == 2
    assert ctypes.CDLL(str(second)).seven() == 7
    assert sorted(p.name for p in first.parent.glob("seven-*.so")) == sorted([first.name, second.name])


def test_a_matching_build_is_reused_and_its_metadata_records_key_and_hash(tmp_path, cache):
    source = _source(tmp_path)
    lib = cbuild.cached_build(source, "seven")
    meta = json.loads(lib.with_suffix(".json").read_text())
    assert meta["key"] == cbuild.build_key(source, cbuild.compiler()) and lib.name.endswith(f"-{meta['key'][:16]}.so")
    assert meta["sha256"] == cbuild._sha256(lib)
    assert cbuild.build_library(source, "seven").seven() == 7
    assert len(cache) == 1


def test_a_foreign_library_under_the_expected_name_is_rebuilt_not_loaded(tmp_path, cache):
    source = _source(tmp_path)
    lib = cbuild.cached_build(source, "seven")
    os.replace(_foreign(tmp_path, 8), lib)  # a migrated / tampered cache: another build, same name
    again = cbuild.cached_build(source, "seven")
    assert again == lib and len(cache) == 2
    assert ctypes.CDLL(str(again)).seven() == 7


@pytest.mark.parametrize("damage", ["no metadata", "another key", "unreadable metadata"])
def test_a_library_whose_metadata_does_not_match_is_rebuilt(tmp_path, cache, damage):
    source = _source(tmp_path)
    lib = cbuild.cached_build(source, "seven")
    meta = lib.with_suffix(".json")
    if damage == "no metadata":  # a build that never finished, or a copied .so alone
        meta.unlink()
    elif damage == "another key":  # built for another CPU or compiler
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "key": "0" * 64}))
    else:
        meta.write_text("{not json")
    assert cbuild.cached_build(source, "seven") == lib and len(cache) == 2
    assert json.loads(meta.read_text())["key"] == cbuild.build_key(source, cbuild.compiler())
    cbuild.cached_build(source, "seven")
    assert len(cache) == 2  # and the rebuilt one is then reused



def test_every_kernel_source_file_is_part_of_its_librarys_hash(tmp_path):
    """Each .c / .h file of the kernels is read by some kernel's build (`source_files`: the
    unity build linear.c includes the file of each concern), and editing any one of them
    changes that kernel's hash, so neither the kernel cache nor a prebuilt set serves a
    library built from other sources. The hash does not depend on where the sources lie (an
    image's build stage and its runtime install them in different places)."""
    kernels = ROOT / "specops" / "kernels"
    read = {path for source in cbuild.SOURCES.values() for path in cbuild.source_files(source)}
    assert read == {path.resolve() for path in kernels.iterdir() if path.suffix in (".c", ".h")}
    assert {"gemv.c", "attention.c", "pool.c", "vexp.h"} <= {path.name for path in read}
    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in read:
        shutil.copy(path, copy / path.name)
    for source in cbuild.SOURCES.values():
        moved = copy / source.name
        before = cbuild.source_hash(moved)
        assert before == cbuild.source_hash(source)
        for path in cbuild.source_files(moved):
            text = path.read_bytes()
            path.write_bytes(text + b"\n/* edited */\n")
            assert cbuild.source_hash(moved) != before, path.name
            path.write_bytes(text)
        assert cbuild.source_hash(moved) == before


def test_a_header_included_through_another_is_part_of_the_cache_key(tmp_path, cache):
    """A header two includes deep (and included back: each file is read once) rebuilds the
    cached library when it changes."""
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner.h"\n')
    (tmp_path / "inner.h").write_text('#pragma once\n#include "outer.h"\n#define SEVEN 7\n')
    source = _source(tmp_path, '#include "outer.h"\nint seven(void) { return SEVEN; }\n')
    assert [path.name for path in cbuild.source_files(source)] == ["seven.c", "outer.h", "inner.h"]
    first = cbuild.cached_build(source, "seven")
    assert ctypes.CDLL(str(first)).seven() == 7
    (tmp_path / "inner.h").write_text('#pragma once\n#include "outer.h"\n#define SEVEN 8\n')
    second = cbuild.cached_build(source, "seven")
    assert second != first and len(cache) == 2
    assert ctypes.CDLL(str(second)).seven() == 8


# -- prebuilt variants -------------------------------------------------------------------------

def test_cpu_flags_are_the_first_processors():
    assert cbuild.cpu_flags(cpuinfo("avx2")) == frozenset({"fpu", "sse", "sse2", "avx2"})
    assert cbuild.cpu_flags("processor\t: 0\nFeatures\t: fp asimd sve\n") == frozenset({"fp", "asimd", "sve"})
    assert cbuild.cpu_flags("") == frozenset()


def test_the_variant_is_the_best_the_running_cpu_supports():
    built = ["x86-64", "x86-64-v3", "x86-64-v4"]
    flags = cbuild.cpu_flags
    assert cbuild.choose_variant(built, flags(cpuinfo(V4)), "x86_64") == "x86-64-v4"
    assert cbuild.choose_variant(built, flags(cpuinfo(V3)), "x86_64") == "x86-64-v3"
    assert cbuild.choose_variant(built, flags(cpuinfo(V3 + " avx512f")), "x86_64") == "x86-64-v3"  # AVX-512 F alone
    assert cbuild.choose_variant(built, flags(cpuinfo(V2)), "x86_64") == "x86-64"
    assert cbuild.choose_variant(built, flags(cpuinfo(V4.replace(" movbe", ""))), "x86_64") == "x86-64"
    assert cbuild.choose_variant(built, frozenset(), "x86_64") == "x86-64"  # no /proc/cpuinfo: the portable one
    assert cbuild.choose_variant(["x86-64-v4", "x86-64-v3"], flags(cpuinfo(V2)), "x86_64") is None
    assert cbuild.choose_variant(built, flags(cpuinfo(V4)), "aarch64") is None  # x86 builds on arm
    assert cbuild.choose_variant(["generic"], frozenset({"asimd"}), "aarch64") == "generic"
    assert cbuild.variants("x86_64") == ("x86-64-v4", "x86-64-v3", "x86-64")
    assert cbuild.variants("aarch64") == ("generic",)
    assert "-march=x86-64-v3" in cbuild.variant_flags("x86-64-v3")
    assert not any(f.startswith("-march") for f in cbuild.variant_flags("generic"))
    with pytest.raises(ValueError):
        cbuild.variant_flags("native")


@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    """A prebuilt set of LEVEL's variants in tmp_path/prebuilt, then no compiler at all."""
    source = _source(tmp_path, LEVEL, "level.c")
    monkeypatch.setattr(cbuild, "SOURCES", {"level": source})
    directory = tmp_path / "prebuilt"
    manifest = cbuild.prebuild(directory)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "home"))
    return source, directory, manifest


def test_a_prebuilt_set_loads_the_cpus_variant_without_a_compiler(prebuilt, monkeypatch):
    source, directory, manifest = prebuilt
    assert sorted(manifest["kernels"]["level"]["variants"]) == sorted(cbuild.variants())
    with pytest.raises(RuntimeError, match="no C compiler"):
        cbuild.compiler()
    cases = [(V4, "x86-64-v4", 4), (V3, "x86-64-v3", 3), (V2, "x86-64", 1)] if X86 else [("", "generic", None)]
    for flags, variant, level in cases:
        path, chosen = cbuild.prebuilt_library(source, "level", directory, cpuinfo(flags))
        assert chosen == variant and path == directory / f"level-{variant}.so"
        if level is not None:
            assert ctypes.CDLL(str(path)).level() == level  # built with that variant's -march
    monkeypatch.setenv(cbuild.PREBUILT_ENV, str(directory))
    kernel = cbuild.LazyKernel(source, "level", lambda lib: None, "level kernel", "nothing")
    assert kernel.available(), kernel.error
    best = cbuild.choose_variant(list(cbuild.variants()), cbuild.cpu_flags())
    assert kernel.origin == f"prebuilt {best}" and kernel.lib.seven() == 7
    assert kernel.loaded_from() == f"prebuilt {best}: {directory / f'level-{best}.so'}"


def test_no_prebuilt_set_is_none_and_an_unusable_one_is_refused(prebuilt, tmp_path):
    source, directory, _ = prebuilt
    assert cbuild.prebuilt_library(source, "level", tmp_path / "nowhere") is None
    path, _ = cbuild.prebuilt_library(source, "level", directory)
    original = path.read_bytes()
    os.replace(_foreign_prebuilt(tmp_path), path)  # a file that is not the manifest's
    with pytest.raises(RuntimeError, match="SHA-256"):
        cbuild.prebuilt_library(source, "level", directory)
    path.write_bytes(original)
    source.write_text(LEVEL + "int eight(void) { return 8; }\n")  # the installed sources moved on
    with pytest.raises(RuntimeError, match="other sources"):
        cbuild.prebuilt_library(source, "level", directory)
    with pytest.raises(RuntimeError, match="none for"):
        cbuild.prebuilt_library(source, "other", directory)


def _foreign_prebuilt(tmp_path: Path) -> Path:
    out = tmp_path / "junk.so"
    out.write_bytes(b"\x7fELF not a library")
    return out


def test_an_unusable_prebuilt_set_falls_back_to_the_kernel_cache(tmp_path, cache, monkeypatch):
    source = _source(tmp_path, LEVEL, "level.c")
    monkeypatch.setattr(cbuild, "SOURCES", {"level": source})
    directory = tmp_path / "prebuilt"
    cbuild.prebuild(directory)
    source.write_text(LEVEL + "int eight(void) { return 8; }\n")
    monkeypatch.setenv(cbuild.PREBUILT_ENV, str(directory))
    kernel = cbuild.LazyKernel(source, "level", lambda lib: None, "level kernel", "nothing")
    assert kernel.available(), kernel.error
    assert kernel.origin == "built" and kernel.lib.eight() == 8


def test_the_script_prebuilds_the_real_kernels_and_the_runtime_loads_them_without_a_compiler(tmp_path):
    """What the runtime image does: `cbuild.py prebuild` in the build stage, then, with no
    compiler on PATH, `cbuild.py check` and the kernels themselves load the CPU's variant."""
    script = ROOT / "specops" / "kernels" / "cbuild.py"
    directory = tmp_path / "kernels"
    out = subprocess.run([sys.executable, str(script), "prebuild", str(directory)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {stem: sorted(cbuild.variants()) for stem in cbuild.SOURCES}
    assert all(oct(p.stat().st_mode & 0o444) == "0o444" for p in directory.iterdir())  # readable by any user
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(empty), SPECOPS_CACHE_DIR=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    best = cbuild.choose_variant(list(cbuild.variants()), cbuild.cpu_flags())
    out = subprocess.run([sys.executable, str(script), "check", str(directory)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kernels"] == {stem: best for stem in cbuild.SOURCES} and report["best_for_this_cpu"] == best
    probe = ("import torch\n"
             "from specops.kernels import cpu_linear, cpu_paged\n"
             "assert cpu_linear.available() and cpu_paged.available(), cpu_linear.unavailable_reason()\n"
             "x, w = torch.randn(3, 64), torch.randn(96, 64)\n"
             "assert torch.allclose(cpu_linear.linear(x, w), x @ w.T, atol=1e-4)\n"
             "print(cpu_linear.loaded_from()); print(cpu_paged.loaded_from())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, cbuild.PREBUILT_ENV: str(directory)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"prebuilt {best}: {directory / f'linear-{best}.so'}",
                                          f"prebuilt {best}: {directory / f'paged_attention-{best}.so'}"]
    assert not (tmp_path / "home").exists()  # nothing compiled, nothing cached
    missing = subprocess.run([sys.executable, str(script), "check", str(tmp_path / "nowhere")], capture_output=True,
                             text=True, timeout=60, env=env, cwd=tmp_path)
    assert missing.returncode == 1 and "no prebuilt kernels" in missing.stderr
