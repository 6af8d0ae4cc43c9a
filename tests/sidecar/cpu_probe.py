"""The sidecar's own CPU time per streamed request and per chunk (not a test; run it by hand).

    python -m tests.sidecar.cpu_probe [--requests 200] [--chunks 1,65] [--concurrency 1]

Starts a fake engine (a raw asyncio server in a subprocess that streams ``specops
serve``-shaped ``/v1/completions`` SSE events, chunked, one write per event a few
hundred µs apart) and a real ``specops sidecar`` process in front of it, sends the
same streamed requests through it from this process, and reads the sidecar's
CPU time (its threads' ``/proc/<pid>/task/*/schedstat``) before and after each batch. CPU time of
one process does not depend on how loaded the machine is (unlike wall-clock
latencies), so the figures are comparable between runs on a busy machine.

With two chunk counts ``a < b`` per request it reports CPU per request at each and
the fit ``per_chunk = (cpu(b) − cpu(a)) / (b − a)``, ``per_request = cpu(a) − a ×
per_chunk``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.services import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "examples" / "policies" / "default.yaml"


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _engine(port: int, gap_s: float) -> None:
    """A fake engine: POST body {"max_tokens": n} → n content events, a usage event, [DONE]."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                raw = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    data = b'{"ok":true}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(data) + data)
                    continue
                n = int(json.loads(raw).get("max_tokens", 16))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                base = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1787366173,
                        "model": "bundled"}
                for i in range(n):
                    final = i == n - 1
                    ev = dict(base, choices=[{"index": 0, "text": f" tok{i}", "logprobs": None,
                                              "finish_reason": "length" if final else None}], usage=None)
                    if final:
                        ev["specops"] = {"method": "draft", "drafted": 3 * n, "accepted": n, "gamma": 3}
                    writer.write(_chunk(_event(ev)))
                    await asyncio.sleep(gap_s)
                writer.write(_chunk(_event(dict(base, choices=[], usage={
                    "prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5},
                    specops={"method": "draft", "drafted": 3 * n, "accepted": n, "gamma": 3}))))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _cpu_s(pid: int) -> float:
    from specops.bench.sidecar_overhead import _proc_cpu_s

    return _proc_cpu_s(pid)  # its threads' run time, ns resolution (schedstat)


async def _client(port: int, n_requests: int, chunks: int, concurrency: int) -> int:
    """Streamed requests through the sidecar over keep-alive connections; returns body bytes read."""
    body = json.dumps({"model": "bundled", "prompt": "Hello there, how are you", "max_tokens": chunks,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(body)) + body
    left = [n_requests]
    total = [0]

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            while True:  # chunked body
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data = await reader.readexactly(size + 2)
                total[0] += size
                if size == 0:
                    break
            assert data == b"\r\n"
        writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total[0]


def _start_sidecar(root: Path, eport: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-m", "specops.cli", "sidecar", "--engine", "specops", "--upstream",
                             f"spec=http://127.0.0.1:{eport}", "--policy", str(POLICY), "--listen",
                             f"127.0.0.1:{port}", "--log-level", "warning", "--scrape-s", "3600"],
                            cwd=root, env=env)
    return proc, port


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunks", default="1,65", help="two content-chunk counts per request")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--gap-ms", type=float, default=0.3, help="engine pause between events")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the minimum is reported")
    ap.add_argument("--compare", default=None, metavar="TREE",
                    help="also run the sidecar of another source tree (e.g. a `git archive` of main), "
                         "in alternating rounds against the same engine")
    ap.add_argument("--profile", default=None,
                    help="py-spy raw profile (or strace:PATH, syscall counts) of the sidecar, b-chunk streams")
    ap.add_argument("--engine-only", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_only:
        asyncio.run(_engine(args.engine_only, args.gap_ms / 1000))
        return
    a, b = (int(x) for x in args.chunks.split(","))
    eport = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "tests.sidecar.cpu_probe", "--engine-only", str(eport),
                               "--gap-ms", str(args.gap_ms)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    trees = {"this tree": ROOT}
    if args.compare:
        trees[args.compare] = Path(args.compare).resolve()
    sides = {label: _start_sidecar(root, eport) for label, root in trees.items()}
    try:
        wait_for_port(eport, 30)
        for proc, port in sides.values():
            wait_for_port(port, 60, proc)
            asyncio.run(_client(port, 20, b, args.concurrency))  # warm-up
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.rounds):
            for label, (proc, port) in sides.items():
                for n in (a, b):
                    t0 = _cpu_s(proc.pid)
                    asyncio.run(_client(port, args.requests, n, args.concurrency))
                    cpu = (_cpu_s(proc.pid) - t0) / args.requests
                    best[label, n] = min(best.get((label, n), cpu), cpu)
        if args.profile:
            proc, port = sides["this tree"]
            spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-f", "raw", "-r", "400", "-o",
                                    args.profile, "--nonblocking"], stdout=subprocess.DEVNULL) \
                if not args.profile.startswith("strace:") else \
                subprocess.Popen(["strace", "-c", "-f", "-o", args.profile[7:], "-p", str(proc.pid)])
            time.sleep(1)
            asyncio.run(_client(port, args.requests, b, args.concurrency))
            spy.send_signal(2)
            spy.wait(30)
        print(f"sidecar CPU (min of {args.rounds} rounds, {args.requests} requests each, concurrency "
              f"{args.concurrency}, load {os.getloadavg()[0]:.2f}):")
        for label in sides:
            per_chunk = (best[label, b] - best[label, a]) / (b - a)
            per_req = best[label, a] - a * per_chunk
            print(f"  {label}: {a} chunks {best[label, a] * 1e3:.3f} ms/request, {b} chunks "
                  f"{best[label, b] * 1e3:.3f} ms/request -> {per_chunk * 1e3:.4f} ms/chunk + "
                  f"{per_req * 1e3:.3f} ms/request")
    finally:
        for proc in [p for p, _ in sides.values()] + [engine]:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
