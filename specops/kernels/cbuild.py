"""Building and loading the CPU kernels' C sources (``cpu_paged``, ``cpu_linear``).

Each source is compiled on first use with the system C compiler (``$CC`` or ``cc``;
``-O3 -march=native`` with reassociation, like torch's own CPU kernels are tuned to the
machine) into ``$SPECOPS_CACHE_DIR`` (default ``~/.cache/specops``)``/kernels``, named by a
hash of the source, the shared header, the flags and the CPU it is built for (`cpu_signature`:
a cache shared by different machines, an image's home or a network home, holds one build per
CPU, and no machine loads code built for instructions it lacks), and loaded with ctypes, which
releases the GIL during calls. No compiler, a failed build, or ``SPECOPS_CPU_KERNELS=0``:
the kernel is unavailable, the reason is logged once, and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

HEADER = Path(__file__).with_name("vexp.h")  # included by the C sources
# Reassociation for vectorized sums; not -ffast-math itself: linking a shared library with it
# pulls in crtfastmath.o, which turns on flush-to-zero for the whole process when the library
# loads (subnormal floats become 0 in everyone's arithmetic, torch's and Python's included).
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
          "-freciprocal-math", "-shared", "-fPIC", "-std=c11", "-pthread")


def cache_dir() -> Path:
    return Path(os.environ.get("SPECOPS_CACHE_DIR") or Path.home() / ".cache" / "specops") / "kernels"


CPUINFO_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags",  # x86
                "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")  # arm64


def cpu_signature(cpuinfo: str | None = None) -> str:
    """What ``-march=native`` compiles for, as far as the kernel says: the first processor's
    vendor, model and feature flags from ``/proc/cpuinfo`` (``cpuinfo`` for tests), else the
    platform's machine and processor names."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    seen: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in CPUINFO_KEYS and key not in seen:
            seen[key] = " ".join(value.split())
    if not seen:
        return f"{platform.machine()} {platform.processor()}"
    return "; ".join(f"{k}={seen[k]}" for k in sorted(seen))


def build_library(source: Path, stem: str) -> ctypes.CDLL:
    """Compile ``source`` into the kernel cache (once per source, header, flags and CPU) and load it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes() + HEADER.read_bytes()  # the shared header is part of what is built
    tag = hashlib.sha256(src + " ".join((cc, *CFLAGS, cpu_signature())).encode()).hexdigest()[:16]
    out = cache_dir() / f"{stem}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then rename: no torn file
            part = Path(tmp) / out.name
            proc = subprocess.run([cc, *CFLAGS, "-o", str(part), str(source), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-400:]}")
            os.replace(part, out)
    return ctypes.CDLL(str(out))


class LazyKernel:
    """One C library, built and loaded on the first `available()` call (thread-safe)."""

    def __init__(self, source: Path, stem: str, setup: Callable[[ctypes.CDLL], None], what: str,
                 fallback: str) -> None:
        self.source, self.stem, self.setup = source, stem, setup
        self.what, self.fallback = what, fallback  # for the log line: "<what> unavailable, using <fallback>"
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._tried = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the kernel is built and loaded (builds it on the first call)."""
        if self._tried:
            return self.lib is not None
        with self._lock:
            if not self._tried:
                if os.environ.get("SPECOPS_CPU_KERNELS", "1") == "0":
                    self.error = "turned off (SPECOPS_CPU_KERNELS=0)"
                else:
                    try:
                        lib = build_library(self.source, self.stem)
                        self.setup(lib)
                        self.lib = lib
                    except Exception as exc:  # no compiler, read-only cache, ...: the torch path stays
                        self.error = f"{type(exc).__name__}: {exc}"
                        log.warning("%s unavailable, using %s: %s", self.what, self.fallback, self.error)
                self._tried = True
        return self.lib is not None

    def unavailable_reason(self) -> str | None:
        """Why the kernel is not loaded (None when it is)."""
        self.available()
        return self.error

    def require(self) -> ctypes.CDLL:
        """The loaded library, or RuntimeError naming why there is none."""
        if self.lib is None and not self.available():
            raise RuntimeError(f"{self.what} unavailable: {self.error}")
        return self.lib
