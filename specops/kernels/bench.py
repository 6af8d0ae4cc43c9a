"""``specops bench kernels``: tree attention, Triton vs the fastest PyTorch baselines.

For each (T tree nodes, L prefix) in the grid it times these implementations of the
same attention (B=1, Hq=32, Hkv=8, D=128, bf16 by default):

- ``triton``: ``tree_attention(impl="triton")`` (split-K over the prefix + reduce);
- ``torch``: ``tree_attention(impl="torch")``, the float32 PyTorch reference;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with the [T, L+T]
  boolean tree mask, the fastest of every SDPA backend (flash, efficient, cudnn, math)
  that accepts the call, each tried alone under ``torch.nn.attention.sdpa_kernel`` in
  two forms: K/V heads expanded to Hq with ``repeat_interleave`` (done once, outside the
  timed call: the form the fused backends take with a mask) and ``enable_gqa=True`` on
  the Hkv heads. The row names the backend and form that won (``backend``) and lists
  every candidate's time (``candidates``);
- ``flex``: ``torch.nn.attention.flex_attention`` with a block mask built from the tree
  (``enable_gqa=True``), compiled with ``torch.compile`` (``backend`` ``compiled``), or
  unfused (``eager``) where compiling fails or is switched off.

``sdpa`` and ``flex`` are the baselines: ``vs base`` is the faster of the two's time over
this row's time. Achieved bandwidth counts the bytes an ideal kernel must move (read q,
k, v; write o) over the median time; it is compared with the bandwidth of a large copy
measured in the same run (read + write bytes over time). On CUDA the timing is
``triton.testing.do_bench`` (median, L2 flushed between repetitions). Without a GPU the
command times the baselines and the reference on the CPU (wall-clock medians); ``triton``
runs there only under TRITON_INTERPRET=1 (Triton's interpreter, far too slow to time).
"""

from __future__ import annotations

import functools
import json
import logging
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import click

log = logging.getLogger(__name__)

DEFAULT_NODES = (16, 64, 128)
DEFAULT_PREFIXES = (1024, 4096, 16384)
IMPL_NAMES = ("triton", "torch", "sdpa", "flex")
BASELINES = ("sdpa", "flex")  # what the speedups and goals are taken against: the faster of the two
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")  # torch.nn.attention.SDPBackend members, tried in turn
SDPA_FORMS = ("expanded", "gqa")  # K/V repeated to Hq heads / enable_gqa=True on Hkv heads
FLEX_BACKENDS = ("compiled", "eager")
COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 1 << 28  # the CPU's copy reference: 256 MiB is well past its caches
# Targets at T=64, L=16k: the Triton kernel should beat the fastest baseline by 1.5x and
# reach 60% of the measured copy bandwidth.
GOAL_CASE = (64, 16384)
# Largest difference from the float32 reference for an SDPA candidate to count as a baseline (outputs
# are weighted means of N(0, 1) values, so these are many times the inputs' rounding).
ACCEPT_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
GOAL_SPEEDUP_VS_BASELINE = 1.5
GOAL_FRACTION_OF_COPY = 0.60


@dataclass(frozen=True)
class KernelBenchConfig:
    """What to run: the grid and the attention geometry."""

    nodes: tuple[int, ...] = DEFAULT_NODES  # T values
    prefixes: tuple[int, ...] = DEFAULT_PREFIXES  # L values
    batch: int = 1
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"  # float16 | bfloat16 | float32
    impls: tuple[str, ...] = IMPL_NAMES
    copy_bytes: int = COPY_BYTES  # buffer size of the bandwidth-reference copy
    flex_compile: bool = True  # False: time flex_attention unfused (no torch.compile; tests, quick CPU runs)

    def validate(self) -> None:
        if not self.nodes or any(t < 1 or t > 256 for t in self.nodes):
            raise ValueError(f"every T must be in [1, 256], got {self.nodes}")
        if not self.prefixes or any(p < 0 for p in self.prefixes):
            raise ValueError(f"every L must be >= 0, got {self.prefixes}")
        if self.batch < 1 or self.head_dim < 1 or self.heads_kv < 1:
            raise ValueError("batch, head_dim and heads_kv must be >= 1")
        if self.heads_q % self.heads_kv != 0:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")
        if self.copy_bytes < 1:
            raise ValueError(f"copy_bytes must be >= 1, got {self.copy_bytes}")
        unknown = set(self.impls) - set(IMPL_NAMES)
        if unknown or not self.impls:
            raise ValueError(f"impls must be a non-empty subset of {IMPL_NAMES}, got {self.impls}")


@dataclass(frozen=True)
class KernelBenchRow:
    """One implementation on one (T, L) point."""

    nodes: int
    prefix: int
    impl: str
    ms: float  # median time per call
    gbps: float  # ideal bytes / time
    fraction_of_copy: float  # gbps / measured copy bandwidth
    speedup_vs_baseline: float | None  # fastest baseline's time / this time (None when no baseline ran)
    max_abs_err: float  # vs the float32 reference
    # what ran: sdpa "BACKEND/FORM" (`SDPA_BACKENDS` x `SDPA_FORMS`), flex `FLEX_BACKENDS`,
    # triton "triton" or "interpreter", torch "fp32-reference"
    backend: str = ""
    candidates: dict[str, float] = field(default_factory=dict)  # sdpa: every backend/form that ran -> ms


@dataclass
class KernelBenchReport:
    device: str
    dtype: str
    copy_gbps: float
    config: KernelBenchConfig
    rows: list[KernelBenchRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # impl -> why it was not run

    def row(self, nodes: int, prefix: int, impl: str) -> KernelBenchRow | None:
        for r in self.rows:
            if (r.nodes, r.prefix, r.impl) == (nodes, prefix, impl):
                return r
        return None

    def goals(self) -> list[tuple[str, bool]]:
        """The targets at T=64, L=16k, where that point and the impls they compare were run."""
        tri = self.row(*GOAL_CASE, "triton")
        out = []
        if tri is not None and tri.speedup_vs_baseline is not None:
            out.append((f"triton >= {GOAL_SPEEDUP_VS_BASELINE}x the fastest baseline ({' / '.join(BASELINES)}) "
                        "at T=64, L=16k", tri.speedup_vs_baseline >= GOAL_SPEEDUP_VS_BASELINE))
        if tri is not None:
            out.append((f"triton >= {GOAL_FRACTION_OF_COPY:.0%} of copy bandwidth at T=64, L=16k",
                        tri.fraction_of_copy >= GOAL_FRACTION_OF_COPY))
        return out

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "copy_gbps": self.copy_gbps,
            "config": asdict(self.config),
            "rows": [asdict(r) for r in self.rows],
            "skipped": dict(self.skipped),
            "goals": [{"goal": name, "met": met} for name, met in self.goals()],
        }


def attention_bytes(batch: int, heads_q: int, heads_kv: int, nodes: int, prefix: int, head_dim: int,
                    elem_bytes: int) -> int:
    """Bytes an ideal tree-attention call moves: read q [B,Hq,T,D], k and v
    [B,Hkv,L+T,D], write o [B,Hq,T,D] (the tree mask is negligible)."""
    q_and_o = 2 * batch * heads_q * nodes * head_dim
    k_and_v = 2 * batch * heads_kv * (prefix + nodes) * head_dim
    return (q_and_o + k_and_v) * elem_bytes


def format_table(report: KernelBenchReport) -> str:
    head = (f"tree attention on {report.device}, {report.dtype}, B={report.config.batch} "
            f"Hq={report.config.heads_q} Hkv={report.config.heads_kv} D={report.config.head_dim}; "
            f"copy {report.copy_gbps:.0f} GB/s")
    lines = [head, f"{'T':>5} {'L':>7} {'impl':>7} {'backend':>16} {'ms':>9} {'GB/s':>8} {'%copy':>6} "
                   f"{'vs base':>8} {'max err':>9}"]
    for r in report.rows:
        vs = f"{r.speedup_vs_baseline:.2f}x" if r.speedup_vs_baseline is not None else "-"
        lines.append(f"{r.nodes:>5} {r.prefix:>7} {r.impl:>7} {r.backend:>16} {r.ms:>9.4f} {r.gbps:>8.0f} "
                     f"{r.fraction_of_copy:>6.0%} {vs:>8} {r.max_abs_err:>9.2e}")
    lines.append(f"  (vs base: the fastest of {', '.join(BASELINES)} at that point over this row's time; sdpa: "
                 "the fastest SDPA backend/form that ran, K/V 'expanded' to Hq heads or 'gqa' (enable_gqa); "
                 "every candidate's time in the JSON)")
    for impl, why in report.skipped.items():
        lines.append(f"  ({impl} not run: {why})")
    for name, met in report.goals():
        lines.append(f"goal: {name}: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def _chain_and_branches_mask(nodes: int, device):
    """A Medusa-like tree: a 4-ary first level under the root, then chains under each."""
    import torch

    parent = [-1] + [0 if i <= 4 else i - 4 for i in range(1, nodes)]
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask.to(device)


Timer = Callable[[Callable[[], object]], float]  # fn -> median milliseconds per call


def cuda_median_ms(fn: Callable[[], object]) -> float:
    """Median CUDA-event time of ``fn`` (Triton's do_bench: warm-up, L2 flushed per rep)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def wall_median_ms(fn: Callable[[], object], *, warmup: int = 2, min_reps: int = 5, min_s: float = 0.25,
                   max_reps: int = 50) -> float:
    """Median wall-clock time of ``fn`` on the CPU: ``warmup`` calls, then at least ``min_reps``
    and until ``min_s`` seconds have passed (at most ``max_reps``)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - started < min_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_copy_gbps(device, nbytes: int, timer: Timer) -> float:
    """Copy bandwidth on ``device``: (read + write bytes) / median time."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_candidates(q, k, v, full_mask) -> dict[str, Callable[[], object]]:
    """Every SDPA backend x form that accepts this call (``"BACKEND/FORM"`` -> a call running
    it alone under ``sdpa_kernel``). A backend that cannot take the inputs (a mask with
    flash, GQA with efficient, cudnn off CUDA, ...) raises at once and is left out; the
    expanded K/V are made here, once, so the timed call is attention alone."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, L+T, D]
    forms = {"expanded": (k_rep, v_rep, False), "gqa": (k, v, True)}
    out: dict[str, Callable[[], object]] = {}
    for backend in SDPA_BACKENDS:
        for form in SDPA_FORMS:
            kk, vv, gqa = forms[form]

            def call(kk=kk, vv=vv, gqa=gqa, chosen=_sdpa_backend(backend)):
                with sdpa_kernel([chosen]):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=full_mask, enable_gqa=gqa)

            try:
                with warnings.catch_warnings():  # each refusing backend warns why before raising
                    warnings.simplefilter("ignore")
                    call()
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                log.debug("sdpa %s/%s not available here: %s", backend, form, exc)
                continue
            out[f"{backend}/{form}"] = call
    return out


_FLEX_COMPILE_FAILED = False  # once it failed, later shapes go unfused at once


def flex_call(q, k, v, tree_mask, prefix: int, compile: bool) -> tuple[str, Callable[[], object]]:
    """flex_attention over a block mask of the tree (every prefix key visible; among the tree
    keys, ``tree_mask``), GQA in the kernel; returns (`FLEX_BACKENDS` name, call). ``compile``:
    through ``torch.compile`` (one compilation per shape, made here), unfused where that fails."""
    global _FLEX_COMPILE_FAILED
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    nodes = q.shape[2]

    def visible(b, h, q_idx, kv_idx):  # indices clamped: a kernel may evaluate it on a block's padding too
        node = (kv_idx - prefix).clamp(0, nodes - 1)
        return (kv_idx < prefix) | tree_mask[q_idx.clamp(0, nodes - 1), node]

    block_mask = create_block_mask(visible, None, None, nodes, prefix + nodes, device=q.device)
    if compile and not _FLEX_COMPILE_FAILED:
        try:
            # one compilation per shape, the previous shapes' dropped first: past dynamo's recompile
            # limit (8) a further shape would run unfused without saying so
            torch._dynamo.reset()
            fn = torch.compile(flex_attention, dynamic=False)

            def call():
                return fn(q, k, v, block_mask=block_mask, enable_gqa=True)

            call()
            return "compiled", call
        except Exception as exc:  # noqa: BLE001 - any compiler failure: time it unfused instead
            _FLEX_COMPILE_FAILED = True
            log.warning("flex_attention did not compile here (%s: %s); timing it unfused", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")

    def eager():
        with warnings.catch_warnings():  # "called without torch.compile": that is what this row is
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    return "eager", eager


def run_kernel_bench(config: KernelBenchConfig, *, device=None, timer: Timer | None = None) -> KernelBenchReport:
    """Run the grid. ``device`` defaults to CUDA when there is one, else the CPU; ``timer``
    to CUDA-event timing on CUDA and wall-clock medians elsewhere. ``triton`` off CUDA runs
    only under TRITON_INTERPRET=1; otherwise it is left out (``report.skipped`` says so)."""
    import torch

    from specops.kernels.tree_attention import triton, triton_interpreting, tree_attention

    config.validate()
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    timer = timer or (cuda_median_ms if device.type == "cuda" else wall_median_ms)
    dtype = getattr(torch, config.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    report = KernelBenchReport(device=name, dtype=config.dtype,
                               copy_gbps=measure_copy_gbps(device, config.copy_bytes, timer), config=config)
    impls = list(config.impls)
    if "triton" in impls and (triton is None or (device.type != "cuda" and not triton_interpreting())):
        impls.remove("triton")
        report.skipped["triton"] = ("the triton package is not installed" if triton is None else
                                    f"no CUDA device ({device.type}); Triton's interpreter runs it under "
                                    "TRITON_INTERPRET=1, far too slowly to time")
    triton_backend = "triton" if device.type == "cuda" else "interpreter"
    log.info("copy bandwidth: %.0f GB/s", report.copy_gbps)
    gen = torch.Generator(device=device).manual_seed(0)
    b, hq, hkv, d = config.batch, config.heads_q, config.heads_kv, config.head_dim
    for nodes in config.nodes:
        tree_mask = _chain_and_branches_mask(nodes, device)  # [T, T]
        for prefix in config.prefixes:
            q = torch.randn(b, hq, nodes, d, device=device, dtype=dtype, generator=gen)  # [B, Hq, T, D]
            k = torch.randn(b, hkv, prefix + nodes, d, device=device, dtype=dtype, generator=gen)  # [B, Hkv, L+T, D]
            v = torch.randn(b, hkv, prefix + nodes, d, device=device, dtype=dtype, generator=gen)
            full_mask = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool, device=device), tree_mask], 1)  # [T, L+T]
            expected = tree_attention(q, k, v, tree_mask, impl="torch").float()

            def err(out) -> float:
                return (out.float() - expected).abs().max().item()

            times: dict[str, float] = {}
            errors: dict[str, float] = {}
            backends: dict[str, str] = {}
            candidates: dict[str, dict[str, float]] = {}
            for impl in impls:
                if impl == "sdpa":
                    calls = {}
                    for key, fn in sdpa_candidates(q, k, v, full_mask).items():
                        off = err(fn())
                        if off <= ACCEPT_TOLERANCE[config.dtype]:
                            calls[key] = fn
                        else:  # a backend that gets the masked attention wrong is no baseline
                            report.skipped[f"sdpa {key}"] = f"off the reference by {off:.2e} at T={nodes}, L={prefix}"
                    if not calls:
                        report.skipped["sdpa"] = "no SDPA backend accepted the call and matched the reference"
                        continue
                    cand = {key: timer(fn) for key, fn in calls.items()}
                    best = min(cand, key=cand.__getitem__)
                    times[impl], errors[impl], backends[impl] = cand[best], err(calls[best]()), best
                    candidates[impl] = cand
                    continue
                if impl == "flex":
                    backends[impl], fn = flex_call(q, k, v, tree_mask, prefix, config.flex_compile)
                elif impl == "triton":
                    backends[impl] = triton_backend
                    fn = functools.partial(tree_attention, q, k, v, tree_mask, impl="triton")
                else:
                    backends[impl] = "fp32-reference"
                    fn = functools.partial(tree_attention, q, k, v, tree_mask, impl="torch")
                errors[impl] = err(fn())
                times[impl] = timer(fn)
            nbytes = attention_bytes(b, hq, hkv, nodes, prefix, d, elem)
            base = min((times[i] for i in BASELINES if i in times), default=None)
            for impl in times:
                gbps = nbytes / (times[impl] * 1e-3) / 1e9
                report.rows.append(KernelBenchRow(
                    nodes=nodes, prefix=prefix, impl=impl, ms=times[impl], gbps=gbps,
                    fraction_of_copy=gbps / report.copy_gbps,
                    speedup_vs_baseline=base / times[impl] if base is not None else None,
                    max_abs_err=errors[impl], backend=backends[impl], candidates=candidates.get(impl, {}),
                ))
            log.info("T=%d L=%d: %s", nodes, prefix, {i: round(t, 4) for i, t in times.items()})
            del q, k, v
    return report


@click.command("kernels")
@click.option("--nodes", "-t", "nodes", type=int, multiple=True, help="Tree sizes T (repeatable). Default 16 64 128.")
@click.option("--prefix", "-l", "prefixes", type=int, multiple=True, help="Prefix lengths L (repeatable). Default 1k 4k 16k.")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--heads", "heads_q", type=int, default=32, show_default=True, help="Query heads Hq.")
@click.option("--kv-heads", "heads_kv", type=int, default=8, show_default=True, help="Key/value heads Hkv.")
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--impl", "impls", type=click.Choice(list(IMPL_NAMES)), multiple=True,
              help="Implementations to time (repeatable). Default all.")
@click.option("--no-flex-compile", is_flag=True,
              help="Time flex_attention unfused instead of compiling it (compiling takes a while per shape).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the results as JSON here.")
def bench_kernels_command(nodes, prefixes, batch, heads_q, heads_kv, head_dim, dtype, impls, no_flex_compile,
                          json_path) -> None:
    """Time tree attention: Triton kernel vs the fastest SDPA backend and FlexAttention (and the
    PyTorch reference). Without a CUDA GPU, the baselines and the reference on the CPU."""
    import torch

    from specops.kernels.tree_attention import triton_interpreting

    cuda = torch.cuda.is_available()
    config = KernelBenchConfig(
        nodes=tuple(nodes) or DEFAULT_NODES, prefixes=tuple(prefixes) or DEFAULT_PREFIXES, batch=batch,
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, impls=tuple(impls) or IMPL_NAMES,
        copy_bytes=COPY_BYTES if cuda else CPU_COPY_BYTES, flex_compile=not no_flex_compile,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not cuda and set(config.impls) == {"triton"} and not triton_interpreting():
        raise click.BadParameter("--impl triton needs a CUDA GPU (none is available here); the CPU can time "
                                 "torch, sdpa and flex", param_hint="--impl")
    if not cuda:
        click.echo("no CUDA GPU: timing on the CPU", err=True)
    report = run_kernel_bench(config)
    click.echo(format_table(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(), indent=2))
        click.echo(f"wrote {json_path}")
