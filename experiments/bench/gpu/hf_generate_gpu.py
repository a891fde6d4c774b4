"""PyTorch peer on GPU: Hugging Face greedy generate (float32, KV cache) on saved weights, one JSON line per batch.

    python3 experiments/bench/gpu/hf_generate_gpu.py --weights DIR --batches 8,64,1 --jsonl OUT.jsonl

The measurement of experiments/reference/hf_generate.py on --device (default cuda), all batches
in one process: model = bench_common.build_model(weights=DIR) (float32, sdpa attention,
transformers' default experts implementation), random prompt ids, generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N); a 2-token warmup, then a 1-token generate (prefill + first
token) and the full one, each closed by torch.cuda.synchronize(); ms_per_step = (t_full - t_1) /
(N - 1), best (min) of --repeats.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import REFERENCE, emit  # noqa: E402

sys.path.insert(0, REFERENCE)
from bench_common import add_shape_args, build_model, implementations  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batches", default="8,64,1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args()

    import torch
    import transformers

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    t = time.perf_counter()
    model = build_model(args, weights=args.weights).to(args.device).eval()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for batch in [int(b) for b in args.batches.split(",") if b]:
        row = {"part": "decode", "impl": "hf", "batch": batch, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "dtype": "float32", "device": args.device,
               "framework": f"torch {torch.__version__} / transformers {transformers.__version__}",
               "params": n_params, "impl_detail": implementations(model), "load_s": load_s}
        try:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).to(args.device)
            common = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)

            def run(n):
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **common)
                sync()
                return time.perf_counter() - t0, out

            run(2)  # warmup (allocations, first-call overheads, kernel selection)
            t1 = min(run(1)[0] for _ in range(args.repeats))
            fulls = []
            for _ in range(args.repeats):
                tf_, out = run(args.new_tokens)
                fulls.append(tf_)
            tf = min(fulls)
            assert out.shape[1] - args.prompt_len == args.new_tokens, out.shape
            ms = 1e3 * (tf - t1) / max(args.new_tokens - 1, 1)
            row.update(generate_s=tf, prefill_plus_first_s=t1, ms_per_step=ms,
                       decode_tokens_per_s=batch * 1e3 / ms, new_tokens_per_s=batch * args.new_tokens / tf,
                       first_row_tail=out[0, -8:].tolist())
        except Exception as e:
            import traceback
            traceback.print_exc()
            row["error"] = repr(e)[-1500:]
        emit(row, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
