"""Clients that disconnect mid-stream N times: sequences and KV blocks left behind.

Each client opens a streamed completion, reads the first chunk, and closes the
connection. After the run (bounded wait for the engine to go idle) the server's
``/metrics`` must show no running sequence and no KV block in use.
"""

from __future__ import annotations

import httpx

from specops.chaos.procs import wait_until
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import Rig

NAME = "client disconnecting mid-stream"


def _gauges(rig: Rig) -> dict[str, float]:
    text = httpx.get(f"{rig.serve.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("specops_serving_running", "specops_serving_kv_blocks_used", "specops_serving_waiting"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


def run(rig: Rig, *, clients: int) -> ScenarioResult:
    rig.ensure_serve()
    cut, errors = 0, []
    body = {"prompt": "def long_function(x):", "max_tokens": 200, "temperature": 0, "stream": True}
    for _ in range(clients):
        try:
            with httpx.Client(timeout=60, headers=rig.auth) as c:
                with c.stream("POST", f"{rig.serve.url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(str(r.status_code))
                        continue
                    for chunk in r.iter_bytes():
                        if chunk:
                            cut += 1
                            break  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:
            errors.append(repr(exc))
    try:
        idle = wait_until(lambda: (lambda g: g if g.get("specops_serving_running") == 0
                                   and g.get("specops_serving_kv_blocks_used") == 0 else None)(_gauges(rig)),
                          "the engine to free every disconnected sequence", 60)
    except TimeoutError:
        idle = _gauges(rig)
    leaked_seqs = int(idle.get("specops_serving_running", -1))
    leaked_blocks = int(idle.get("specops_serving_kv_blocks_used", -1))
    figures = {"disconnects": cut, "errors": len(errors), "leaked_sequences": leaked_seqs,
               "leaked_kv_blocks": leaked_blocks}
    met = cut == clients and leaked_seqs == 0 and leaked_blocks == 0 and not errors
    return ScenarioResult(NAME, figures, "0 leaked sequences / 0 leaked KV blocks", met, notes=errors[:3])
