#!/usr/bin/env python3
"""Train a small MoE transformer as a byte-level language model on the Python standard library's source.

Attention through torch's scaled_dot_product_attention, MoE blocks with mok.torch.TopKRouter (softmax top-k,
load-balancing loss) and mok.torch.MoE (routed experts and a shared expert on mok's fused kernels), or the
same model on a plain PyTorch MoE (--engine torch: mok.torch.plain.PlainMoE). One process per GPU under
torchrun: data parallel over the world group (each rank its own shard of every batch), expert parallel over
the same group (rank r holds experts [r*E/W, (r+1)*E/W)); the other parameters, the shared expert's included,
are all-reduced (averaged). Every run with the same seed gives the same bits (docs/training.md).

    torchrun --nproc_per_node=1 examples/train_lm.py --check --results-dir bench/results  # the acceptance run
    torchrun --nproc_per_node=8 examples/train_lm.py --steps 1000 --save-every 250
    torchrun --nproc_per_node=8 examples/train_lm.py --steps 1000 --resume checkpoints/train_lm/step000500
    python3 examples/train_lm.py --device cpu --check --steps 8        # tiny sizes, mok's CPU path

--check trains run A (saving a checkpoint half-way), run B from the same seed (bitwise equal losses?), resumes
A's checkpoint to the end (bitwise equal to A's second half?), trains the torch engine (final validation loss
within 2 % of A's?), writes the plot and the JSON, and exits 1 if a check fails.

--precision fp8 runs mok's layers with block-scaled FP8 expert GEMMs (mok.torch.MoE(precision="fp8"), docs/fp8.md;
on the CPU the layer's FP8 emulation); the torch engine, --check's yardstick included, stays bf16. The JSON records
the precision. --fp8-weight-grads bf16 keeps the weight-gradient GEMMs of the FP8 layers in bf16.
"""

from __future__ import annotations

import os

# Before torch initialises CUDA: cuBLAS picks deterministic reduction splits only with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# NVLink multicast stays off (it can take a shared host's GPUs down).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
try:
    import mok.torch  # noqa: E402
except ImportError:  # running from a checkout without `pip install .`
    sys.path.insert(0, str(ROOT / "python"))
    import mok.torch  # noqa: E402
import mok  # noqa: E402
from mok.bench import commit_id, envelope, write_record  # noqa: E402
from mok.torch.plain import IMPLS, PlainMoE  # noqa: E402

ATTN_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
ENGINES = ("mok", "torch")
CHECKPOINT_FORMAT = "mok-train_lm-1"

# Sizes per preset ("gpu": sized for 300 steps in well under a minute per run on one H200; "tiny": the CPU test).
PRESETS = {
    "gpu": dict(layers=4, d_model=768, heads=12, experts=16, topk=2, intermediate=768, shared=768, seq=512,
                batch=16, steps=300, val_every=50, val_batches=8, log_every=10, lr=2e-3, warmup=30),
    "tiny": dict(layers=2, d_model=64, heads=2, experts=4, topk=2, intermediate=64, shared=64, seq=32,
                 batch=4, steps=8, val_every=4, val_batches=2, log_every=2, lr=3e-3, warmup=2),
}


# ---- distributed -----------------------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_arg: str) -> Dist:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_lm: --device cuda but torch sees no CUDA GPU (use --device cpu for the tiny run)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Dist(rank, world, device)


def all_mean_(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(t)
        t.div_(d.world)
    return t


# ---- the corpus ------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    """The standard library's .py files, sorted by path, each followed by a NUL byte (end of document);
    every ``val_every``-th file is held out for validation."""

    root: str
    files: int
    train: torch.Tensor  # uint8
    val: torch.Tensor
    sha256: str

    def unigram_entropy(self) -> float:
        """Entropy of the train split's byte distribution, in nats (a byte model that ignores context)."""
        counts = torch.bincount(self.train.to(torch.int64), minlength=256).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


def load_corpus(root: str | None = None, val_every: int = 20) -> Corpus:
    root = root or os.path.dirname(os.__file__)
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    paths = [p for p in paths if not skip & set(Path(p).parts)]
    if not paths:
        raise SystemExit(f"train_lm: no .py files under {root}")
    train, val, h = bytearray(), bytearray(), hashlib.sha256()
    for i, rel in enumerate(paths):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\0"
        h.update(rel.encode() + b"\0" + data)
        (val if i % val_every == val_every - 1 else train).extend(data)
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).clone()  # noqa: E731
    return Corpus(root, len(paths), as_tensor(train), as_tensor(val), h.hexdigest())


class Batches:
    """Windows of seq+1 bytes at uniformly random offsets, ``global_batch`` per step; rank r trains on rows
    [r*B, (r+1)*B). Its state (the generator) is the data position a checkpoint keeps."""

    def __init__(self, data: torch.Tensor, seq: int, global_batch: int, seed: int):
        if data.numel() <= seq + 1:
            raise SystemExit(f"train_lm: the corpus ({data.numel()} bytes) is shorter than one window ({seq + 1})")
        self.data, self.seq, self.global_batch = data, seq, global_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.served = 0

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (self.global_batch,), generator=self.gen)
        self.served += 1
        return torch.stack([self.data[s:s + self.seq + 1] for s in starts.tolist()]).to(torch.int64)

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])
        self.served = int(state["served"])


def val_windows(data: torch.Tensor, seq: int, count: int) -> torch.Tensor:
    """``count`` fixed windows evenly spaced through the validation split (the same in every run)."""
    starts = torch.linspace(0, data.numel() - seq - 2, count).to(torch.int64).tolist()
    return torch.stack([data[s:s + seq + 1] for s in starts]).to(torch.int64)


# ---- the model -------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    layers: int
    d_model: int
    heads: int
    experts: int
    topk: int
    intermediate: int
    shared: int
    seq: int
    batch: int  # sequences per rank
    aux_coeff: float
    capacity: float
    vocab: int = 256

    def describe(self) -> str:
        return (f"L={self.layers} d={self.d_model} heads={self.heads} E={self.experts} K={self.topk} "
                f"I={self.intermediate} I_shared={self.shared} seq={self.seq} batch={self.batch}")


def rope_tables(seq: int, head_dim: int, device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (half-split pairs) of x [B, heads, S, head_dim], in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, S, d = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, S, d))


class Block(nn.Module):
    """Pre-norm: h + attn(norm(h)), then h + MoE(norm(h)) with a softmax top-k router. The router and the
    experts run outside autocast: fp32 router scores, bf16 experts (mok's contract)."""

    def __init__(self, c: ModelConfig, engine: str, torch_impl: str, precision: str = "bf16",
                 fp8_weight_grads: bool = True):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(c.d_model), nn.RMSNorm(c.d_model)
        self.attn = Attention(c.d_model, c.heads)
        self.router = mok.torch.TopKRouter(c.d_model, c.experts, c.topk, aux_loss_coeff=c.aux_coeff)
        if engine == "mok":
            config = mok.Config(max_tokens=c.seq * c.batch, capacity=c.capacity)
            self.moe = mok.torch.MoE(c.d_model, c.intermediate, c.experts, c.topk, c.shared, config=config,
                                     precision=precision,
                                     fp8_weight_grads=fp8_weight_grads if precision != "bf16" else None)
        else:
            self.moe = PlainMoE(c.d_model, c.intermediate, c.experts, c.topk, c.shared, impl=torch_impl)

    def forward(self, h, cos, sin):
        h = h + self.attn(self.norm1(h), cos, sin)
        x = self.norm2(h).to(torch.bfloat16).reshape(-1, h.shape[-1])
        with torch.autocast(h.device.type, enabled=False):
            idx, w, aux = self.router(x, return_aux_loss=True)
            y = self.moe(x, idx, w)
        return h + y.view(h.shape), aux


class MoELM(nn.Module):
    def __init__(self, c: ModelConfig, engine: str, torch_impl: str = "auto", precision: str = "bf16",
                 fp8_weight_grads: bool = True):
        """precision: mok's expert GEMMs (engine "mok"): "bf16" or "fp8"; the torch engine computes in bf16.
        fp8_weight_grads: with fp8, the weight-gradient GEMMs in FP8 (True) or bf16."""
        super().__init__()
        if c.d_model % c.heads or (c.d_model // c.heads) % 2:
            raise SystemExit(f"train_lm: d_model {c.d_model} must split into {c.heads} heads of an even size")
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c, engine, torch_impl, precision, fp8_weight_grads)
                                    for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        cos, sin = rope_tables(c.seq, c.d_model // c.heads, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, S, vocab], the routers' load-balancing loss summed over layers)."""
        S = tokens.shape[1]
        h = self.embed(tokens)
        aux = h.new_zeros((), dtype=torch.float32)
        for b in self.blocks:
            h, a = b(h, self.cos[:S], self.sin[:S])
            aux = aux + a
        return self.head(self.norm(h)), aux


def is_routed(name: str) -> bool:
    """The routed experts (per rank under EP); everything else is replicated and all-reduced."""
    return name.endswith(("moe.w1", "moe.w2", "moe.w3"))


def _generator(seed: int, *parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(":".join(str(p) for p in (seed, *parts)).encode()))


@torch.no_grad()
def init_weights(model: MoELM, seed: int, rank: int) -> None:
    """Every parameter from its own generator, keyed by (seed, name[, global expert]): the same model for
    both engines and every EP size. Normal(0, 0.02) truncated at 3 std, residual outputs scaled by
    1/sqrt(2*layers), norms at 1."""
    out_std = 0.02 / math.sqrt(2 * model.config.layers)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        std = out_std if name.endswith(("attn.out.weight", "moe.w2", "moe.shared_w2")) else 0.02
        if is_routed(name):
            for e in range(p.shape[0]):
                tmp = torch.empty(p.shape[1:], dtype=torch.float32)
                nn.init.trunc_normal_(tmp, std=std, a=-3 * std, b=3 * std,
                                      generator=_generator(seed, name, rank * p.shape[0] + e))
                p[e].copy_(tmp)
        else:
            tmp = torch.empty(p.shape, dtype=torch.float32)
            nn.init.trunc_normal_(tmp, std=std, a=-3 * std, b=3 * std, generator=_generator(seed, name))
            p.copy_(tmp)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy in nats (log_softmax + gather: deterministic on CUDA, where nll_loss is
    flagged nondeterministic under torch.use_deterministic_algorithms)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).mean()


# ---- the optimizer ---------------------------------------------------------------------------------------

class Trainer:
    """AdamW on fp32 master weights. The bf16 parameters (mok's experts and shared expert) get fp32 masters;
    their bf16 .grads are widened into the masters' .grads and the updated masters are rounded back. After
    backward: replicated gradients averaged over the ranks; routed ones divided by the world size (each
    rank's experts already summed the gradients of every rank's tokens)."""

    def __init__(self, model: MoELM, args, d: Dist):
        self.model, self.args, self.d = model, args, d
        named = list(model.named_parameters())
        self.bf16 = [(n, p) for n, p in named if p.dtype == torch.bfloat16]
        self.masters = [p.detach().float().clone() for _, p in self.bf16]
        bf16_ids = {id(p) for _, p in self.bf16}
        opt_params = [(n, p) for n, p in named if id(p) not in bf16_ids]
        opt_params += [(n, m) for (n, _), m in zip(self.bf16, self.masters)]
        self.opt_named = opt_params
        decay = [p for n, p in opt_params if p.dim() >= 2 and "embed" not in n]
        no_decay = [p for n, p in opt_params if not (p.dim() >= 2 and "embed" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(self, step: int) -> float:
        a = self.args
        if step <= a.warmup:
            return a.lr * step / max(a.warmup, 1)
        progress = (step - a.warmup) / max(a.steps - a.warmup, 1)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def step(self, batch: torch.Tensor, step: int, attn: SDPBackend) -> torch.Tensor:
        model, d = self.model, self.d
        model.train()
        for p in model.parameters():
            p.grad = None
        inp, tgt = batch[:, :-1], batch[:, 1:]
        with sdpa_kernel(attn), torch.autocast(d.device.type, dtype=torch.bfloat16):
            logits, aux = model(inp)
        loss = lm_loss(logits, tgt)
        (loss + aux).backward()
        self._reduce_grads()
        self._clip(self.args.clip)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        self.opt.step()
        with torch.no_grad():
            for (_, p), m in zip(self.bf16, self.masters):
                p.copy_(m)
        return loss.detach()

    def _reduce_grads(self) -> None:
        """fp32 gradients on the optimizer's parameters (bf16 ones widened into the masters), then the
        data-parallel reduction: replicated ones averaged in fp32 (one flat all-reduce), routed ones / W."""
        for (_, p), m in zip(self.bf16, self.masters):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        for _, p in self.opt_named:
            if p.grad is None:  # a parameter this step did not reach
                p.grad = torch.zeros_like(p)
        d = self.d
        if d.world == 1:
            return
        grads = [p.grad for n, p in self.opt_named if not is_routed(n)]
        flat = torch._utils._flatten_dense_tensors(grads)
        all_mean_(flat, d)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)
        for n, p in self.opt_named:
            if is_routed(n):
                p.grad.div_(d.world)

    def _clip(self, max_norm: float) -> None:
        """Global gradient norm (replicated gradients counted once, routed ones summed over the ranks)."""
        if max_norm <= 0:
            return
        grads = [(is_routed(n), p.grad) for n, p in self.opt_named]
        dev = self.d.device
        rep = torch.stack([g.float().square().sum() for r, g in grads if not r] or [torch.zeros((), device=dev)])
        rout = torch.stack([g.float().square().sum() for r, g in grads if r] or [torch.zeros((), device=dev)])
        rout = rout.sum()
        if self.d.world > 1:
            dist.all_reduce(rout)
        total = (rep.sum() + rout).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([g for _, g in grads], coef)


@torch.no_grad()
def evaluate(model: MoELM, windows: torch.Tensor, args, d: Dist, attn: SDPBackend) -> float:
    """Mean validation loss over the fixed windows; each rank evaluates its shard of every batch."""
    model.eval()
    B, total = args.batch, torch.zeros((), device=d.device)
    per_step = B * d.world
    n = windows.shape[0] // per_step
    for i in range(n):
        batch = windows[i * per_step + d.rank * B:i * per_step + (d.rank + 1) * B].to(d.device)
        with sdpa_kernel(attn), torch.autocast(d.device.type, dtype=torch.bfloat16):
            logits, _ = model(batch[:, :-1])
        total += lm_loss(logits, batch[:, 1:])
    return float(all_mean_(total / n, d))


# ---- checkpoints -----------------------------------------------------------------------------------------

def save_checkpoint(path: Path, step: int, model: MoELM, trainer: Trainer, batches: Batches, history: dict,
                    d: Dist) -> None:
    """One file per rank (the routed experts differ): model, masters, optimizer, data position, RNG, history."""
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "format": CHECKPOINT_FORMAT, "step": step, "world": d.world, "rank": d.rank,
        "model_config": dataclasses.asdict(model.config), "model": model.state_dict(),
        "masters": trainer.masters, "optimizer": trainer.opt.state_dict(), "data": batches.state_dict(),
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else torch.empty(0)},
        "history": history,
    }
    file = path / f"rank{d.rank:03d}.pt"
    tmp = file.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, file)
    if d.world > 1:
        dist.barrier()


def load_checkpoint(path: Path, model: MoELM, trainer: Trainer, batches: Batches, d: Dist) -> tuple[int, dict]:
    file = Path(path) / f"rank{d.rank:03d}.pt"
    if not file.is_file():
        raise SystemExit(f"train_lm: no checkpoint {file} (a checkpoint folder holds rank000.pt, rank001.pt, ...)")
    state = torch.load(file, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"train_lm: {file} is not a train_lm checkpoint (format {state.get('format')!r})")
    if state["world"] != d.world:
        raise SystemExit(f"train_lm: {file} was saved by {state['world']} ranks, this run has {d.world} "
                         "(each rank holds its own experts: resume with the same number of processes)")
    saved, mine = state["model_config"], dataclasses.asdict(model.config)
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        raise SystemExit(f"train_lm: {file} has another model configuration (saved, now): {diff}")
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for m, src in zip(trainer.masters, state["masters"]):
            m.copy_(src)
    trainer.opt.load_state_dict(state["optimizer"])
    batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["cpu"])
    if d.device.type == "cuda" and state["rng"]["cuda"].numel():
        torch.cuda.set_rng_state(state["rng"]["cuda"], d.device)
    return int(state["step"]), state["history"]


# ---- progress --------------------------------------------------------------------------------------------

class Progress:
    """A tqdm bar on rank 0 (loss and tokens/s), or plain lines when tqdm is missing or --no-tqdm."""

    def __init__(self, total: int, initial: int, label: str, enabled: bool, use_tqdm: bool):
        self.bar, self.enabled, self.label = None, enabled, label
        if enabled and use_tqdm:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, n: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
        else:
            print(f"[{self.label}] step {step:5d}  loss {loss:.4f}  {tok_s:,.0f} tokens/s", flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- one training run ------------------------------------------------------------------------------------

@dataclass
class Run:
    label: str
    engine: str
    tokens_per_step: int = 0
    precision: str = "bf16"  # of the expert GEMMs (mok.PRECISIONS)
    history: dict = field(default_factory=lambda: {"step": [], "loss": [], "step_ms": [], "val_step": [],
                                                   "val_loss": []})

    @property
    def final_val(self) -> float:
        return self.history["val_loss"][-1]

    def median_step_ms(self, skip: int) -> float | None:
        ms = [m for s, m in zip(self.history["step"], self.history["step_ms"]) if s > skip]
        return statistics.median(ms) if ms else None


def model_config(args, d: Dist) -> ModelConfig:
    return ModelConfig(args.layers, args.d_model, args.heads, args.experts, args.topk, args.intermediate,
                       args.shared, args.seq, args.batch, args.aux_coeff,
                       float(args.capacity if args.capacity is not None else d.world))


def run_precision(args, engine: str) -> str:
    """The precision of ``engine``'s expert GEMMs as mok names it: --precision for mok, bf16 for the torch engine."""
    return mok.Config(precision=args.precision).precision if engine == "mok" else "bf16"


def train(args, d: Dist, corpus: Corpus, engine: str, label: str, *, resume: Path | None = None,
          save_at: set | None = None, ckpt_dir: Path | None = None) -> Run:
    """Trains a fresh model (seed ``args.seed``) to ``args.steps`` steps, or continues ``resume``."""
    attn = ATTN_BACKENDS[args.attn]
    torch.manual_seed(args.seed)
    cfg = model_config(args, d)
    precision = run_precision(args, engine)
    model = MoELM(cfg, engine, args.torch_impl, precision, args.fp8_weight_grads == "fp8")
    init_weights(model, args.seed, d.rank)
    model.to(d.device)
    trainer = Trainer(model, args, d)
    batches = Batches(corpus.train, args.seq, args.batch * d.world, args.seed)
    windows = val_windows(corpus.val, args.seq, args.val_batches * args.batch * d.world)
    run = Run(label, engine, args.batch * args.seq * d.world, precision)
    start = 0
    if resume is not None:
        start, run.history = load_checkpoint(resume, model, trainer, batches, d)
    if engine == "mok":
        mok.torch.set_checks("off")  # no host sync per layer; mok.torch.check() once per log interval
    cuda = d.device.type == "cuda"
    progress = Progress(args.steps, start, label, d.main, not args.no_tqdm)
    tokens_per_step = run.tokens_per_step

    def validate(step):
        v = evaluate(model, windows, args, d, attn)
        run.history["val_step"].append(step)
        run.history["val_loss"].append(v)
        progress.write(f"[{label}] step {step:5d}  validation loss {v:.4f}")

    if start == 0 and args.val_every > 0:
        validate(0)
    pending = []  # (step, loss, start event/time, end event/time) since the last flush

    def flush():
        if not pending:
            return
        losses = all_mean_(torch.stack([p[1] for p in pending]).float(), d).tolist()
        if cuda:
            pending[-1][3].synchronize()
            ms = [s.elapsed_time(e) for _, _, s, e in pending]
        else:
            ms = [(e - s) * 1e3 for _, _, s, e in pending]
        if engine == "mok":
            mok.torch.check()
        for (step, _, _, _), loss, m in zip(pending, losses, ms):
            run.history["step"].append(step)
            run.history["loss"].append(loss)
            run.history["step_ms"].append(m)
        progress.update(pending[-1][0], len(pending), losses[-1], tokens_per_step / (statistics.mean(ms) / 1e3))
        pending.clear()

    try:
        for step in range(start + 1, args.steps + 1):
            batch = batches.next()[d.rank * args.batch:(d.rank + 1) * args.batch].to(d.device, non_blocking=True)
            if cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
            else:
                t0 = time.perf_counter()
            loss = trainer.step(batch, step, attn)
            if cuda:
                t1.record()
            else:
                t1 = time.perf_counter()
            pending.append((step, loss, t0, t1))
            val_now = args.val_every > 0 and (step % args.val_every == 0 or step == args.steps)
            save_now = ckpt_dir is not None and bool(save_at) and step in save_at
            if step % args.log_every == 0 or step == args.steps or val_now or save_now:
                flush()
            if val_now:
                validate(step)
            if save_now:
                save_checkpoint(ckpt_dir / f"step{step:06d}", step, model, trainer, batches, run.history, d)
                progress.write(f"[{label}] step {step:5d}  checkpoint {ckpt_dir / f'step{step:06d}'}")
        flush()
    finally:
        progress.close()
        if engine == "mok":
            mok.torch.set_checks("sync")
    return run


# ---- results -----------------------------------------------------------------------------------------------

def command_line() -> str:
    return " ".join(["examples/train_lm.py", *sys.argv[1:]])


def _moving_mean(values: list, window: int) -> list:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: list[Run], unigram: float, path: Path, title: str, window: int = 10) -> bool:
    """Train loss (per step, faint; moving mean of ``window`` steps), validation loss and throughput against
    step, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed, so {path} was not written (pip install matplotlib)")
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    for i, r in enumerate(runs):
        h, color = r.history, f"C{i}"
        ax1.plot(h["step"], h["loss"], color=color, lw=0.6, alpha=0.35)
        ax1.plot(h["step"], _moving_mean(h["loss"], window), color=color, lw=1.2, label=f"{r.label}: train")
        ax1.plot(h["val_step"], h["val_loss"], "o--", color=color, ms=4, lw=1, label=f"{r.label}: validation")
        tok_s = [r.tokens_per_step / (m / 1e3) for m in h["step_ms"]]
        ax2.plot(h["step"], tok_s, color=color, lw=0.6, alpha=0.35)
        ax2.plot(h["step"], _moving_mean(tok_s, window), color=color, lw=1.2, label=r.label)
    ax1.axhline(unigram, color="gray", ls="--", lw=1, label=f"byte unigram entropy {unigram:.3f}")
    ax1.set_ylabel("loss (nats per byte)")
    ax1.legend(fontsize=8)
    ax1.set_title(title, fontsize=9)
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return True


def write_outputs(args, d: Dist, corpus: Corpus, runs: list[Run], metrics: dict, checks: dict,
                  errors: dict | None = None) -> None:
    """Rank 0: the run's JSON (every history) and plot in --out-dir, the record in --results-dir."""
    if not d.main:
        return
    cfg = model_config(args, d)
    unigram = metrics["unigram_entropy"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if d.device.type == "cuda" else "cpu"
    title = (f"train_lm: {cfg.describe()}, EP {d.world}, attn {args.attn}, mok {run_precision(args, 'mok')}, {gpu}, "
             f"{commit_id()}")
    if not args.no_plot:
        plot([r for r in runs if r.label in ("mok", "torch")] or runs, unigram, Path(args.plot or out / "train_lm.png"),
             title, window=max(1, min(args.log_every, args.steps // 10 or 1)))
    entry = {"bench": "train_lm", "shape": cfg.describe(), "ep": d.world, "tokens_per_rank": args.batch * args.seq,
             "attn": args.attn, "seed": args.seed, "precision": run_precision(args, "mok"),
             "corpus": {"files": corpus.files, "train_bytes": corpus.train.numel(), "val_bytes": corpus.val.numel(),
                        "sha256": corpus.sha256[:16]},
             "metrics": metrics}
    run_json = {**envelope([entry], command_line()), "args": vars(args), "checks": checks, "errors": errors or {},
                "runs": {r.label: {"engine": r.engine, "precision": r.precision, **r.history} for r in runs}}
    (out / "train_lm.json").write_text(json.dumps(run_json, indent=1) + "\n")
    print(f"json: {out / 'train_lm.json'}")
    if args.results_dir:
        print(f"record: {write_record(args.results_dir, 'train_lm', [entry], command_line())}")


def same_bits(a: list[float], b: list[float]) -> bool:
    """Bitwise equality of two loss lists (fp32 values held as Python floats; NaN never equal)."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def check(args, d: Dist, corpus: Corpus, metrics: dict) -> int:
    """The acceptance checks in one invocation (see the module docstring)."""
    half = args.steps // 2
    if half < 1:
        raise SystemExit("train_lm: --check needs --steps >= 2 (it resumes from the half-way checkpoint)")
    made_tmp = args.ckpt_dir is None
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else None
    if made_tmp:
        box = [tempfile.mkdtemp(prefix="train_lm-check-") if d.main else None]
        if d.world > 1:
            dist.broadcast_object_list(box, src=0)
        ckpt = Path(box[0])
    try:
        a = train(args, d, corpus, "mok", "mok", save_at={half}, ckpt_dir=ckpt)
        b = train(args, d, corpus, "mok", "mok repeat")
        r = train(args, d, corpus, "mok", "mok resumed", resume=ckpt / f"step{half:06d}")
        try:
            t = train(args, d, corpus, "torch", "torch")
        except Exception as e:  # noqa: BLE001 - mok's results still get written; the check fails
            import traceback

            traceback.print_exc()
            torch_error = f"{type(e).__name__}: {e}"
            t = None
        else:
            torch_error = None
    finally:
        if made_tmp and d.main:
            shutil.rmtree(ckpt, ignore_errors=True)
    ha, hb, hr = a.history, b.history, r.history
    repeat = same_bits(ha["loss"], hb["loss"]) and same_bits(ha["val_loss"], hb["val_loss"])
    tail = [i for i, s in enumerate(ha["step"]) if s > half]
    vtail = [i for i, s in enumerate(ha["val_step"]) if s > half]
    resumed = (hr["step"] == ha["step"] and same_bits([hr["loss"][i] for i in tail], [ha["loss"][i] for i in tail])
               and same_bits([hr["val_loss"][i] for i in vtail], [ha["val_loss"][i] for i in vtail]))
    rel = abs(t.final_val - a.final_val) / abs(a.final_val) if t is not None else math.inf
    finite = all(math.isfinite(v) for v in ha["loss"] + ha["val_loss"])
    falls = ha["val_loss"][-1] < ha["val_loss"][0]
    skip = min(10, args.steps // 4)
    metrics.update({"final_val_loss": a.final_val, "bitwise_repeat": int(repeat), "resume_equal": int(resumed),
                    "torch_final_val_loss": t.final_val if t else None, "val_loss_rel_diff": rel if t else None,
                    "mok_step_ms": a.median_step_ms(skip), "torch_step_ms": t.median_step_ms(skip) if t else None})
    checks = {"bitwise_repeat": repeat, "resume_equal": resumed, "torch_within_2pct": rel < 0.02,
              "losses_finite": finite, "val_loss_falls": falls}
    errors = {"torch": torch_error[:1000]} if torch_error else {}
    write_outputs(args, d, corpus, [a, b, r] + ([t] if t else []), metrics, checks, errors)
    if d.main:
        first_diff = next((s for s, x, y in zip(ha["step"], ha["loss"], hb["loss"]) if x != y), None)
        print("\n==== train_lm --check ====")
        print(f"model        {model_config(args, d).describe()}, EP {d.world}, attn {args.attn}, "
              f"mok precision {a.precision}")
        print(f"corpus       {corpus.files} files, {corpus.train.numel():,} train / {corpus.val.numel():,} val bytes, "
              f"unigram entropy {metrics['unigram_entropy']:.4f} nats")
        tv = f"{t.final_val:.4f}" if t else f"failed ({torch_error.splitlines()[0][:200]})"
        print(f"val loss     mok {a.final_val:.4f}   torch {tv}   (relative difference {rel:.2e})")
        sm, st = metrics["mok_step_ms"], metrics["torch_step_ms"]
        if sm and st:
            print(f"step time    mok {sm:.2f} ms   torch {st:.2f} ms   (median after step {skip}; "
                  f"torch/mok {st / sm:.2f}x)")
        for k, v in checks.items():
            extra = f" (first different step: {first_diff})" if k == "bitwise_repeat" and not v and first_diff else ""
            print(f"{k:18s} {'yes' if v else 'NO'}{extra}")
        print("train_lm check: " + ("PASSED" if all(checks.values()) else "FAILED"))
    return 0 if all(checks.values()) else 1


# ---- command line ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (one GPU per process, torchrun) or cpu (mok's slow CPU path, one process)")
    g.add_argument("--engine", choices=ENGINES, default="mok", help="MoE experts: mok's kernels or plain PyTorch")
    g.add_argument("--check", action="store_true", help="the acceptance checks (module docstring); exit 1 on failure")
    g.add_argument("--preset", choices=(*PRESETS, "auto"), default="auto",
                   help="default sizes: gpu (sized for one H200) or tiny (the CPU test); auto: by --device")
    g.add_argument("--steps", type=int, help="optimizer steps (preset)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--attn", choices=tuple(ATTN_BACKENDS), default="math",
                   help="SDPA backend; math (default) is deterministic in forward and backward (docs/training.md)")
    g.add_argument("--torch-impl", choices=IMPLS, default="auto",
                   help="the torch engine's experts: torch._grouped_mm, a per-expert loop, or auto")
    g.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="mok's expert GEMMs: bf16, or fp8 (block-scaled, docs/fp8.md; CUDA only); the torch engine "
                        "stays bf16")
    g.add_argument("--fp8-weight-grads", choices=("fp8", "bf16"), default="fp8",
                   help="with --precision fp8: the weight-gradient GEMMs in FP8 (default) or bf16 (Config.fp8_weight_grads)")
    m = p.add_argument_group("model and data (defaults from the preset)")
    sizes = (("layers", int, "transformer blocks"), ("d-model", int, "hidden size H (mok: a multiple of 64)"),
             ("heads", int, "attention heads"), ("experts", int, "routed experts E (a multiple of the world size)"),
             ("topk", int, "experts per token K"), ("intermediate", int, "routed expert I (a multiple of 64)"),
             ("shared", int, "shared expert I (0: none)"), ("seq", int, "bytes per sequence"),
             ("batch", int, "sequences per rank and step"), ("lr", float, "peak learning rate"),
             ("warmup", int, "linear warm-up steps, then cosine to lr/10"),
             ("val-every", int, "validate every N steps (0: never)"),
             ("val-batches", int, "validation batches (fixed windows of the held-out files)"),
             ("log-every", int, "progress, throughput and mok.torch.check() every N steps"))
    for name, kind, text in sizes:
        m.add_argument(f"--{name}", type=kind, help=text)
    m.add_argument("--aux-coeff", type=float, default=0.01, help="load-balancing loss coefficient")
    m.add_argument("--capacity", type=float, help="mok Config.capacity (default: the world size: never overflows)")
    m.add_argument("--weight-decay", type=float, default=0.1)
    m.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    m.add_argument("--corpus", help="folder of .py files (default: the standard library's)")
    o = p.add_argument_group("outputs")
    o.add_argument("--out-dir", default="train_lm-out", help="train_lm.json (every curve) and train_lm.png")
    o.add_argument("--results-dir", help="also write <date>-train_lm-<commit>.json here (e.g. bench/results)")
    o.add_argument("--plot", help="PNG path (default: OUT_DIR/train_lm.png)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--no-tqdm", action="store_true", help="plain progress lines")
    o.add_argument("--ckpt-dir", help="checkpoint folder (default checkpoints/train_lm; --check: a temporary one "
                                      "unless given, which must be shared by the ranks of a multi-node run)")
    o.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (and at the end)")
    o.add_argument("--resume", help="a checkpoint folder (CKPT_DIR/stepNNNNNN) to continue from")
    args = p.parse_args(argv)
    preset = args.preset if args.preset != "auto" else ("gpu" if args.device == "cuda" else "tiny")
    for k, v in PRESETS[preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.preset = preset
    for k in ("layers", "d_model", "heads", "experts", "topk", "intermediate", "seq", "batch", "steps",
              "log_every", "val_batches"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.check and args.resume:
        p.error("--check makes its own checkpoint; leave out --resume")
    if args.check and args.val_every <= 0:
        p.error("--check compares validation losses: --val-every must be positive")
    if args.precision != "bf16":
        if args.engine != "mok" and not args.check:
            p.error(f"--precision {args.precision} sets mok's layers: use it with --engine mok (the torch engine "
                    "computes in bf16)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    d = init_distributed(args.device)
    if args.device == "cpu" and d.world > 1 and (args.engine == "mok" or args.check):
        raise SystemExit("train_lm: mok's CPU path runs one process (EP 1); use CUDA GPUs for EP > 1")
    if args.experts % d.world:
        raise SystemExit(f"train_lm: --experts {args.experts} must be a multiple of the world size {d.world}")
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every torch.empty with NaN; nothing here reads memory it did not write.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    corpus = load_corpus(args.corpus)
    metrics = {"steps": args.steps, "unigram_entropy": corpus.unigram_entropy()}
    if d.main:
        print(f"train_lm: {model_config(args, d).describe()}, EP {d.world}, device {d.device}, attn {args.attn}, "
              f"mok precision {run_precision(args, 'mok')}; "
              f"corpus {corpus.root}: {corpus.files} files, {corpus.train.numel():,} train / "
              f"{corpus.val.numel():,} val bytes, unigram entropy {metrics['unigram_entropy']:.4f} nats", flush=True)
    try:
        if args.check:
            return check(args, d, corpus, metrics)
        ckpt = Path(args.ckpt_dir or "checkpoints/train_lm")
        saves = set()
        if args.save_every:
            saves = set(range(args.save_every, args.steps + 1, args.save_every)) | {args.steps}
        run = train(args, d, corpus, args.engine, args.engine, resume=Path(args.resume) if args.resume else None,
                    save_at=saves, ckpt_dir=ckpt if saves else None)
        skip = min(10, args.steps // 4)
        key = "final_val_loss" if args.engine == "mok" else "torch_final_val_loss"
        if run.history["val_loss"]:
            metrics[key] = run.final_val
        metrics[f"{args.engine}_step_ms"] = run.median_step_ms(skip)
        write_outputs(args, d, corpus, [run], metrics, {})
        return 0
    finally:
        if args.engine == "mok" or args.check:
            mok.torch.release()
        if d.world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
