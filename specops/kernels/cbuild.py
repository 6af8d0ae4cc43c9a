"""Building and loading the CPU kernels' C sources (``cpu_paged``, ``cpu_linear``).

Two places a kernel library comes from, tried in this order:

1. A prebuilt set (`prebuild`; the runtime image makes one in its build stage): the
   directory ``$SPECOPS_PREBUILT_KERNELS``, default ``<sys.prefix>/share/specops/kernels``,
   holding one build per instruction-set variant (x86-64: ``x86-64-v4``, ``x86-64-v3`` and
   the portable ``x86-64``; elsewhere the compiler's default target, ``generic``) and a
   ``manifest.json`` naming each file's SHA-256 and the hash of the sources it was built
   from. At load time the best variant the running CPU supports is chosen (its feature
   flags from ``/proc/cpuinfo``, not the build host's; without them only the portable
   build), its hash checked, and it is used only when it was built from the sources
   installed here. No compiler needed.
2. The kernel cache: compiled on first use with the system C compiler (``$CC`` or ``cc``;
   ``-O3 -march=native`` with reassociation, like torch's own CPU kernels are tuned to the
   machine) into ``$SPECOPS_CACHE_DIR`` (default ``~/.cache/specops``)``/kernels``. The
   build is keyed by what the compiler itself targets (`target_features`: the predefined
   macros of ``cc <flags> -dM -E``, which name every instruction set ``-march=native``
   turns on, and the compiler's version), the sources and the flags, so a cache shared by
   several machines holds one build per CPU and compiler. Each build has a metadata file
   (``<name>.json``) written after the build succeeded, recording its key and the
   library's SHA-256; a library whose metadata is missing or does not match (a torn, foreign
   or tampered file) is rebuilt, never loaded.

Libraries are loaded with ctypes, which releases the GIL during calls. No usable prebuilt
set and no compiler, a failed build, or ``SPECOPS_CPU_KERNELS=0``: the kernel is
unavailable, the reason is logged once, and callers keep their torch path.

Run as a script (it imports only the standard library, so it runs where torch is not
installed, as in an image's build stage): ``python cbuild.py prebuild DIR`` compiles every
variant of every kernel into DIR; ``python cbuild.py check [DIR]`` loads the variant this
CPU gets from DIR (default the prebuilt directory) without a compiler, calls it, and prints
what it loaded as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# stem -> the one source its library is compiled from (linear.c: a unity build that #includes the
# file of each concern, gemv.c, attention.c, pool.c, ...); `source_files` lists all it reads
SOURCES = {"linear": HERE / "linear.c", "paged_attention": HERE / "paged_attention.c"}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
# Reassociation for vectorized sums; not -ffast-math itself: linking a shared library with it
# pulls in crtfastmath.o, which turns on flush-to-zero for the whole process when the library
# loads (subnormal floats become 0 in everyone's arithmetic, torch's and Python's included).
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
              "-freciprocal-math", "-shared", "-fPIC", "-std=c11", "-pthread")
CFLAGS = (BASE_FLAGS[0], "-march=native", *BASE_FLAGS[1:])  # the kernel cache's builds, for this machine

PREBUILT_ENV = "SPECOPS_PREBUILT_KERNELS"
MANIFEST = "manifest.json"

# x86-64 micro-architecture levels (the psABI's), as /proc/cpuinfo names their features;
# each level also needs the ones before it.
X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64", frozenset()),
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})),
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
)
X86_MACHINES = {"x86_64", "amd64"}
PREBUILT_X86 = ("x86-64-v4", "x86-64-v3", "x86-64")  # what `prebuild` compiles on x86-64, best first
GENERIC = "generic"  # the compiler's default target: the one variant built elsewhere


def cache_dir() -> Path:
    return Path(os.environ.get("SPECOPS_CACHE_DIR") or Path.home() / ".cache" / "specops") / "kernels"


def prebuilt_dir() -> Path:
    return Path(os.environ.get(PREBUILT_ENV) or Path(sys.prefix) / "share" / "specops" / "kernels")


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return cc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_files(source: Path) -> list[Path]:
    """``source`` and every file it includes with ``#include "..."``, directly or through
    another such file (resolved beside the file that includes it, as the compiler does), each
    once, breadth first from ``source``. A quoted name with no such file is left to the
    compiler."""
    files: list[Path] = []
    pending = [source.resolve()]
    while pending:
        path = pending.pop(0)
        if path in files:
            continue
        files.append(path)
        for name in _INCLUDE.findall(path.read_text(errors="replace")):
            found = (path.parent / name).resolve()
            if found.is_file() and found not in files:
                pending.append(found)
    return files


def source_hash(source: Path) -> str:
    """SHA-256 of everything a kernel's build reads from its sources (`source_files`): each
    file's name beside ``source`` and its bytes."""
    digest = hashlib.sha256()
    root = source.resolve().parent
    for path in source_files(source):
        data = path.read_bytes()
        digest.update(os.path.relpath(path, root).encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


_features: dict[tuple[str, tuple[str, ...]], str] = {}
_features_lock = threading.Lock()


def target_features(cc: str, flags: tuple[str, ...] = CFLAGS) -> str:
    """What ``cc`` compiles for with ``flags``, in its own words: its predefined macros
    (``-dM -E`` of an empty file), sorted. With ``-march=native`` they name every
    instruction set the compiler found on this CPU (``__AVX2__``, ``__AVX512F__``, ...),
    and ``__VERSION__`` the compiler. Asked once per process per compiler and flags."""
    key = (cc, tuple(flags))
    with _features_lock:
        if key not in _features:
            args = [f for f in flags if f != "-shared"]
            proc = subprocess.run([cc, *args, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode != 0 or "#define" not in proc.stdout:
                raise RuntimeError(f"{cc} -dM -E failed: {proc.stderr.strip()[-400:]}")
            _features[key] = "\n".join(sorted(line.strip() for line in proc.stdout.splitlines() if line.strip()))
        return _features[key]


def build_key(source: Path, cc: str, flags: tuple[str, ...] = CFLAGS) -> str:
    """The kernel cache's key for ``source``: its hash (every file it includes too), the compiler,
    the flags and the compiler's target features (`target_features`)."""
    parts = (source_hash(source), cc, "\0".join(flags), target_features(cc, flags))
    return hashlib.sha256("\n\0".join(parts).encode()).hexdigest()


def _compile(cc: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    proc = subprocess.run([cc, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-400:]}")


def _write_json(path: Path, data: dict) -> None:
    """Writes aside, then renames: a reader never sees half a file."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".part", delete=False) as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.chmod(f.name, 0o644)  # readable by all, like the libraries (an image's runtime user is not its builder)
    os.replace(f.name, path)


def _verified(lib: Path, meta: Path, key: str) -> bool:
    """Whether ``lib`` is the build its metadata records for ``key``."""
    try:
        recorded = json.loads(meta.read_text())
        return recorded.get("key") == key and recorded.get("sha256") == _sha256(lib)
    except (OSError, ValueError, AttributeError):
        return False


def cached_build(source: Path, stem: str) -> Path:
    """The kernel cache's library for ``source`` (built for this CPU and compiler; rebuilt
    when absent or when it is not the build its metadata records)."""
    cc = compiler()
    key = build_key(source, cc)
    out = cache_dir() / f"{stem}-{key[:16]}.so"
    meta = out.with_suffix(".json")
    if out.exists() and _verified(out, meta, key):
        return out
    if out.exists():
        log.warning("%s: not the build its metadata records (%s): rebuilding", out, meta.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then rename: no torn file
        part = Path(tmp) / out.name
        _compile(cc, CFLAGS, source, part)
        digest = _sha256(part)
        os.replace(part, out)
    _write_json(meta, {"key": key, "sha256": digest, "source": str(source), "cc": cc, "flags": list(CFLAGS)})
    return out


def build_library(source: Path, stem: str) -> ctypes.CDLL:
    """Compile ``source`` into the kernel cache (once per source, flags, compiler and CPU) and load it."""
    return ctypes.CDLL(str(cached_build(source, stem)))


# -- prebuilt variants ------------------------------------------------------------------------

def _machine(machine: str | None = None) -> str:
    return (machine or platform.machine()).lower()


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, arm64 ``Features``) from
    ``/proc/cpuinfo`` (``cpuinfo`` for tests); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def variants(machine: str | None = None) -> tuple[str, ...]:
    """The variants `prebuild` compiles on ``machine`` (default this one), best first."""
    return PREBUILT_X86 if _machine(machine) in X86_MACHINES else (GENERIC,)


def variant_flags(variant: str) -> tuple[str, ...]:
    """The compiler flags of a prebuilt variant: ``-march=<level>`` for an x86-64 level, the
    compiler's default target for ``generic``."""
    if variant == GENERIC:
        return BASE_FLAGS
    if variant not in dict(X86_LEVELS):
        raise ValueError(f"unknown kernel variant {variant!r}")
    return (BASE_FLAGS[0], f"-march={variant}", "-mtune=generic", *BASE_FLAGS[1:])


def supports(variant: str, flags: frozenset[str], machine: str | None = None) -> bool:
    """Whether a CPU of ``machine`` with feature ``flags`` runs ``variant``."""
    if variant == GENERIC:
        return True
    if _machine(machine) not in X86_MACHINES:
        return False
    need: set[str] = set()
    for name, level in X86_LEVELS:
        need |= level
        if name == variant:
            return need <= flags
    return False


def choose_variant(available: list[str] | tuple[str, ...], flags: frozenset[str],
                   machine: str | None = None) -> str | None:
    """The best of ``available`` that the CPU runs (None: none does)."""
    order = [name for name, _ in reversed(X86_LEVELS)] + [GENERIC]
    for variant in sorted(available, key=lambda v: order.index(v) if v in order else len(order)):
        if variant in order and supports(variant, flags, machine):
            return variant
    return None


def prebuild(out_dir: Path, stems: tuple[str, ...] | None = None, cc: str | None = None) -> dict:
    """Compile every variant (`variants`) of every kernel into ``out_dir`` and write its
    manifest; returns the manifest."""
    cc = cc or compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"machine": _machine(), "cc": cc, "kernels": {}}
    for stem in stems or tuple(SOURCES):
        source = SOURCES[stem]
        entry = manifest["kernels"][stem] = {"source_sha256": source_hash(source), "variants": {}}
        for variant in variants():
            out = out_dir / f"{stem}-{variant}.so"
            flags = variant_flags(variant)
            _compile(cc, flags, source, out)
            entry["variants"][variant] = {"file": out.name, "sha256": _sha256(out), "flags": list(flags)}
    _write_json(out_dir / MANIFEST, manifest)
    return manifest


def prebuilt_library(source: Path, stem: str, directory: Path | None = None,
                     cpuinfo: str | None = None) -> tuple[Path, str] | None:
    """The prebuilt library of ``stem`` this CPU should load and its variant; None when
    ``directory`` (default `prebuilt_dir`) holds no prebuilt set. RuntimeError when it holds
    one that cannot be used here (other sources, another machine, no variant this CPU runs,
    a file whose hash is not the manifest's)."""
    directory = directory or prebuilt_dir()
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"prebuilt kernels in {directory}: unreadable manifest ({exc})") from exc
    entry = manifest.get("kernels", {}).get(stem)
    if entry is None:
        raise RuntimeError(f"prebuilt kernels in {directory}: none for {stem}")
    if entry.get("source_sha256") != source_hash(source):
        raise RuntimeError(f"prebuilt kernels in {directory}: built from other sources than {source.name} here")
    if manifest.get("machine") != _machine():
        raise RuntimeError(f"prebuilt kernels in {directory}: built for {manifest.get('machine')}, "
                           f"this is {_machine()}")
    variant = choose_variant(list(entry["variants"]), cpu_flags(cpuinfo))
    if variant is None:
        raise RuntimeError(f"prebuilt kernels in {directory}: no variant of {stem} this CPU runs "
                           f"(have {sorted(entry['variants'])})")
    item = entry["variants"][variant]
    path = directory / item["file"]
    try:
        ok = _sha256(path) == item["sha256"]
    except OSError as exc:
        raise RuntimeError(f"prebuilt kernel {path}: {exc}") from exc
    if not ok:
        raise RuntimeError(f"prebuilt kernel {path}: its SHA-256 is not the manifest's")
    return path, variant


class LazyKernel:
    """One C library, loaded on the first `available()` call (thread-safe): the prebuilt
    variant for this CPU when there is a usable prebuilt set, else the kernel cache's build."""

    def __init__(self, source: Path, stem: str, setup: Callable[[ctypes.CDLL], None], what: str,
                 fallback: str) -> None:
        self.source, self.stem, self.setup = source, stem, setup
        self.what, self.fallback = what, fallback  # for the log line: "<what> unavailable, using <fallback>"
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self.origin: str | None = None  # "prebuilt <variant>" or "built" (for this CPU), once loaded
        self.path: Path | None = None
        self._tried = False
        self._lock = threading.Lock()

    def _load(self) -> None:
        prebuilt_error = None
        try:
            found = prebuilt_library(self.source, self.stem)
        except RuntimeError as exc:
            found, prebuilt_error = None, str(exc)
            log.warning("%s: %s; building it here instead", self.what, exc)
        if found is not None:
            path, origin = found[0], f"prebuilt {found[1]}"
        else:
            try:
                path, origin = cached_build(self.source, self.stem), "built"
            except Exception as exc:
                if prebuilt_error:
                    raise RuntimeError(f"{exc} (and {prebuilt_error})") from exc
                raise
        lib = ctypes.CDLL(str(path))
        self.setup(lib)
        self.lib, self.origin, self.path = lib, origin, path

    def available(self) -> bool:
        """Whether the kernel is loaded (loads or builds it on the first call)."""
        if self._tried:
            return self.lib is not None
        with self._lock:
            if not self._tried:
                if os.environ.get("SPECOPS_CPU_KERNELS", "1") == "0":
                    self.error = "turned off (SPECOPS_CPU_KERNELS=0)"
                else:
                    try:
                        self._load()
                    except Exception as exc:  # no compiler, read-only cache, ...: the torch path stays
                        self.error = f"{type(exc).__name__}: {exc}"
                        log.warning("%s unavailable, using %s: %s", self.what, self.fallback, self.error)
                self._tried = True
        return self.lib is not None

    def unavailable_reason(self) -> str | None:
        """Why the kernel is not loaded (None when it is)."""
        self.available()
        return self.error

    def loaded_from(self) -> str | None:
        """Where the loaded library came from: ``"prebuilt <variant>: <path>"`` or
        ``"built: <path>"`` (None when it is not loaded)."""
        return f"{self.origin}: {self.path}" if self.available() else None

    def require(self) -> ctypes.CDLL:
        """The loaded library, or RuntimeError naming why there is none."""
        if self.lib is None and not self.available():
            raise RuntimeError(f"{self.what} unavailable: {self.error}")
        return self.lib


def check(directory: Path) -> dict:
    """Loads each prebuilt kernel this CPU gets from ``directory`` (never compiling), calls
    the linear kernel's row argmax, and says what it loaded. RuntimeError when one cannot be."""
    report: dict = {"directory": str(directory), "machine": _machine(), "kernels": {}}
    best = choose_variant(list(variants()), cpu_flags())
    for stem, source in SOURCES.items():
        found = prebuilt_library(source, stem, directory)
        if found is None:
            raise RuntimeError(f"no prebuilt kernels in {directory}")
        lib = ctypes.CDLL(str(found[0]))
        report["kernels"][stem] = found[1]
        if stem == "linear":
            fn = lib.specops_argmax_rows
            fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            row = (ctypes.c_float * 40)(*[float((7 * i) % 40) for i in range(40)])  # the maximum, 39, at i = 17
            out = (ctypes.c_int64 * 1)()
            fn(row, 1, 40, out)
            if out[0] != 17:
                raise RuntimeError(f"{found[0]}: argmax gave {out[0]}, not 17")
    report["best_for_this_cpu"] = best
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cbuild.py", description="prebuild or check the CPU kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prebuild", help="compile every variant of every kernel into DIR").add_argument("dir", type=Path)
    sub.add_parser("check", help="load this CPU's prebuilt kernels from DIR, without a compiler").add_argument(
        "dir", type=Path, nargs="?")
    args = parser.parse_args(argv)
    try:
        if args.command == "prebuild":
            manifest = prebuild(args.dir)
            print(json.dumps({stem: sorted(e["variants"]) for stem, e in manifest["kernels"].items()}))
        else:
            print(json.dumps(check(args.dir or prebuilt_dir())))
    except RuntimeError as exc:
        print(f"cbuild.py {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
