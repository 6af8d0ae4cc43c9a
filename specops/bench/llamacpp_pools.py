"""Two ``llama-server`` pools (speculative and plain) on one GGUF model, launched with the
flags ``specops engine-config --engine llamacpp`` renders from a policy.

Used by ``specops bench sidecar --engine llamacpp`` and the end-to-end test
(tests/sidecar/test_llamacpp_e2e.py). `POLICY` is their two-class policy:

* ``creative`` — sampled requests (temperature ≥ 0.5): n-gram drafts are rarely what a
  temperature-1 sampler picks, so speculation costs verification work for nothing;
* ``code`` — everything else (greedy): n-gram drafting from the context pays on code.

Both speculate with n-gram lookup (``--spec-type ngram-simple``) on the spec pool; the
controller's ``low-acceptance`` rule is what moves ``creative`` to the plain pool.
`policy_text(routed=True)` is the state that decision leads to (``creative`` with
``method: off``), for measuring routing without a controller.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from specops.bench.llamacpp_build import BUILD_HINT, find_binary
from specops.policies import load_policy
from specops.sidecar.engine_config import render

GAMMA = 8
POLICY = f"""\
version: "llamacpp-pools"
description: Two classes on llama-server pools - greedy code speculates, temperature-1 sampling does not pay.
default_class: code
classes:
  - name: creative
    match:
      - temperature: {{min: 0.5, max: 2.0}}
    method: ngram
    gamma: {{initial: {GAMMA}, min: 2, max: {GAMMA}}}
    temperature: {{min: 0.0, max: 2.0}}
    adaptation: {{mode: fixed, probe_fraction: 0.2}}
  - name: code
    method: ngram
    gamma: {{initial: {GAMMA}, min: 2, max: {GAMMA}}}
    temperature: {{min: 0.0, max: 2.0}}
    adaptation: {{mode: fixed, probe_fraction: 0.2}}
upstreams: {{spec: spec, plain: plain, failover: false}}
alerts:
  - name: low-acceptance
    metric: acceptance_rate
    op: "<"
    threshold: 0.15
    for_s: 2
    min_samples: 40
    action: fallback
    severity: warning
"""


class PoolError(RuntimeError):
    """A llama-server pool could not be started (the message carries its log's tail)."""


def policy_text(routed: bool = False) -> str:
    """`POLICY`; ``routed``: with ``creative`` fallen back for good (``method: off``)."""
    if not routed:
        return POLICY
    head, _, tail = POLICY.partition("  - name: code")
    return head.replace("method: ngram", 'method: "off"') + "  - name: code" + tail


def write_policy(path: Path, routed: bool = False) -> Path:
    path.write_text(policy_text(routed))
    load_policy(path)  # a policy this module cannot load is a bug here, not later in a subprocess
    return path


def pool_args(policy_path: Path, pool: str, threads: int, parallel: int) -> list[str]:
    """llama-server arguments of one pool, rendered by ``engine-config --engine llamacpp``."""
    return render("llamacpp", load_policy(policy_path), pool=pool, threads=threads, parallel=parallel)


@dataclass
class Pool:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)


def llama_server() -> str:
    path = find_binary("llama-server")
    if path is None:
        raise PoolError(f"llama-server is not built: {BUILD_HINT}")
    return path


def start_pool(name: str, model: Path, port: int, args: list[str], workdir: Path, *, ctx: int = 4096,
               timeout_s: float = 60.0, binary: str | None = None) -> Pool:
    """Start one llama-server and wait until ``/health`` answers 200 (model loaded)."""
    log_path = workdir / f"llama-{name}.log"
    argv = [binary or llama_server(), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(ctx), "--no-webui", *args]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, LLAMA_LOG_COLORS="off"))
    pool = Pool(name, proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PoolError(f"llama-server pool {name} exited with code {proc.returncode}:\n{pool.log_tail()}")
        try:
            if httpx.get(f"{pool.url}/health", timeout=2).status_code == 200:
                return pool
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pool.stop()
    raise PoolError(f"llama-server pool {name} not healthy after {timeout_s:.0f}s:\n{pool.log_tail()}")


def bundled_gguf() -> Path:
    """The bundled target model as GGUF (converted once, cached; needs the ``gguf`` package)."""
    from specops.assets import ASSETS_DIR
    from specops.bench.gguf_convert import ensure_gguf

    return ensure_gguf(ASSETS_DIR / "target", out_type="float32")
