"""llama.cpp's own binaries (``llama-server``, ``llama-bench``, ``llama-cli``), built from the
package index's sources and cached outside the work tree.

Sources: the ``llama-cpp-python`` sdist (pinned, `LLAMA_CPP_PYTHON_VERSION`) carries the
whole llama.cpp tree under ``vendor/llama.cpp``; ``pip download --no-deps --no-binary
:all:`` fetches it through the ordinary package index (no git, no other download).

Build: cmake, Release, ``-DGGML_NATIVE=ON`` (tuned to this CPU, llama.cpp's own default
for a source build), ``-DLLAMA_CURL=OFF`` (no model downloads), static libraries so the
binaries run from wherever they are copied, only the targets named in `TARGETS`.

Cache: ``$SPECOPS_LLAMA_CACHE`` or ``$SPECOPS_CACHE_DIR/llama.cpp`` (default
``~/.cache/specops/llama.cpp``), one folder per sdist version, ``<version>/bin/<binary>``
plus ``<version>/build-info.json`` (flags, the CPU's instruction-set flags, build time,
the binary's ``--version``). A cached build is reused when its recorded flags and CPU
flags match; otherwise it is rebuilt. A second `build` is free.

Lookup (`find_binary`): ``$SPECOPS_LLAMA_SERVER`` / ``$SPECOPS_LLAMA_BENCH`` /
``$SPECOPS_LLAMA_CLI`` when set (an explicit path: missing is an error), else the cached
build of the pinned version, else None.

CLI: ``python -m specops.bench.llamacpp_build [--version V] [--jobs N] [--force]``
(what ``make peers`` runs); ``--print-path llama-server`` prints where a binary is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_PACKAGE = "llama-cpp-python"
TARGETS = ("llama-server", "llama-bench", "llama-cli")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
ENV_OVERRIDES = {
    "llama-server": "SPECOPS_LLAMA_SERVER",
    "llama-bench": "SPECOPS_LLAMA_BENCH",
    "llama-cli": "SPECOPS_LLAMA_CLI",
}
BUILD_HINT = "make peers (or: python -m specops.bench.llamacpp_build)"


class LlamaBuildError(RuntimeError):
    """The llama.cpp sources could not be fetched or built; the message says which step failed."""


def cache_root() -> Path:
    explicit = os.environ.get("SPECOPS_LLAMA_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("SPECOPS_CACHE_DIR") or Path.home() / ".cache" / "specops"
    return Path(base) / "llama.cpp"


def version_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / version


def cpu_flags() -> str:
    """A digest of the CPU's instruction-set flags: a GGML_NATIVE build is only valid on them."""
    text = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                text = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{text}".encode()).hexdigest()[:16]


def _build_key(version: str) -> dict:
    return {"version": version, "cmake_flags": list(CMAKE_FLAGS), "targets": list(TARGETS),
            "cpu_flags": cpu_flags()}


def read_build_info(version: str = LLAMA_CPP_PYTHON_VERSION) -> dict | None:
    try:
        return json.loads((version_dir(version) / "build-info.json").read_text())
    except (OSError, ValueError):
        return None


def cached_build_ok(version: str = LLAMA_CPP_PYTHON_VERSION) -> bool:
    """True when the cache holds every target, built with today's flags for this CPU."""
    info = read_build_info(version)
    if not info or any(info.get(k) != v for k, v in _build_key(version).items()):
        return False
    return all(os.access(version_dir(version) / "bin" / t, os.X_OK) for t in TARGETS)


def find_binary(name: str = "llama-server", version: str = LLAMA_CPP_PYTHON_VERSION) -> str | None:
    """Path of a llama.cpp binary: the env override, else the cached build, else None."""
    if name not in ENV_OVERRIDES:
        raise ValueError(f"unknown llama.cpp binary {name!r}; one of {sorted(ENV_OVERRIDES)}")
    explicit = os.environ.get(ENV_OVERRIDES[name])
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise LlamaBuildError(f"${ENV_OVERRIDES[name]}={explicit} is not an executable file")
        return explicit
    path = version_dir(version) / "bin" / name
    return str(path) if os.access(path, os.X_OK) else None


def binary_version(path: str, timeout_s: float = 30.0) -> str:
    """The binary's ``--version`` text (llama.cpp prints it on stderr)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s)
    return (out.stdout + out.stderr).strip()


def _run(argv: list[str], step: str, cwd: Path | None = None, log=None) -> None:
    print(f"llamacpp_build: {step}: {' '.join(argv)}", file=log or sys.stderr, flush=True)
    proc = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise LlamaBuildError(f"{step} failed (exit {proc.returncode}):\n{tail}")


def download_sources(version: str, dest: Path) -> Path:
    """Fetch the sdist with pip and return the vendored llama.cpp folder inside it."""
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          "--dest", str(dest), f"{SDIST_PACKAGE}=={version}"],
         "pip download")
    archives = sorted(dest.glob("*.tar.gz"))
    if not archives:
        raise LlamaBuildError(f"pip download left no sdist in {dest}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(dest, filter="data")
    found = sorted(dest.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise LlamaBuildError(f"{archives[0].name} carries no vendor/llama.cpp tree")
    return found[0].parent


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, force: bool = False,
          source_dir: Path | None = None) -> Path:
    """Build (or reuse) the cached binaries; returns the ``bin`` folder."""
    out = version_dir(version)
    if not force and cached_build_ok(version):
        return out / "bin"
    if shutil.which("cmake") is None:
        raise LlamaBuildError("cmake is not installed (apt-get install cmake)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specops-llama-") as tmp:
        tmp_path = Path(tmp)
        src = Path(source_dir) if source_dir else download_sources(version, tmp_path / "src")
        build_dir = tmp_path / "build"
        _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], "cmake configure")
        _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
              "--target", *TARGETS], "cmake build")
        staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            (staging / "bin").mkdir(parents=True)
            for target in TARGETS:
                built = build_dir / "bin" / target
                if not built.is_file():
                    raise LlamaBuildError(f"cmake build produced no {built}")
                shutil.copy2(built, staging / "bin" / target)
            info = dict(_build_key(version), build_seconds=round(time.monotonic() - started, 1),
                        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        llama_version=binary_version(str(staging / "bin" / "llama-server")))
            (staging / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)  # the cache is either the old build or the complete new one
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out / "bin"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specops.bench.llamacpp_build",
                                 description="Build llama.cpp's llama-server / llama-bench / llama-cli "
                                             "from the llama-cpp-python sdist into a cache.")
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache is valid")
    ap.add_argument("--source-dir", type=Path, help="an unpacked llama.cpp tree instead of the sdist")
    ap.add_argument("--print-path", metavar="BINARY", help="print a binary's path and exit (1 if not built)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    if args.print_path:
        try:
            path = find_binary(args.print_path, args.version)
        except (ValueError, LlamaBuildError) as exc:
            ap.error(str(exc))
        if path is None:
            print(f"{args.print_path} is not built; run {BUILD_HINT}", file=sys.stderr)
            return 1
        print(path)
        return 0
    try:
        bin_dir = build(args.version, jobs=args.jobs, force=args.force, source_dir=args.source_dir)
    except LlamaBuildError as exc:
        print(f"llamacpp_build: {exc}", file=sys.stderr)
        return 1
    info = read_build_info(args.version) or {}
    version = (info.get("llama_version") or "?").splitlines()[0]
    print(f"llama.cpp binaries in {bin_dir} ({version}; built in {info.get('build_seconds', '?')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
