"""PyTorch peer benchmark: Hugging Face Qwen3-MoE greedy generation (float32, KV cache) on CPU.

    .venv-ref/bin/python experiments/reference/hf_generate.py --batch 8 --prompt-len 64 \
        --new-tokens 128 [--weights HF_DIR] [shape flags as hf_train_step.py]

Runs `model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)` on random prompt ids
(no padding, default DynamicCache). Also times a 1-token generate (prefill + first token) so
the per-step decode time can be separated: ms_per_step = (t_full - t_1) / (N - 1).
Prints one JSON line. With --weights the model (and its config) is loaded from a saved HF dir.
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
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of the full generate (median)")
    ap.add_argument("--weights", default=None, help="load a saved HF model directory instead of random init")
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = build_model(args, weights=args.weights).eval()
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen)
    attn = torch.ones_like(ids)
    common = dict(do_sample=False, attention_mask=attn, pad_token_id=0, eos_token_id=None)

    def run(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **common)
        return time.perf_counter() - t0, out

    run(2)  # warmup (allocations, first-call overheads)
    t1 = median([run(1)[0] for _ in range(args.repeats)])
    fulls = []
    for _ in range(args.repeats):
        t, out = run(args.new_tokens)
        fulls.append(t)
    tf = median(fulls)
    new = out.shape[1] - args.prompt_len
    assert new == args.new_tokens, (new, args.new_tokens)
    ms_step = 1e3 * (tf - t1) / max(args.new_tokens - 1, 1)
    res = {
        "bench": "hf_generate",
        "framework": f"torch {torch.__version__} / transformers {transformers.__version__}",
        "dtype": "float32",
        "threads": args.threads,
        "loadavg_1m_at_end": os.getloadavg()[0], "cpus": os.cpu_count(),
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "new_tokens_per_s": args.batch * args.new_tokens / tf,
        "generate_s": tf,
        "prefill_plus_first_s": t1,
        "ms_per_step": ms_step,
        "decode_tokens_per_s": args.batch * 1e3 / ms_step,
        "params": n_params,
        "impl": implementations(model),
        "weights": args.weights,
        "first_row_tail": out[0, -8:].tolist(),
    }
    if args.weights:
        res["config"] = {k: v for k, v in model.config.to_dict().items()
                         if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
                                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")}
    else:
        res["config"] = config_dict(args)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
