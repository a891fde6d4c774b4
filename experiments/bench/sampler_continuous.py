"""Continuous batching throughput of the sampler: a stream of requests of mixed prompt and
output lengths through `--batch` cache slots, finished rows refilled with waiting requests (a
prefill every few chunks, as in RL rollouts), over `--decode-devices` host devices and, in the
same run, over one device.

    JAX_PLATFORMS=cpu python experiments/bench/sampler_continuous.py                  # 89M MoE, 32 slots x 1024
    JAX_PLATFORMS=cpu python experiments/bench/sampler_continuous.py --batch 8 --max-len 512

Each configuration runs the same request list twice; the second run is timed (the first
compiles every prefill shape the list needs). tok/s = generated tokens / wall time, prefill and
host work included; prefill_seconds = the part of it spent admitting requests (prefill).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# sampler.py reads --decode-devices into XLA_FLAGS before it imports JAX
from sampler import DECODE_DEVICES, model_config  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import c2jax  # noqa: E402
from c2jax.sampling import Request, Sampler  # noqa: E402


def requests(n: int, vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, int(rng.integers(16, 64))).tolist(),
                    max_new_tokens=int(rng.integers(8, 64)), temperature=1.0, seed=i, reuse_prefix=False)
            for i in range(n)]


def run(cfg, params, reqs, batch, max_len, chunk, devices) -> dict:
    s = Sampler(cfg, params, max_batch=batch, max_len=max_len, chunk=chunk, decode_devices=devices)
    admit, in_prefill = s._admit, [0.0]

    def timed_admit():  # prefill time: admitting waiting requests, up to their first token
        t = time.perf_counter()
        out = admit()
        jax.block_until_ready(s.state.cur)
        in_prefill[0] += time.perf_counter() - t
        return out
    s._admit = timed_admit

    def once():
        rids = [s.submit(r) for r in reqs]
        in_prefill[0] = 0.0
        t = time.perf_counter()
        s.run_until_done()
        dt = time.perf_counter() - t
        return dt, sum(len(c.tokens) for r in rids for c in s.results(r))

    once()  # compiles
    calls0, steps0 = s.prefill_calls, s.decode_steps
    dt, n = once()
    return {"decode_devices": devices, "seconds": dt, "prefill_seconds": in_prefill[0], "tokens": n,
            "tokens_per_s": n / dt, "prefill_calls": s.prefill_calls - calls0,
            "decode_steps": s.decode_steps - steps0}


def main() -> int:
    c2jax.hostmem.retain_freed_memory()  # first: host malloc keeps freed memory before XLA's threads start
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="100m", choices=["tiny", "100m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=0, help="default: 3 x batch")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--decode-devices", type=int, default=2)
    args = ap.parse_args()
    cfg = model_config(args.model)
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    reqs = requests(args.requests or 3 * args.batch, cfg.model.vocab_size, seed=0)
    rows = [run(cfg, params, reqs, args.batch, args.max_len, args.chunk, d)
            for d in ([DECODE_DEVICES, 1] if DECODE_DEVICES > 1 else [1])]
    for r in rows:
        print(json.dumps({"model": args.model, "batch": args.batch, "max_len": args.max_len, **r}), flush=True)
    if len(rows) == 2:
        print(f"{DECODE_DEVICES} devices / 1 device: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
