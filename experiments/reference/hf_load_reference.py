"""Reference load of an HF checkpoint directory for experiments/bench/hf_load.py: safetensors'
load_file of every shard with each tensor copied out of the file mapping (load_file alone maps the
files and reads nothing until touched), or transformers' from_pretrained (bf16, CPU). Loads once
(the caller warms the page cache) and prints one JSON line: seconds, peak RSS, and peak RSS beyond
the RSS before the load and the loaded tensors' bytes.

    .venv-ref/bin/python experiments/reference/hf_load_reference.py DIR safetensors|transformers
"""
import json
import os
import resource
import sys
import time

import torch
import transformers
from safetensors.torch import load_file


def once(path, how):
    if how == "safetensors":
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update({k: v.clone() for k, v in load_file(os.path.join(path, f)).items()})
        return out
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def nbytes(result):
    tensors = result.values() if isinstance(result, dict) else list(result.parameters()) + list(result.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def main():
    path, how = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    result = once(path, how)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"loader": {"safetensors": "safetensors.torch.load_file + copy",
                                 "transformers": "transformers from_pretrained"}[how] + " (torch, CPU)",
                      "seconds": round(secs, 2),
                      "peak_rss_gb": round(peak / 2 ** 20, 2),
                      "over_result_gb": round((peak - before) / 2 ** 20 - nbytes(result) / 2 ** 30, 2),
                      "transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
