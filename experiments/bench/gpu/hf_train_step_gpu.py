"""PyTorch peer on GPU: Hugging Face Qwen3MoeForCausalLM training step (AdamW), one JSON line per precision.

    python3 experiments/bench/gpu/hf_train_step_gpu.py --batch 32 --seq 2048 --precisions bf16,amp --jsonl OUT.jsonl

The model is experiments/reference/bench_common.build_model (the exact shape of
experiments/reference/hf_train_step.py, 88.7M params, transformers' default experts and sdpa
attention implementations); the step is that script's: forward with labels = input ids, backward,
AdamW (betas 0.9/0.95, wd 0.1, eps 1e-8, no clip), zero_grad; here on --device with a
torch.cuda.synchronize() closing each timed step. Precisions:
  bf16  weights, grads and AdamW state in bfloat16 (model.to(bfloat16)): every matmul in bf16,
        including the experts' grouped_mm (which autocast does not cover)
  amp   float32 weights, forward under torch.autocast(bfloat16) (mixed precision; transformers
        casts the grouped_mm input to the f32 weight dtype, so the experts run in f32)
  f32   float32 throughout (torch's default f32 matmul precision; no TF32 unless set)
Also reports a torch 8192^3 bf16 matmul peak for reference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import REFERENCE, emit  # noqa: E402

sys.path.insert(0, REFERENCE)
from bench_common import add_shape_args, build_model, config_dict, implementations, median  # noqa: E402


def torch_matmul_peak(torch, device, n=8192, iters=20):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    sync(torch, device)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(torch, device)
        best = min(best, (time.perf_counter() - t) / iters)
    return 2 * n ** 3 / best


def sync(torch, device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run(args, precision, torch, transformers):
    device = torch.device(args.device)
    model = build_model(args)  # float32, seeded
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    amp = precision == "amp"
    dev_type = "cuda" if str(device).startswith("cuda") else "cpu"
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(torch, device)
        dt = time.perf_counter() - t0
        losses.append(float(out.loss.detach()))
        if i >= args.warmup:
            times.append(dt)
    tokens = args.batch * args.seq
    med = median(times)
    row = {
        "part": "train", "impl": "hf", "model": args.model_name, "variant": precision,
        "framework": f"torch {torch.__version__} / transformers {transformers.__version__}",
        "device": str(device), "device_name": torch.cuda.get_device_name(0) if dev_type == "cuda" else "cpu",
        "dtype": {"bf16": "bfloat16", "amp": "bfloat16 autocast", "f32": "float32"}[precision],
        "param_dtype": "bfloat16" if precision == "bf16" else "float32",
        "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens,
        "warmup": args.warmup, "steps": args.steps,
        "tokens_per_s": tokens / med, "step_s_median": med, "step_s": [round(t, 5) for t in times],
        "loss_first": losses[0], "loss_last": losses[-1], "params": n_params,
        "impl_detail": implementations(model),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "config": config_dict(args),
    }
    if dev_type == "cuda":
        row["memory"] = {"max_allocated": torch.cuda.max_memory_allocated()}
    del model, opt, out
    if dev_type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--precisions", default="bf16,amp")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-n", type=int, default=8192, help="torch bf16 matmul peak probe size (0 = skip)")
    ap.add_argument("--model-name", default="l", help="label of the shape in the rows (l: 89M, study: 1.40B)")
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args()

    import torch
    import transformers

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    env = {"part": "train_env", "impl": "hf", "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda_available": torch.cuda.is_available(), "device": args.device}
    if args.peak_n and args.device.startswith("cuda"):
        try:
            env["torch_matmul_peak_bf16_tflops"] = torch_matmul_peak(torch, args.device, args.peak_n) / 1e12
        except Exception as e:
            env["peak_error"] = repr(e)[:300]
    emit(env, args.jsonl)
    for precision in [p for p in args.precisions.split(",") if p]:
        t = time.perf_counter()
        try:
            row = run(args, precision, torch, transformers)
        except Exception as e:
            import traceback
            traceback.print_exc()
            row = {"part": "train", "impl": "hf", "model": args.model_name, "variant": precision,
                   "error": repr(e)[-1500:]}
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        row["variant_wall_s"] = time.perf_counter() - t
        emit(row, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
