"""``make gpu-check``: everything a session with a lent GPU should run once, in one script.

Steps (each recorded in one JSON, then printed as a table):

1. ``cuda-tests``   — the CUDA tests (the Triton kernels compiled and compared with their
   PyTorch references, the fast runner's CUDA tests that skip on a CPU);
2. ``kernels``      — `specops.kernels.bench` at real sizes (tree attention against SDPA
   with a mask at T=64, L=16k; kv_compact against copy bandwidth) with the kernels issue's goals;
3. ``decode-bundled`` — `specops bench decode --device cuda` with the bundled models (every
   method against ``ar`` and hf-greedy, exactness checked, the verify-cost curve);
4. ``decode-1b``    — a randomly initialised ~1B-parameter Llama target in bf16: its T=1
   forward time and verify-cost curve c(T)/c(1) for T <= 64, ``hf-greedy`` / ``ngram`` /
   ``auto`` against ``ar``; exactness checked in bf16 (a mismatch shows the top-2 logit gap
   where it starts) and again in fp32, the verdict.

``--dry-run`` runs the same code on the CPU at toy sizes (a 2-layer random Llama, 2 prompts,
8 tokens) and skips the CUDA-only steps, so `make test` keeps the script working
(tests/bench/test_gpu_check.py). On one GPU the full run takes a few minutes (budget: 8).
``--prompts FILE`` gives decode-bundled its prompts where this Python lacks the stdlib tests
that the code suite is cut from. The JSON is rewritten after each step and the CUDA tests'
whole output is kept beside it (``<json>.pytest.log``), so a run cut short keeps the steps
it finished.

On a GPU machine whose ``python3`` already has a CUDA torch, transformers and triton (no
package index needed): ``make gpu-check GPU_PYTHON=python3`` runs from the source tree.
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
CUDA_TESTS = ("tests/kernels", "tests/decoder/test_runner_fast.py", "tests/decoder/test_request_validation.py")
CUDA_TESTS_TIMEOUT_S = 240


def _step(name: str, fn, results: list[dict]) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        status = "ok" if not (isinstance(detail, dict) and detail.get("skipped")) else "skipped"
    except Exception as exc:  # one failing step must not hide the others' results
        detail, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
    results.append({"step": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "detail": detail})


def cuda_tests(dry_run: bool, log_path: Path) -> dict:
    if dry_run or not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", *CUDA_TESTS, "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CUDA_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        log_path.write_text(_text(exc.stdout) + _text(exc.stderr))
        raise RuntimeError(f"CUDA tests still running after {CUDA_TESTS_TIMEOUT_S} s (log: {log_path})") from None
    log_path.write_text(proc.stdout + proc.stderr)  # every failure's traceback, for the note
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    skips = [line for line in lines if line.startswith("SKIPPED")]
    if proc.returncode:
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        raise RuntimeError(f"CUDA tests failed: {summary} | " + " | ".join(failed[:6]) + f" (log: {log_path})")
    return {"summary": summary, "skipped_tests": skips, "log": str(log_path)}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def kernels(dry_run: bool) -> dict:
    if dry_run or not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    from specops.kernels.bench import KernelBenchConfig, run_kernel_bench

    report = run_kernel_bench(KernelBenchConfig(nodes=(8, 64), prefixes=(1024, 16384)))
    return report.to_json()


def decode_bundled(dry_run: bool, device: str, prompts_file: Path | None = None) -> dict:
    from specops.bench.decode import BenchConfig, format_table, run_benchmark

    cfg = BenchConfig(suite="code", methods=["hf-greedy", "ar", "draft", "ngram", "medusa", "auto"],
                      max_new_tokens=8 if dry_run else 64, repeats=1 if dry_run else 3, limit=2 if dry_run else 8,
                      threads=1 if dry_run else 4, device=device, progress=False,
                      prompts_file=str(prompts_file) if prompts_file else None)
    report = run_benchmark(cfg)
    return {"table": format_table(report), "results": report["results"], "costs": report.get("costs"),
            "device": report["machine"]["device"]}


def decode_random(dry_run: bool, device: str) -> dict:
    """A random Llama target on ``device``: verify-cost curve, hf-greedy / ngram / auto against
    ar, exactness checked in the timed dtype (bf16 on a GPU) and again in fp32.

    A random model's logits have close top-2 pairs everywhere, and bf16 rounds a forward over
    T positions differently from T forwards of one: a bf16 mismatch is reported with the top-2
    gap where it first diverges (a near-tie is rounding, not a lossless-ness bug), and the fp32
    pass is the exactness verdict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specops.decoder import Decoder
    from specops.spec.clock import device_clock
    from specops.spec.tree_size import measure_verify_cost

    torch.manual_seed(0)
    shape = TOY if dry_run else ONE_B
    dtype = torch.float32 if dry_run else torch.bfloat16
    with torch.device(device):  # initialised where it runs: ~1B parameters take minutes to initialise on a CPU
        model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    model = model.to(dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    dec = Decoder(model, max_context=shape["max_position_embeddings"])
    sizes = CURVE_SIZES[:4] if dry_run else CURVE_SIZES
    with torch.inference_mode():
        curve = measure_verify_cost(dec.target, sizes=sizes, prefix_len=32 if dry_run else 256, repeats=3)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, shape["vocab_size"], (24,), generator=gen).tolist()
    prompts = [base * 4, base[:12] * 6]  # repetitive: prompt lookup has something to find
    new = 8 if dry_run else 96

    def hf_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=device)  # [1, P]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)  # [1, P + N]
        return out[0, len(prompt):].tolist()

    def run(method: str, prompt: list[int], n: int) -> list[int]:
        if method == "hf-greedy":
            return hf_greedy(prompt, n)
        return list(dec.generate(prompt, method=method, max_new_tokens=n).tokens)

    rows: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for method in ("hf-greedy", "ar", "ngram", "auto"):
        run(method, prompts[0], min(16, new))  # untimed: lazy init, auto's calibration
        seconds, outputs[method] = 0.0, []
        for prompt in prompts:
            t0 = device_clock(model.device)
            outputs[method].append(run(method, prompt, new))
            seconds += device_clock(model.device) - t0
        rows[method] = {"tokens_per_s": round(sum(map(len, outputs[method])) / seconds, 1)}
    for method, row in rows.items():
        row["vs_ar"] = round(row["tokens_per_s"] / rows["ar"]["tokens_per_s"], 3)
        row["exact"] = outputs[method] == outputs["ar"]
        if not row["exact"]:
            row["divergence"] = _first_divergence(model, prompts, outputs["ar"], outputs[method])
    result = {"parameters": params, "dtype": str(dtype), "device": device,
              "forward_ms": {str(t): round(curve.at(t) * 1e3, 3) for t in sizes},
              "verify_relative": {str(t): round(curve.relative(t), 3) for t in sizes}, "methods": rows}
    if dtype != torch.float32:  # the exactness verdict, where rounding cannot flip a near-tie
        model = model.float()
        dec = Decoder(model, max_context=shape["max_position_embeddings"])
        n32 = min(new, 64)
        ref = [dec.generate(p, method="ar", max_new_tokens=n32).tokens for p in prompts]
        result["exact_fp32"] = {m: [dec.generate(p, method=m, max_new_tokens=n32).tokens for p in prompts] == ref
                                for m in ("ngram", "auto")}
        result["exact_fp32"]["hf-greedy"] = [hf_greedy(p, n32) for p in prompts] == ref
    return result


def _first_divergence(model, prompts, want: list[list[int]], got: list[list[int]]) -> dict:
    """Where ``got`` first leaves ``want``, and the gap between the reference's top two logits
    there (by a plain forward over the prompt and ``want``'s tokens before that position)."""
    for i, (prompt, a, b) in enumerate(zip(prompts, want, got)):
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) == len(b):
            continue
        pos = min(len(a), len(b)) if pos is None else pos
        ids = torch.tensor([prompt + a[:pos]], device=model.device)  # [1, P + pos]
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].float()  # [V]
        top = logits.topk(2).values
        return {"prompt": i, "position": pos, "top2_gap": round(float(top[0] - top[1]), 5),
                "max_abs_logit": round(float(logits.abs().max()), 3)}
    return {}


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
            speed = " ".join(f"{m} {v['vs_ar']:.2f}x{'' if v['exact'] else ' differs'}" for m, v in d["methods"].items())
            detail = (f"{d['parameters'] / 1e6:.0f}M params {d['dtype'].split('.')[-1]}; ar "
                      f"{d['methods']['ar']['tokens_per_s']:.1f} tok/s, T=1 forward {d['forward_ms']['1']:.2f} ms; "
                      f"{curve}; vs ar: {speed}")
            if "exact_fp32" in d:
                detail += "; fp32 exact: " + " ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in d["exact_fp32"].items())
        elif r["step"] == "decode-bundled":
            detail = " ".join(f"{x['method']} {x['speedup_vs_ar']:.2f}x" for x in d["results"]
                              if x.get("speedup_vs_ar") is not None)
        elif r["step"] == "kernels":
            detail = "; ".join(f"{g['goal']}: {'met' if g['met'] else 'NOT met'}" for g in d.get("goals", []))
        else:
            detail = str(d.get("summary", ""))
        lines.append(f"{r['step']:<16} {r['status']:<8} {r['seconds']:>8.1f}  {detail}")
    return "\n".join(lines)


def run(dry_run: bool, json_path: Path | None = None, prompts_file: Path | None = None) -> list[dict]:
    """Every step in turn; with ``json_path``, the JSON is rewritten and the step's row printed
    after each step, so a run stopped part-way (a device lease ending) keeps what it finished."""
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    results: list[dict] = []
    log_path = (json_path or Path(tempfile.gettempdir()) / "specops_gpu_check.json").with_suffix(".pytest.log")
    steps = (("cuda-tests", lambda: cuda_tests(dry_run, log_path)),
             ("kernels", lambda: kernels(dry_run)),
             ("decode-bundled", lambda: decode_bundled(dry_run, device, prompts_file)),
             ("decode-1b", lambda: decode_random(dry_run, device)))
    print(format_results([]).splitlines()[0], flush=True)
    for name, fn in steps:
        _step(name, fn, results)
        print(format_results(results[-1:]).splitlines()[-1], flush=True)
        if json_path is not None:
            _write(json_path, dry_run, results, device)
    return results


def _write(path: Path, dry_run: bool, results: list[dict], device: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    path.write_text(json.dumps({"dry_run": dry_run, "device": device, "gpu": gpu, "torch": torch.__version__,
                               "results": results}, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU; skip the CUDA-only steps")
    parser.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "specops_gpu_check.json")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="decode-bundled's prompts (JSONL, `python -m specops.bench.suites --suite code --out F`) "
                             "where this Python lacks the stdlib tests that the code suite is cut from")
    args = parser.parse_args(argv)
    results = run(args.dry_run, args.json, args.prompts)
    print()
    print(format_results(results))
    bundled = next((r for r in results if r["step"] == "decode-bundled" and r["status"] == "ok"), None)
    if bundled is not None:
        print(f"\ndecode-bundled on {bundled['detail']['device']}:\n{bundled['detail']['table']}")
    print(f"wrote {args.json}")
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
