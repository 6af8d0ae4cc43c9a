"""The services the scenarios share: one append-only Redis, one ``specops serve`` (API key set)
and one ``specops controller run`` (webhook token set), all on free 127.0.0.1 ports.

Started once (loading the models is the slow part), stopped by PID in `Rig.close`.
The secrets are random per run; the scenarios grep the captured logs for them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specops.chaos.procs import (
    ROOT,
    ChaosSetupError,
    Proc,
    free_port,
    specops_argv,
    specops_env,
    start,
    start_redis,
    wait_until,
)

NAMESPACE = "chaos"
POLICY = ROOT / "examples" / "policies" / "default.yaml"


@dataclass
class Rig:
    workdir: Path
    # random per run unless given (the test passes its own, then greps the logs for them)
    api_key: str = field(default_factory=lambda: os.environ.get("SPECOPS_CHAOS_API_KEY")
                         or "sk-chaos-" + secrets.token_hex(12))
    webhook_token: str = field(default_factory=lambda: os.environ.get("SPECOPS_CHAOS_WEBHOOK_TOKEN")
                               or "wh-chaos-" + secrets.token_hex(12))
    redis: Proc | None = None
    serve: Proc | None = None
    controller: Proc | None = None
    redis_dir: Path | None = None
    redis_port: int = 0

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def start_redis(self) -> Proc:
        self.redis_dir = self.redis_dir or self.workdir / "redis"
        self.redis = start_redis(self.redis_dir, self.redis_port or None)
        self.redis_port = self.redis.port
        return self.redis

    def ensure_redis(self) -> None:
        if self.redis is None or not self.redis.alive():
            self.start_redis()

    def ensure_serve(self, timeout_s: float = 240.0) -> Proc:
        if self.serve is not None and self.serve.alive():
            return self.serve
        self.ensure_redis()
        port = free_port()
        argv = specops_argv("serve", "--port", str(port), "--redis", self.redis_url, "--namespace", NAMESPACE,
                            "--max-batch", "2", "--max-queue", "4", "--kv-cache-mb", "16", "--reconcile-s", "1",
                            "--threads", "1", "--api-key-env", "SPECOPS_CHAOS_API_KEY", "--log-level", "info")
        self.serve = start("serve", argv, self.workdir / "serve", port,
                           env=specops_env(SPECOPS_CHAOS_API_KEY=self.api_key), timeout_s=120)
        wait_until(lambda: self._ready_or_fail(), "specops serve to be ready", timeout_s, every_s=0.5)
        return self.serve

    def _ready_or_fail(self) -> bool:
        if not self.serve.alive():
            raise ChaosSetupError(f"specops serve exited:\n{self.serve.log()}")
        return httpx.get(f"{self.serve.url}/readyz", timeout=5).status_code == 200

    def ready(self) -> dict:
        return httpx.get(f"{self.serve.url}/readyz", timeout=5).json()

    def ensure_controller(self) -> Proc:
        if self.controller is not None and self.controller.alive():
            return self.controller
        self.ensure_redis()
        port = free_port()
        argv = specops_argv("controller", "run", "--policy", str(POLICY), "--redis", self.redis_url,
                            "--namespace", NAMESPACE, "--interval", "1", "--listen", f"127.0.0.1:{port}")
        self.controller = start("controller", argv, self.workdir / "controller", port,
                                env=specops_env(SPECOPS_WEBHOOK_TOKEN=self.webhook_token), timeout_s=60)
        return self.controller

    def logs(self) -> str:
        """Everything the rig's processes wrote (for the secret grep)."""
        parts = []
        for path in sorted(self.workdir.rglob("*.log")):
            parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def close(self) -> None:
        for proc in (self.controller, self.serve, self.redis):
            if proc is not None:
                try:
                    proc.stop(timeout_s=20)
                except Exception:  # keep stopping the others
                    pass
