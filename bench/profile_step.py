"""Per-kernel CUDA time of one mok layer step (forward + backward) from torch.profiler: where a step's time goes.

    python bench/profile_step.py --shapes qwen3,gptoss --engines mok,mok_fp8,mok_fp8_bf16wgrad [--requant] [--top 22]

The shapes are mok.bench's (EP 1, uniform routing, its seeded problem). Each engine runs 3 untimed steps, then 3
profiled ones; the table lists each kernel's CUDA time per step (summed over its launches) and its launches per step,
largest first. mok_fp8 runs Config(precision="fp8"), mok_fp8_bf16wgrad the same with fp8_weight_grads=False;
--requant marks their weight copies stale before every step (a step right after an optimizer update: the weights are
re-quantized in its forward). Needs a GPU and PyTorch.
"""
import argparse

import torch

import mok
import mok.torch
from mok.bench import SHAPES, make_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3,gptoss")
    ap.add_argument("--engines", default="mok,mok_fp8", help="of mok, mok_fp8, mok_fp8_bf16wgrad")
    ap.add_argument("--requant", action="store_true", help="mok_fp8: re-quantize the weights every step")
    ap.add_argument("--top", type=int, default=22, help="kernels listed per engine")
    ap.add_argument("--comm-sms-forward", type=int, default=0,
                    help="Config.comm_sms_forward of every engine (0: automatic), e.g. an A/B of the staged forward's "
                         "dispatch CTAs")
    a = ap.parse_args()
    dev = torch.device("cuda")
    for name in a.shapes.split(","):
        sh = SHAPES[name]
        w, x, idx, tw, dy = make_problem(sh, dev, 0, 1, 0)
        shared = [w.get("shared_w1"), w.get("shared_w2"), w.get("shared_w3")]
        leaves = [x, tw, *w.values()]
        for eng in a.engines.split(","):
            if eng not in ("mok", "mok_fp8", "mok_fp8_bf16wgrad"):
                raise SystemExit(f"--engines: unknown engine {eng!r}")
            fp8 = eng != "mok"
            knobs = {"comm_sms_forward": a.comm_sms_forward} if a.comm_sms_forward else {}
            config = mok.Config(max_tokens=sh.tokens, precision="fp8" if fp8 else "bf16", **knobs)
            if eng == "mok_fp8_bf16wgrad":
                config = mok.Config(max_tokens=sh.tokens, precision="fp8", fp8_weight_grads=False, **knobs)
            spec = mok.torch.layer_spec(sh.hidden, sh.intermediate, sh.experts, sh.topk, sh.shared, config=config)

            def step():
                for t in leaves:
                    t.grad = None
                if fp8 and a.requant:
                    mok.torch.mark_fp8_weights_stale()
                y = mok.torch.moe_experts(x, idx, tw, w["w1"], w["w2"], w["w3"], *shared, spec=spec)
                torch.autograd.backward(y, dy)

            mok.torch.set_checks("off")
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            n = 3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            rows = [(e.key, e.device_time_total / n / 1000.0, e.count // n) for e in prof.key_averages()
                    if e.device_time_total > 0]
            rows.sort(key=lambda r: -r[1])
            knob = f" comm_sms_forward={a.comm_sms_forward}" if a.comm_sms_forward else ""
            print(f"== {name} {eng}{knob}{' (weights re-quantized every step)' if fp8 and a.requant else ''}: "
                  f"kernel time per step {sum(r[1] for r in rows):.3f} ms")
            for key, ms, count in rows[:a.top]:
                print(f"  {ms:8.3f} ms x{count:<3d} {key[:150]}")
            mok.torch.set_checks("sync")
            mok.torch.check()
            for t in leaves:
                t.grad = None
            mok.torch.release()
            torch.cuda.empty_cache()
        del w, x, idx, tw, dy, leaves
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
