"""The CPU kernels' build cache: one build per source, flags and CPU (`cbuild.cpu_signature`)."""

from __future__ import annotations

from specops.kernels import cbuild

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx avx2 fma
bogomips\t: 4890.81

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse sse2 avx avx2 fma avx512f
"""


def test_the_signature_reads_the_first_processors_model_and_flags():
    sig = cbuild.cpu_signature(X86)
    assert sig == ("cpu family=25; flags=fpu sse sse2 avx avx2 fma; model=1; model name=AMD EPYC; "
                   "vendor_id=AuthenticAMD")
    assert cbuild.cpu_signature(X86.replace("avx2 fma\nbogo", "avx2 fma avx512f\nbogo")) != sig  # another ISA
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert cbuild.cpu_signature(arm) == "CPU implementer=0x41; CPU part=0xd40; Features=fp asimd sve"
    assert cbuild.cpu_signature("") != ""  # no cpuinfo: the platform's names


def test_a_cache_shared_by_two_cpus_holds_a_build_for_each(tmp_path, monkeypatch):
    """A kernel built on one CPU (with -march=native) is never loaded on another: the cache key
    includes the CPU, so the second machine builds its own."""
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path))
    source = tmp_path / "seven.c"
    source.write_text("int seven(void) { return 7; }\n")
    monkeypatch.setattr(cbuild, "cpu_signature", lambda: "flags=avx2")
    assert cbuild.build_library(source, "seven").seven() == 7
    first = sorted(p.name for p in (tmp_path / "kernels").glob("seven-*.so"))
    assert cbuild.build_library(source, "seven").seven() == 7  # same CPU: the cached build
    assert sorted(p.name for p in (tmp_path / "kernels").glob("seven-*.so")) == first
    monkeypatch.setattr(cbuild, "cpu_signature", lambda: "flags=avx2 avx512f")
    assert cbuild.build_library(source, "seven").seven() == 7
    both = sorted(p.name for p in (tmp_path / "kernels").glob("seven-*.so"))
    assert len(first) == 1 and len(both) == 2 and first[0] in both
