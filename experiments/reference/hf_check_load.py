"""Proves a model directory loads in Hugging Face transformers and gives the expected logits.

Runs in the PyTorch reference environment (.venv-ref), e.g. on a checkpoint exported by c2jax:

    .venv-ref/bin/python experiments/reference/hf_check_load.py DIR [--expect NPZ] [--atol 1e-4]

DIR is loaded with AutoModelForCausalLM in float32. NPZ (default DIR/reference.npz) must hold
`input_ids` [B, L] and, for a comparison, `logits` [B, L, V]. The input ids run through a plain
causal forward (no attention mask). Prints one JSON line; exit code 1 if max |diff| > atol,
2 if loading fails or there is nothing to compare against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="model directory (config.json + *.safetensors)")
    ap.add_argument("--expect", default=None, help="npz with input_ids and logits (default DIR/reference.npz)")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="eager", help="attn_implementation: eager (default) or sdpa")
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    npz_path = args.expect or os.path.join(args.dir, "reference.npz")
    out = {"dir": os.path.abspath(args.dir), "expect": os.path.abspath(npz_path), "atol": args.atol,
           "torch": torch.__version__, "transformers": transformers.__version__}
    if not os.path.exists(npz_path):
        out["error"] = f"no npz at {npz_path}; pass --expect"
        print(json.dumps(out))
        return 2
    ref = np.load(npz_path)
    try:
        t0 = time.perf_counter()
        # output_loading_info=True: missing/unexpected keys are reported instead of silently
        # randomly initialised.
        model, info = AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.float32, attn_implementation=args.attn, output_loading_info=True)
        out["load_s"] = round(time.perf_counter() - t0, 3)
    except Exception as e:  # noqa: BLE001 - report any loading failure as JSON
        out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        return 2
    model.eval()
    out["architecture"] = type(model).__name__
    out["params"] = sum(p.numel() for p in model.parameters())
    loading = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if loading:
        out["loading_info"] = loading
    bad_load = bool(info.get("missing_keys")) or bool(info.get("mismatched_keys"))

    input_ids = torch.from_numpy(np.asarray(ref["input_ids"]).astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
    out["logits_shape"] = list(logits.shape)
    if "logits" not in ref:
        out["error"] = "npz has no 'logits' to compare against"
        print(json.dumps(out))
        return 2
    expected = np.asarray(ref["logits"], dtype=np.float32)
    if expected.shape != logits.shape:
        out["error"] = f"shape mismatch: expected {list(expected.shape)}, got {list(logits.shape)}"
        print(json.dumps(out))
        return 1
    diff = np.abs(logits - expected)
    out["max_abs_diff"] = float(diff.max())
    out["mean_abs_diff"] = float(diff.mean())
    out["argmax_agree"] = float((logits.argmax(-1) == expected.argmax(-1)).mean())
    out["ok"] = bool(out["max_abs_diff"] <= args.atol) and not bad_load
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
