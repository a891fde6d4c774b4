"""PyTorch peer benchmark: Hugging Face Qwen3-MoE training step (float32, AdamW) on CPU.

    .venv-ref/bin/python experiments/reference/hf_train_step.py --layers 6 --hidden 512 \
        --experts 16 --topk 2 --vocab 8192 --batch 8 --seq 512 --steps 4

Each step: forward on random token ids with labels = input ids (HF shifts them; mean
next-token cross-entropy, no router aux loss), backward, AdamW step, zero_grad.
Prints one JSON line: tokens/s (median over the timed steps after --warmup), step times,
parameter count and the exact config so the JAX side can build the same shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_shape_args, build_model, config_dict, implementations, median  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = build_model(args)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(float(out.loss.detach()))
        if i >= args.warmup:
            times.append(dt)
    tokens = args.batch * args.seq
    med = median(times)
    print(json.dumps({
        "bench": "hf_train_step",
        "framework": f"torch {torch.__version__} / transformers {transformers.__version__}",
        "dtype": "float32",
        "threads": args.threads,
        "loadavg_1m_at_end": os.getloadavg()[0], "cpus": os.cpu_count(),
        "batch": args.batch, "seq": args.seq,
        "warmup": args.warmup, "steps": args.steps,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / med,
        "step_s_median": med,
        "step_s": [round(t, 4) for t in times],
        "loss_first": losses[0], "loss_last": losses[-1],
        "params": n_params,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "impl": implementations(model),
        "config": config_dict(args),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
