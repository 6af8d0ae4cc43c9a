"""``make gpu-check``: everything a session with a lent GPU should run once, in one script.

Steps (each recorded in one JSON, then printed as a table):

1. ``cuda-tests``   — the CUDA tests (the Triton kernels compiled and compared with their
   PyTorch references, the fast runner's CUDA tests that skip on a CPU);
2. ``kernels``      — `specops.kernels.bench` at real sizes (tree attention against SDPA
   with a mask at T=64, L=16k; kv_compact against copy bandwidth) with the kernels issue's goals;
3. ``decode-bundled`` — `specops bench decode` with the bundled models (every method
   against ``ar``, exactness checked; the benchmark loads this tiny pair on the CPU);
4. ``decode-1b``    — a randomly initialised ~1B-parameter Llama target: its verify-cost
   curve c(T)/c(1) for T <= 64 and ``ngram`` / ``auto`` against ``ar``, exactness checked.

``--dry-run`` runs the same code on the CPU at toy sizes (a 2-layer random Llama, 2 prompts,
8 tokens) and skips the CUDA-only steps, so `make test` keeps the script working
(tests/bench/test_gpu_check.py). On one GPU the full run takes a few minutes (budget: 8).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)  # ~1.1B (TinyLlama shape)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512)
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _step(name: str, fn, results: list[dict]) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        status = "ok" if not (isinstance(detail, dict) and detail.get("skipped")) else "skipped"
    except Exception as exc:  # one failing step must not hide the others' results
        detail, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
    results.append({"step": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "detail": detail})


def cuda_tests(dry_run: bool) -> dict:
    if dry_run or not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels", "tests/decoder/test_runner_fast.py",
           "tests/decoder/test_review_fixes.py", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    tail = proc.stdout.strip().splitlines()[-3:]
    if proc.returncode:
        raise RuntimeError("CUDA tests failed: " + " | ".join(tail))
    return {"summary": tail[-1] if tail else ""}


def kernels(dry_run: bool) -> dict:
    if dry_run or not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    from specops.kernels.bench import KernelBenchConfig, run_kernel_bench

    report = run_kernel_bench(KernelBenchConfig(nodes=(8, 64), prefixes=(1024, 16384)))
    return report.to_json()


def decode_bundled(dry_run: bool) -> dict:
    from specops.bench.decode import BenchConfig, format_table, run_benchmark

    cfg = BenchConfig(suite="code", methods=["hf-greedy", "ar", "draft", "ngram", "medusa", "auto"],
                      max_new_tokens=8 if dry_run else 64, repeats=1 if dry_run else 3, limit=2 if dry_run else 8,
                      threads=1 if dry_run else 4, progress=False)
    report = run_benchmark(cfg)  # `bench decode` loads the bundled pair on the CPU; decode-1b runs on `device`
    return {"table": format_table(report), "results": report["results"], "device": "cpu"}


def decode_random(dry_run: bool, device: str) -> dict:
    """A random Llama target on ``device``: verify-cost curve and ngram / auto against ar."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specops.decoder import Decoder
    from specops.decoder.tree_size import measure_verify_cost

    torch.manual_seed(0)
    shape = TOY if dry_run else ONE_B
    dtype = torch.float32 if dry_run else torch.bfloat16
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    model = model.to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    dec = Decoder(model, max_context=shape["max_position_embeddings"])
    sizes = CURVE_SIZES[:4] if dry_run else CURVE_SIZES
    with torch.inference_mode():
        curve = measure_verify_cost(dec.target, sizes=sizes, prefix_len=32 if dry_run else 256, repeats=3)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, shape["vocab_size"], (24,), generator=gen).tolist()
    prompts = [base * 4, base[:12] * 6]  # repetitive: prompt lookup has something to find
    new = 8 if dry_run else 96
    rows = {}
    for method in ("ar", "ngram", "auto"):
        seconds, exact, outputs = 0.0, True, []
        for prompt in prompts:
            t0 = time.perf_counter()
            out = dec.generate(prompt, method=method, max_new_tokens=new)
            seconds += time.perf_counter() - t0
            outputs.append(out.tokens)
        rows[method] = {"tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs}
    for method, row in rows.items():
        row["exact"] = row.pop("outputs") == rows["ar"].get("outputs", None) if method != "ar" else True
    ar_tps = rows["ar"]["tokens_per_s"]
    for row in rows.values():
        row["vs_ar"] = round(row["tokens_per_s"] / ar_tps, 3)
    rows["ar"].pop("outputs", None)
    return {"parameters": params, "dtype": str(dtype), "device": device,
            "verify_relative": {str(t): round(curve.relative(t), 3) for t in sizes}, "methods": rows}


def format_results(results: list[dict]) -> str:
    lines = [f"{'step':<16} {'status':<8} {'seconds':>8}  detail", "-" * 72]
    for r in results:
        d = r["detail"]
        if r["status"] == "skipped":
            detail = d["skipped"]
        elif r["status"] == "failed":
            detail = d["error"][:120]
        elif r["step"] == "decode-1b":
            curve = " ".join(f"c({t})={v:.2f}" for t, v in d["verify_relative"].items())
            speed = " ".join(f"{m} {v['vs_ar']:.2f}x{'' if v['exact'] else ' INEXACT'}" for m, v in d["methods"].items())
            detail = f"{d['parameters'] / 1e6:.0f}M params; {curve}; vs ar: {speed}"
        elif r["step"] == "decode-bundled":
            detail = " ".join(f"{x['method']} {x['speedup_vs_ar']:.2f}x" for x in d["results"]
                              if x.get("speedup_vs_ar") is not None)
        elif r["step"] == "kernels":
            detail = "; ".join(f"{g['goal']}: {'met' if g['met'] else 'NOT met'}" for g in d.get("goals", []))
        else:
            detail = str(d.get("summary", ""))
        lines.append(f"{r['step']:<16} {r['status']:<8} {r['seconds']:>8.1f}  {detail}")
    return "\n".join(lines)


def run(dry_run: bool) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    results: list[dict] = []
    _step("cuda-tests", lambda: cuda_tests(dry_run), results)
    _step("kernels", lambda: kernels(dry_run), results)
    _step("decode-bundled", lambda: decode_bundled(dry_run), results)
    _step("decode-1b", lambda: decode_random(dry_run, device), results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU; skip the CUDA-only steps")
    parser.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "specops_gpu_check.json")
    args = parser.parse_args(argv)
    results = run(args.dry_run)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"dry_run": args.dry_run, "results": results}, indent=2, default=str) + "\n")
    print(format_results(results))
    print(f"wrote {args.json}")
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
