"""``python -m mok.bench``: mok's MoE layer against the plain PyTorch EP layer, side by side in one process.

    python -m mok.bench                                        # dsv3, qwen3, gptoss on this GPU
    torchrun --nproc_per_node=8 -m mok.bench --shapes dsv3     # EP 8 over the world group, T per rank
    python -m mok.bench --hidden 4096 --intermediate 1536 --experts 64 --topk 6 --shared 0 --tokens 8192
    python -m mok.bench --device cpu                           # tiny shape: mok's CPU path, the per-expert loop

For every shape and engine it times the forward (training mode: activations kept), the backward
(``torch.autograd.backward(y, dy)``: dx, d topk_weights and every weight gradient) and the step (both) with
CUDA events: warm-up iterations, then the median of --iters, each after a device sync (and a barrier under
torchrun); the slowest rank's median is reported. Both engines run on the same tensors (weights, x, routing:
uniform random distinct top-k experts from a seeded generator, softmax weights, dy), and the relative norms of
their y, dx and weight gradients are printed as a sanity column. Useful FLOPs per rank: forward
2*T*K*3*H*I + 2*T*3*H*I_shared, backward twice that, step three times; the fraction is against a dense bf16
torch.matmul (cuBLAS) timed in the same run.

``--engines mok,torch,torch_fp8`` adds ``plain_moe_experts_fp8`` (mok.torch.plain_fp8: the plain layer with FP8
e4m3 rowwise-scaled expert GEMMs through torch._scaled_grouped_mm, as torchao trains MoEs on Hopper), its
relative norms against the bf16 torch engine, and a dense FP8 torch._scaled_mm of the same n timed in the same
run (1x128 / 128x128 block scales where this torch and GPU take them, else rowwise). docs/training.md
describes the design.

``--engines mok,mok_fp8,torch,torch_fp8`` adds mok in FP8 (``Config(precision="fp8")``, docs/fp8.md): its times,
its speed-up over mok in bf16 (``mok_fp8_vs_mok_*``) and over the plain FP8 layer (``mok_fp8_vs_torch_fp8_*``),
its relative norms against mok in bf16, and an ``fp8_record`` with the issue's fields (precision, shape, ep,
fwd/bwd/step ms, the same run's bf16 and plain FP8 times, the dense TFLOP/s). Its timed passes read the weights'
FP8 copies current, as every micro-batch of an optimizer step does; what a weight update adds (the copies
re-quantized in the first forward after it) is timed apart: ``mok_fp8_weight_update_ms`` (a re-quantizing forward
minus a plain one), and the record's ``weight_update_ms`` and ``step_with_update_ms`` (a step that follows an
update: one micro-batch per optimizer step). ``mok_fp8_w16`` is mok in FP8 with the weight-gradient GEMMs in
bf16 (``Config(precision="fp8", fp8_weight_grads=False)``): its times beside mok_fp8's (``fp8_record``'s
``w16_*_ms``) say which weight-gradient precision is faster for the step.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Shape", "SHAPES", "main", "commit_id", "envelope", "write_record", "render_table"]

PASSES = ("fwd", "bwd", "step")
ENGINES = ("mok", "torch", "torch_fp8", "mok_fp8", "mok_fp8_w16")
DEFAULT_ENGINES = ("mok", "torch")  # the FP8 engines only on request: the records keep their meaning
PASS_FLOP_FACTOR = {"fwd": 1, "bwd": 2, "step": 3}


@dataclass(frozen=True)
class Shape:
    """One MoE layer: T tokens per rank, H, I (routed expert), E experts over the EP group, top-K, I_shared."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared: int
    tokens: int

    def describe(self) -> str:
        return (f"T={self.tokens} H={self.hidden} I={self.intermediate} I_shared={self.shared} E={self.experts} "
                f"K={self.topk}")

    def flops(self, pass_: str) -> float:
        """Useful FLOPs of one pass on one rank (no padding, no recomputation counted)."""
        T, H = self.tokens, self.hidden
        fwd = 2.0 * T * self.topk * 3 * H * self.intermediate + 2.0 * T * 3 * H * self.shared
        return fwd * PASS_FLOP_FACTOR[pass_]


SHAPES = {
    "dsv3": Shape("dsv3", 7168, 2048, 256, 8, 2048, 8192),
    "qwen3": Shape("qwen3", 2048, 768, 128, 8, 0, 16384),
    "gptoss": Shape("gptoss", 2880, 2880, 128, 4, 0, 8192),
    "tiny": Shape("tiny", 128, 64, 8, 2, 64, 256),  # the CPU smoke test
}


# ---- records (bench/results) ---------------------------------------------------------------------------

def commit_id() -> str:
    """MOK_COMMIT (the GPU scripts set it: the device machine's copy has no .git), else git, else 'unknown'."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def envelope(results: list, command: str) -> dict:
    """The envelope of every file in bench/results (bench/bench_record.hpp): date, commit, gpu, gpus, command,
    results."""
    import torch

    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit_id(),
            "gpu": torch.cuda.get_device_name(0) if cuda else "none",
            "gpus": torch.cuda.device_count() if cuda else 0, "command": command, "results": results}


def write_record(results_dir: str | Path, bench: str, results: list, command: str, suffix: str = "") -> Path:
    """bench/results/<date>-<bench>-<commit><suffix>.json, one result object per line (as the C++ benches)."""
    rec = envelope(results, command)
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{rec['date']}-{bench}-{rec['commit']}{suffix}.json"
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in rec.items() if k != "results")
    path.write_text("{\n" + head + ',\n "results": [\n  ' + ",\n  ".join(json.dumps(r) for r in results)
                    + "\n]\n}\n")
    return path


# ---- timing --------------------------------------------------------------------------------------------------

class Timer:
    """CUDA events on a GPU (after a device sync and, under torchrun, a barrier), perf_counter on the CPU."""

    def __init__(self, device, world: int):
        import torch

        self.cuda = device.type == "cuda"
        self.world = world
        self.torch = torch

    def start(self):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
        if self.world > 1:
            torch.distributed.barrier()
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            return (s, e)
        return time.perf_counter()

    def stop(self, token) -> float:
        """Milliseconds since ``start``."""
        if self.cuda:
            s, e = token
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        return (time.perf_counter() - token) * 1e3


def _clear_grads(leaves) -> None:
    for t in leaves:
        t.grad = None


def time_pass(pass_: str, fn, leaves, dy, timer: Timer, warmup: int, iters: int) -> float:
    """Median milliseconds of one pass: 'fwd' (training forward), 'bwd' (autograd.backward(y, dy) after an
    untimed forward) or 'step' (both)."""
    import torch

    times = []
    for i in range(warmup + iters):
        _clear_grads(leaves)
        if pass_ == "fwd":
            tok = timer.start()
            y = fn()
            ms = timer.stop(tok)
        elif pass_ == "bwd":
            y = fn()
            tok = timer.start()
            torch.autograd.backward(y, dy)
            ms = timer.stop(tok)
        else:
            tok = timer.start()
            y = fn()
            torch.autograd.backward(y, dy)
            ms = timer.stop(tok)
        del y
        if i >= warmup:
            times.append(ms)
    _clear_grads(leaves)
    return statistics.median(times)


def dense_tflops(device, n: int, timer: Timer, warmup: int = 3, iters: int = 10) -> float:
    """TFLOP/s of an n x n x n bf16 torch.matmul (cuBLAS on a GPU): the dense reference."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=g)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=g)
    times = []
    for i in range(warmup + iters):
        tok = timer.start()
        torch.matmul(a, b)
        ms = timer.stop(tok)
        if i >= warmup:
            times.append(ms)
    return 2.0 * n ** 3 / (statistics.median(times) * 1e-3) / 1e12


def dense_fp8_tflops(device, n: int, timer: Timer, warmup: int = 3, iters: int = 10) -> tuple[float, str]:
    """(TFLOP/s, scaling) of an n x n x n e4m3 torch._scaled_mm with bf16 out: the dense FP8 reference.

    Scaling "blockwise" (DeepSeek-V3's recipe: 1x128 scales on A, 128x128 on B, cuBLAS >= 12.9 on sm_90; no fast
    accumulation) when this torch and GPU take it, else "rowwise" (scales [n, 1] and [1, n], fast accumulation as
    the torch_fp8 engine runs). A is row-major, B column-major, as _scaled_mm requires."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn).t()
    kb = -(-n // 128)
    candidates = []
    if n % 128 == 0:
        # A's 1x128 scales [n, n/128] outer-dim-major (strides (1, n)); B's 128x128 scales [K/128, N/128] with
        # strides (1, K/128)
        sa = torch.ones(kb, n, device=device).t()
        sb = torch.ones(kb, kb, device=device).t()
        candidates.append(("blockwise", lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)))
    ra, rb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    candidates.append(("rowwise", lambda: torch._scaled_mm(a, b, ra, rb, out_dtype=torch.bfloat16,
                                                           use_fast_accum=True)))
    for i, (scaling, fn) in enumerate(candidates):
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except (RuntimeError, NotImplementedError, ValueError):
            if i == len(candidates) - 1:
                raise
            continue
        times = []
        for j in range(warmup + iters):
            tok = timer.start()
            fn()
            ms = timer.stop(tok)
            if j >= warmup:
                times.append(ms)
        return 2.0 * n ** 3 / (statistics.median(times) * 1e-3) / 1e12, scaling
    raise AssertionError("unreachable")


# ---- one shape ----------------------------------------------------------------------------------------------

def _rel(a, b, world: int, chunk: int = 1 << 26) -> float:
    """||a - b|| / ||b|| over every rank's pieces, in fp32 chunks of ``chunk`` elements (dsv3's weight
    gradients are 3.8 G elements: whole-tensor fp32 temporaries would not fit beside both engines' gradients)."""
    import torch

    a, b = a.reshape(-1), b.reshape(-1)
    both = torch.zeros(2, dtype=torch.float64, device=a.device)
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        both[0] += (x - y).square().sum(dtype=torch.float64)
        both[1] += y.square().sum(dtype=torch.float64)
    if world > 1:
        torch.distributed.all_reduce(both)
    return math.sqrt(float(both[0]) / max(float(both[1]), 1e-300))


def make_problem(shape: Shape, device, rank: int, world: int, seed: int):
    """This rank's weights (its E/W experts), x, routing and dy; every tensor from seeded generators."""
    import torch

    if shape.experts % world:
        raise ValueError(f"{shape.name}: E = {shape.experts} is not a multiple of the {world} ranks")
    el = shape.experts // world
    H, I, S, T, K = shape.hidden, shape.intermediate, shape.shared, shape.tokens, shape.topk
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)

    def randn(*size, std=1.0):
        return torch.randn(*size, dtype=torch.bfloat16, device=device, generator=g).mul_(std)

    w = {"w1": randn(el, I, H, std=H ** -0.5), "w3": randn(el, I, H, std=H ** -0.5),
         "w2": randn(el, H, I, std=I ** -0.5)}
    if S:
        w.update(shared_w1=randn(S, H, std=H ** -0.5), shared_w3=randn(S, H, std=H ** -0.5),
                 shared_w2=randn(H, S, std=S ** -0.5))
    for t in w.values():
        t.requires_grad_(True)
    x = randn(T, H).requires_grad_(True)
    # uniform random distinct experts per token; positive softmax weights
    idx = torch.rand(T, shape.experts, device=device, generator=g).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(T, K, device=device, generator=g), dim=1).requires_grad_(True)
    dy = randn(T, H)
    return w, x, idx, tw, dy


# The sanity compares the routed weight gradients of each rank's first SANITY_EXPERTS experts (copies: dsv3's whole
# routed gradients are 22.5 GB per engine at EP 1, which beside a second engine's pass and FP8 weight copies do not
# fit an 80 GB GPU), every other output whole.
SANITY_EXPERTS = 16

# The sanity pairs (engine, reference, key prefix): mok against the plain layer, the FP8 layer against bf16.
SANITY_PAIRS = (("mok", "torch", ""), ("torch_fp8", "torch", "fp8_vs_bf16_"), ("mok_fp8", "mok", "mok_fp8_vs_bf16_"),
                ("mok_fp8_w16", "mok", "mok_fp8_w16_vs_bf16_"))


def bench_shape(shape: Shape, args, device, rank: int, world: int, timer: Timer, dense: float,
                dense_fp8: tuple[float, str] | None = None) -> dict:
    """Times every pass of every engine on one shape; returns the record entry (metrics and sanity).
    dense_fp8: (TFLOP/s, scaling) of the dense FP8 reference when torch_fp8 runs on a GPU."""
    import torch

    import mok
    import mok.torch
    from mok.torch.plain import grouped_mm_available, plain_moe_experts
    from mok.torch.plain_fp8 import plain_moe_experts_fp8

    w, x, idx, tw, dy = make_problem(shape, device, rank, world, args.seed)
    leaves = [x, tw, *w.values()]
    shared = [w.get("shared_w1"), w.get("shared_w2"), w.get("shared_w3")]
    impl = args.torch_impl
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_available(device) else "loop"
    fns = {}

    def mok_pass(**knobs):  # mok's layer on this shape with these Config knobs
        spec = mok.torch.layer_spec(shape.hidden, shape.intermediate, shape.experts, shape.topk, shape.shared,
                                    config=mok.Config(max_tokens=shape.tokens, **knobs))
        return lambda: mok.torch.moe_experts(x, idx, tw, w["w1"], w["w2"], w["w3"], *shared, spec=spec)

    if "mok" in args.engines:
        fns["mok"] = mok_pass()
    if "mok_fp8" in args.engines:  # right after mok: its sanity pair needs mok's outputs
        run_fp8 = mok_pass(precision="fp8")  # the weights' FP8 copies current: a microbatch's pass

        def run_fp8_after_update():  # the first forward after an optimizer step re-quantizes the copies
            mok.torch.mark_fp8_weights_stale()
            return run_fp8()

        fns["mok_fp8"] = run_fp8
    if "mok_fp8_w16" in args.engines:  # FP8 passes, bf16 weight-gradient GEMMs (Config.fp8_weight_grads = False)
        fns["mok_fp8_w16"] = mok_pass(precision="fp8", fp8_weight_grads=False)
    if "torch" in args.engines:
        fns["torch"] = lambda: plain_moe_experts(x, idx, tw, w["w1"], w["w2"], w["w3"], *shared, impl=impl)
    if "torch_fp8" in args.engines:
        fns["torch_fp8"] = lambda: plain_moe_experts_fp8(x, idx, tw, w["w1"], w["w2"], w["w3"], *shared)

    metrics, sanity, errors = {}, {}, {}
    # sanity: one step of each engine on the same tensors, compared pairwise (SANITY_PAIRS). An engine's outputs
    # are dropped once no pair with an engine still to run needs them: at most two engines' gradients at once.
    outs = {}
    order = list(fns)
    for i, (name, fn) in enumerate(fns.items()):
        _clear_grads(leaves)
        y = None
        try:
            y = fn()
            torch.autograd.backward(y, dy)
            if name.startswith("mok"):
                mok.torch.check()
            outs[name] = {"y": y.detach(), "dx": x.grad, "dtw": tw.grad,
                          **{k: t.grad[:SANITY_EXPERTS].clone() if k in ("w1", "w2", "w3") else t.grad
                             for k, t in w.items()}}
        except Exception as e:  # noqa: BLE001 - reported in the table and the record, the other engine still runs
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        del y
        _clear_grads(leaves)
        if name.startswith("mok"):
            free_memory(device)  # its workspace and FP8 copies: the next engine may need the memory
        for eng, ref, prefix in SANITY_PAIRS:
            if eng in outs and ref in outs and f"{prefix}y_rel_norm" not in sanity:
                a, b = outs[eng], outs[ref]
                sanity.update({f"{prefix}y_rel_norm": _rel(a["y"], b["y"], world),
                               f"{prefix}dx_rel_norm": _rel(a["dx"], b["dx"], world),
                               f"{prefix}dtw_rel_norm": _rel(a["dtw"], b["dtw"], world),
                               f"{prefix}dw_rel_norm": max(_rel(a[k], b[k], world) for k in w)})
        later = set(order[i + 1:])
        for k in list(outs):
            if not any(k in (eng, ref) and ({eng, ref} - {k}) & later for eng, ref, _ in SANITY_PAIRS):
                del outs[k]
    del outs
    gc.collect()

    for name, fn in fns.items():
        if name in errors:
            continue
        if name.startswith("mok"):
            mok.torch.set_checks("off")  # no host sync per call in the timed loops
        try:
            for p in args.passes:
                metrics[f"{name}_{p}_ms"] = time_pass(p, fn, leaves, dy, timer, args.warmup, args.iters)
            if name == "mok_fp8" and "fwd" in args.passes and device.type == "cuda":
                # What a weight update adds: the forward that re-quantizes the copies, minus one that does not
                # (the CPU path keeps no copies).
                requant = time_pass("fwd", run_fp8_after_update, leaves, dy, timer, args.warmup, args.iters)
                metrics["mok_fp8_fwd_requant_ms"] = requant
                metrics["mok_fp8_weight_update_ms"] = max(requant - metrics["mok_fp8_fwd_ms"], 0.0)
            if name.startswith("mok"):
                mok.torch.check()
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            for p in args.passes:
                metrics.pop(f"{name}_{p}_ms", None)
        finally:
            if name.startswith("mok"):
                mok.torch.set_checks("sync")
                free_memory(device)
    if world > 1:  # the slowest rank's medians
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        metrics = dict(zip(keys, t.tolist()))
    for name in fns:
        for p in args.passes:
            ms = metrics.get(f"{name}_{p}_ms")
            if ms is not None:
                metrics[f"{name}_{p}_tflops"] = shape.flops(p) / (ms * 1e-3) / 1e12
    for p in args.passes:
        if f"torch_{p}_ms" in metrics and f"mok_{p}_ms" in metrics:
            metrics[f"{p}_speedup"] = metrics[f"torch_{p}_ms"] / metrics[f"mok_{p}_ms"]
        if f"torch_fp8_{p}_ms" in metrics and f"mok_{p}_ms" in metrics:
            metrics[f"mok_vs_torch_fp8_{p}"] = metrics[f"torch_fp8_{p}_ms"] / metrics[f"mok_{p}_ms"]
        if f"mok_fp8_{p}_ms" in metrics:
            for other, key in (("mok", "mok_fp8_vs_mok"), ("torch_fp8", "mok_fp8_vs_torch_fp8")):
                if f"{other}_{p}_ms" in metrics:
                    metrics[f"{key}_{p}"] = metrics[f"{other}_{p}_ms"] / metrics[f"mok_fp8_{p}_ms"]
    metrics["cublas_dense_tflops"] = dense
    if dense_fp8 is not None:
        metrics["cublas_dense_fp8_tflops"] = dense_fp8[0]
    metrics.update(sanity)
    entry = {"bench": "torch_step", "shape": shape.name, "dims": shape.describe(), "ep": world,
             "tokens_per_rank": shape.tokens, "routing": "uniform", "torch_impl": impl, "warmup": args.warmup,
             "iters": args.iters, "metrics": metrics}
    entry["precision"] = "bf16"  # of the mok engine; the fp8 one has its own record below
    if dense_fp8 is not None:
        entry["dense_fp8_scaling"] = dense_fp8[1]
    if "mok_fp8_step_ms" in metrics or "mok_fp8_fwd_ms" in metrics:
        names = {"fwd": "fwd", "bwd": "bwd", "step": "step"}
        rec = {"precision": "fp8_block", "shape": shape.name, "ep": world}
        for p in args.passes:
            rec[f"{names[p]}_ms"] = metrics.get(f"mok_fp8_{p}_ms")
            rec[f"bf16_{names[p]}_ms"] = metrics.get(f"mok_{p}_ms")
            rec[f"plain_fp8_{names[p]}_ms"] = metrics.get(f"torch_fp8_{p}_ms")
            if f"mok_fp8_w16_{p}_ms" in metrics:  # the same FP8 passes with bf16 weight-gradient GEMMs
                rec[f"w16_{names[p]}_ms"] = metrics[f"mok_fp8_w16_{p}_ms"]
        rec["weight_update_ms"] = metrics.get("mok_fp8_weight_update_ms")  # once per optimizer step, not in step_ms
        if rec["weight_update_ms"] is not None and rec.get("step_ms") is not None:
            rec["step_with_update_ms"] = rec["step_ms"] + rec["weight_update_ms"]
        rec["dense_bf16_tflops"] = dense
        rec["dense_fp8_tflops"] = dense_fp8[0] if dense_fp8 is not None else None
        rec["dense_fp8_scaling"] = dense_fp8[1] if dense_fp8 is not None else None
        entry["fp8_record"] = rec
    if errors:
        entry["errors"] = errors
    return entry


def free_memory(device) -> None:
    import torch

    import mok.torch

    gc.collect()
    mok.torch.release()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- output ---------------------------------------------------------------------------------------------------

def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_table(entries: list, passes=PASSES) -> str:
    """The results as a fixed-width text table: one row per (shape, pass), a sanity row per shape. With the
    torch_fp8 engine two more columns (its ms, and its ms over mok's) and its sanity row against bf16."""
    fp8 = any(k.startswith("torch_fp8_") for e in entries for k in e.get("metrics", {}))
    mok8 = any(k.startswith("mok_fp8_") for e in entries for k in e.get("metrics", {}))
    head = (f"{'shape':8s} {'pass':5s} {'mok ms':>9s} {'torch ms':>9s} {'mok TF/s':>9s} {'torch TF/s':>10s} "
            f"{'mok/dense':>9s} {'torch/dense':>11s} {'speed-up':>8s}")
    if fp8:
        head += f" {'fp8 ms':>9s} {'vs fp8':>8s}"
    if mok8:
        head += f" {'mok8 ms':>9s} {'8/bf16':>7s} {'8/fp8':>7s}"
    lines = [head, "-" * len(head)]
    for e in entries:
        if "error" in e:
            lines.append(f"{e['shape']:8s} error: {e['error']}")
            continue
        m = e["metrics"]
        dense = m.get("cublas_dense_tflops")
        for p in passes:
            mt, tt = m.get(f"mok_{p}_tflops"), m.get(f"torch_{p}_tflops")
            up = m.get(f"{p}_speedup")
            row = (f"{e['shape']:8s} {p:5s} {_fmt(m.get(f'mok_{p}_ms'), '9.3f')} "
                   f"{_fmt(m.get(f'torch_{p}_ms'), '9.3f')} {_fmt(mt, '9.4g')} {_fmt(tt, '10.4g')} "
                   f"{_fmt(mt / dense if mt and dense else None, '9.3f')} "
                   f"{_fmt(tt / dense if tt and dense else None, '11.3f')} "
                   f"{_fmt(up, '7.2f') + ('x' if up else ''):>8s}")
            if fp8:
                up8 = m.get(f"mok_vs_torch_fp8_{p}")
                row += f" {_fmt(m.get(f'torch_fp8_{p}_ms'), '9.3f')} {_fmt(up8, '7.2f') + ('x' if up8 else ''):>8s}"
            if mok8:
                a, b = m.get(f"mok_fp8_vs_mok_{p}"), m.get(f"mok_fp8_vs_torch_fp8_{p}")
                row += (f" {_fmt(m.get(f'mok_fp8_{p}_ms'), '9.3f')} {_fmt(a, '6.2f') + ('x' if a else ''):>7s}"
                        f" {_fmt(b, '6.2f') + ('x' if b else ''):>7s}")
            lines.append(row)
        for engine, text in e.get("errors", {}).items():
            lines.append(f"{'':8s} {engine} failed: {text}")
        if "y_rel_norm" in m:
            lines.append(f"{'':8s} sanity: |y_mok - y_torch|/|y_torch| = {m['y_rel_norm']:.2e}, "
                         f"dx {m['dx_rel_norm']:.2e}, d topk_w {m['dtw_rel_norm']:.2e}, "
                         f"weight grads (max) {m['dw_rel_norm']:.2e}")
        if "fp8_vs_bf16_y_rel_norm" in m:
            lines.append(f"{'':8s} fp8: |y_fp8 - y_torch|/|y_torch| = {m['fp8_vs_bf16_y_rel_norm']:.2e}, "
                         f"dx {m['fp8_vs_bf16_dx_rel_norm']:.2e}, d topk_w {m['fp8_vs_bf16_dtw_rel_norm']:.2e}, "
                         f"weight grads (max) {m['fp8_vs_bf16_dw_rel_norm']:.2e}")
        if "mok_fp8_weight_update_ms" in m:
            up, st, bf = m["mok_fp8_weight_update_ms"], m.get("mok_fp8_step_ms"), m.get("mok_step_ms")
            line = f"{'':8s} mok fp8 weight update (re-quantizing the copies, once per optimizer step): {up:.3f} ms"
            if st is not None:
                line += f"; a step with it {st + up:.3f} ms"
                if bf is not None:
                    line += f" ({bf / (st + up):.2f}x bf16)"
            lines.append(line)
        w16 = [p for p in passes if f"mok_fp8_w16_{p}_ms" in m]
        if w16:
            lines.append(f"{'':8s} mok fp8 with bf16 weight-gradient GEMMs (mok_fp8_w16): "
                         + ", ".join(f"{p} {m[f'mok_fp8_w16_{p}_ms']:.3f} ms" for p in w16)
                         + (f"; its step over mok_fp8's {m['mok_fp8_step_ms'] / m['mok_fp8_w16_step_ms']:.2f}x"
                            if "mok_fp8_step_ms" in m and "mok_fp8_w16_step_ms" in m else ""))
        if "mok_fp8_vs_bf16_y_rel_norm" in m:
            lines.append(f"{'':8s} mok fp8: |y_fp8 - y_mok|/|y_mok| = {m['mok_fp8_vs_bf16_y_rel_norm']:.2e}, "
                         f"dx {m['mok_fp8_vs_bf16_dx_rel_norm']:.2e}, d topk_w {m['mok_fp8_vs_bf16_dtw_rel_norm']:.2e}, "
                         f"weight grads (max) {m['mok_fp8_vs_bf16_dw_rel_norm']:.2e}")
    if entries and "metrics" in entries[0]:
        e = entries[0]
        lines.append(f"dense bf16 matmul: {e['metrics']['cublas_dense_tflops']:.4g} TFLOP/s; EP {e['ep']}; "
                     f"torch experts: {e['torch_impl']}")
        if "cublas_dense_fp8_tflops" in e["metrics"]:
            lines.append(f"dense fp8 matmul ({e.get('dense_fp8_scaling', '?')} scales): "
                         f"{e['metrics']['cublas_dense_fp8_tflops']:.4g} TFLOP/s; fp8 ms: the torch_fp8 engine "
                         "(rowwise FP8 expert GEMMs), vs fp8: its ms over mok's")
    return "\n".join(lines)


def plot(entries: list, passes, path: Path, title: str) -> bool:
    """Bar chart: useful TFLOP/s of each engine per shape, one panel per pass, the dense matmuls as lines (the
    torch_fp8 bars and the dense FP8 line only where that engine ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed, so {path} was not written (pip install matplotlib)")
        return False
    ok = [e for e in entries if "metrics" in e]
    if not ok:
        return False
    fig, axes = plt.subplots(1, len(passes), figsize=(4 * len(passes), 4), squeeze=False)
    names = [e["shape"] for e in ok]
    engines = [*DEFAULT_ENGINES, *(n for n in ENGINES if n not in DEFAULT_ENGINES
                                   and any(k.startswith(f"{n}_") for e in ok for k in e["metrics"]))]
    width = 0.76 / len(engines)
    for ax, p in zip(axes[0], passes):
        for j, engine in enumerate(engines):
            vals = [e["metrics"].get(f"{engine}_{p}_tflops") or 0.0 for e in ok]
            xs = [i + (j - (len(engines) - 1) / 2) * width for i in range(len(ok))]
            bars = ax.bar(xs, vals, width=width, label=engine, color=f"C{ENGINES.index(engine)}")
            for b, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
        ax.axhline(ok[0]["metrics"]["cublas_dense_tflops"], color="gray", ls="--", lw=1, label="dense bf16 matmul")
        if "cublas_dense_fp8_tflops" in ok[0]["metrics"]:
            ax.axhline(ok[0]["metrics"]["cublas_dense_fp8_tflops"], color="gray", ls=":", lw=1,
                       label=f"dense fp8 matmul ({ok[0].get('dense_fp8_scaling', '?')})")
        ax.set_xticks(range(len(ok)), names)
        ax.set_title(p)
        ax.set_ylabel("useful TFLOP/s per GPU")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return True


# ---- command line --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mok.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default: dsv3,qwen3,gptoss on a GPU, "
                                    "tiny on the CPU; only the custom shape when its sizes are given)")
    c = p.add_argument_group("a custom shape (added as 'custom' when --hidden is given)")
    c.add_argument("--hidden", type=int, help="H")
    c.add_argument("--intermediate", type=int, help="I of a routed expert")
    c.add_argument("--experts", type=int, help="E over the EP group")
    c.add_argument("--topk", type=int, help="K")
    c.add_argument("--shared", type=int, default=0, help="I of the shared expert (0: none)")
    c.add_argument("--tokens", type=int, help="T per rank")
    p.add_argument("--passes", default=",".join(PASSES), help="comma-separated, of fwd, bwd, step")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help="comma-separated, of mok, torch, torch_fp8, mok_fp8 (default mok,torch; torch_fp8: the plain "
                        "layer with FP8 rowwise expert GEMMs, Hopper only, plus a dense FP8 reference; mok_fp8: mok "
                        "with Config(precision='fp8'))")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per pass (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    p.add_argument("--dense-size", type=int, help="n of the n^3 dense matmul reference (default 8192; 512 on the CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-impl", choices=("auto", "grouped_mm", "loop"), default="auto",
                   help="the plain layer's experts: torch._grouped_mm, a per-expert loop, or auto")
    p.add_argument("--results-dir", help="write <date>-torch_step-<commit>.json here (e.g. bench/results)")
    p.add_argument("--json", help="also write the record to this path")
    p.add_argument("--plot", help="write a PNG bar chart of the TFLOP/s to this path (needs matplotlib)")
    args = p.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA GPU (--device cpu runs the tiny shape on the CPU paths)")
    custom = [args.hidden, args.intermediate, args.experts, args.topk, args.tokens]
    shapes = []
    if args.shapes:
        for name in args.shapes.split(","):
            if name not in SHAPES:
                p.error(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
            shapes.append(SHAPES[name])
    if any(v is not None for v in custom):
        if any(v is None for v in custom):
            p.error("a custom shape needs --hidden, --intermediate, --experts, --topk and --tokens (--shared optional)")
        shapes.append(Shape("custom", args.hidden, args.intermediate, args.experts, args.topk, args.shared,
                            args.tokens))
    if not shapes:
        shapes = [SHAPES[n] for n in (("dsv3", "qwen3", "gptoss") if args.device == "cuda" else ("tiny",))]
    args.shape_list = shapes
    args.passes = [s for s in args.passes.split(",") if s]
    args.engines = [s for s in args.engines.split(",") if s]
    for s in args.passes:
        if s not in PASSES:
            p.error(f"--passes: unknown pass {s!r} (known: {', '.join(PASSES)})")
    for s in args.engines:
        if s not in ENGINES:
            p.error(f"--engines: unknown engine {s!r} (known: {', '.join(ENGINES)})")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    args.dense_size = args.dense_size or (8192 if args.device == "cuda" else 512)
    return args


def _shape_problem(shape: Shape, world: int, with_mok: bool) -> str | None:
    """Why ``shape`` cannot run at EP ``world`` (mok's own validation when mok runs), or None."""
    if shape.experts % world:
        return f"E = {shape.experts} is not a multiple of the {world} ranks"
    if with_mok:
        import mok

        try:
            mok.validate(mok.LayerShape(tokens=shape.tokens, hidden=shape.hidden, intermediate=shape.intermediate,
                                        experts=shape.experts, topk=shape.topk, shared_intermediate=shape.shared,
                                        ep=world), mok.Config(max_tokens=shape.tokens))
        except mok.MokInvalidArgument as e:
            return str(e)
    return None


def main(argv=None) -> int:
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    with_mok = any(e.startswith("mok") for e in args.engines)  # mok, mok_fp8, mok_fp8_w16
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world > 1 and with_mok:
            print("mok.bench: mok's CPU path is one process (EP 1): run on GPUs under torchrun", file=sys.stderr)
            return 2
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    main_rank = rank == 0
    timer = Timer(device, world)
    try:
        for shape in args.shape_list:  # every shape is checked before anything runs
            problem = _shape_problem(shape, world, with_mok)
            if problem:
                if main_rank:
                    print(f"mok.bench: shape {shape.name} ({shape.describe()}) at EP {world}: {problem}",
                          file=sys.stderr)
                return 2
        dense = dense_tflops(device, args.dense_size, timer)
        dense_fp8 = None
        if ("torch_fp8" in args.engines or any(e.startswith("mok_fp8") for e in args.engines)) and device.type == "cuda":
            try:
                dense_fp8 = dense_fp8_tflops(device, args.dense_size, timer)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # the engine itself reports why
                if main_rank:
                    print(f"mok.bench: no dense FP8 reference: {str(e).splitlines()[0] if str(e) else e!r}",
                          file=sys.stderr)
        entries = []
        for shape in args.shape_list:
            if main_rank:
                print(f"mok.bench: {shape.name} ({shape.describe()}), EP {world} ...", flush=True)
            try:
                entries.append(bench_shape(shape, args, device, rank, world, timer, dense, dense_fp8))
            except torch.OutOfMemoryError as e:
                first = str(e).splitlines()[0] if str(e) else "out of memory"
                entries.append({"bench": "torch_step", "shape": shape.name, "dims": shape.describe(), "ep": world,
                                "error": f"out of memory: {first}"})
            free_memory(device)
        if main_rank:
            print()
            print(render_table(entries, args.passes))
            command = "python -m mok.bench " + " ".join(sys.argv[1:] if argv is None else argv)
            ok = [e for e in entries if "metrics" in e]
            suffix = f"-ep{world}" if world > 1 else ""
            if args.results_dir and ok:
                print(f"record: {write_record(args.results_dir, 'torch_step', ok, command, suffix)}")
            if args.json and ok:
                rec = envelope(ok, command)
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
            png = args.plot
            if png:
                gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
                plot(entries, args.passes, Path(png), f"mok vs plain PyTorch MoE layer, EP {world}, {gpu}, "
                                                      f"{commit_id()}")
        return 0 if all("metrics" in e and "errors" not in e for e in entries) else 1
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
