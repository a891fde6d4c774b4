#!/usr/bin/env bash
# One-shot GPU benchmark of c2jax vs Hugging Face transformers on one H200 (run from the repo root):
#
#     OUT=/some/dir bash experiments/bench/gpu/run_h200.sh
#
# Parts, in order, each under its own `timeout` (a failing part does not stop the rest), all
# under one wall budget ($BUDGET s, default 540: a 10-minute device run; each part's limit leaves
# the later parts their minimum):
#   0. environment: nvidia-smi, jax.devices(), package versions
#   1. train_c2jax.py       c2jax train step, 89M Qwen3-MoE, 32 x 2048, bf16 (then f32, grouped if time allows)
#   2. hf_train_step_gpu.py HF Qwen3MoeForCausalLM, same shape, torch bf16 (then autocast)
#   3. train_c2jax.py       the 1.40B study model (configs/gpu_study.py), 16 x 2048, bf16 dropless
#                           (ragged_dot experts, cuDNN attention; then XLA attention), each traced:
#                           the top device ops by time go in its row ($OUT/profile/)
#   4. hf_train_step_gpu.py HF peer of the study shape, bf16, torch's grouped_mm experts and SDPA
#   5. decode_c2jax.py      c2jax Sampler decode, 100m model, batches 8, 64, 1 (+ the grouped expert kernel pinned, if time allows)
#   6. hf_generate_gpu.py   HF generate on the same weights, same batches
#   7. summarize.py         tables + c2jax / HF ratios -> $OUT/summary.md
# JAX and torch never run at the same time (JAX preallocates 75% of the GPU memory per process).
# Output: $OUT/results.jsonl (one JSON line per measurement), $OUT/log.txt, $OUT/summary.md.
#
# Missing pure-python dependencies travel as wheels in .whl/ (ml_collections, absl-py, PyYAML)
# and are installed into $SITE. Local CPU smoke test (tiny shapes, torch from another python):
#     TINY=1 JAX_PLATFORMS=cpu HF_DEVICE=cpu PY=.venv/bin/python PY_HF=.venv-ref/bin/python \
#         SITE=/tmp/site_test OUT=/tmp/out_test bash experiments/bench/gpu/run_h200.sh
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 1

OUT=${OUT:-/tmp/c2jax_gpu_out}
PY=${PY:-python3}
PY_HF=${PY_HF:-$PY}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-540}
HF_DEVICE=${HF_DEVICE:-cuda}
WDIR=${WDIR:-/tmp/c2jax_gpu_weights_100m}
mkdir -p "$OUT"
RES="$OUT/results.jsonl"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
T0=$(date +%s)

if [[ -n "${TINY:-}" ]]; then
  JAX_SHAPE=(--set model.num_layers=2 --set model.hidden_size=64 --set model.num_experts=4 --set model.num_experts_per_tok=2
             --set model.moe_intermediate_size=64 --set model.num_heads=2 --set model.num_kv_heads=1
             --set model.head_dim=32 --set model.vocab_size=512)
  HF_SHAPE=(--layers 2 --hidden 64 --experts 4 --topk 2 --moe-intermediate 64 --heads 2 --kv-heads 1
            --head-dim 32 --vocab 512)
  TRAIN=(--batch 2 --seq 64 --steps 2 --warmup 1 --peak-n 256 --variants "${TRAIN_VARIANTS:-bf16,f32,bf16_grouped}")
  HF_TRAIN=(--batch 2 --seq 64 --steps 2 --warmup 1 --peak-n 0 --precisions "${HF_PRECISIONS:-bf16,amp}")
  STUDY=(--model study --batch 2 --seq 64 --steps 2 --warmup 1 --peak-n 0 "${JAX_SHAPE[@]}"
         --variants "${STUDY_VARIANTS:-bf16_grouped,bf16_xla_attn}")
  HF_STUDY=(--model-name study --batch 2 --seq 64 --steps 2 --warmup 1 --peak-n 0 --precisions bf16 "${HF_SHAPE[@]}")
  DEC=(--model tiny --batches 2,1 --prompt-len 8 --new-tokens 8 --bw-bytes $((16 << 20))
       --variants "${DECODE_VARIANTS:-default,grouped}")
  HF_DEC=(--batches 2,1 --prompt-len 8 --new-tokens 8)
else
  JAX_SHAPE=()
  HF_SHAPE=()
  TRAIN=(--batch 32 --seq 2048 --steps 10 --warmup 2 --peak-n 8192 --variants "${TRAIN_VARIANTS:-bf16,f32,bf16_grouped}")
  HF_TRAIN=(--batch 32 --seq 2048 --steps 8 --warmup 3 --peak-n 8192 --precisions "${HF_PRECISIONS:-bf16,amp}")
  STUDY=(--model study --batch 16 --seq 2048 --steps 6 --warmup 2 --peak-n 0
         --variants "${STUDY_VARIANTS:-bf16_grouped,bf16_xla_attn}")
  HF_STUDY=(--model-name study --batch 16 --seq 2048 --steps 5 --warmup 2 --peak-n 0 --precisions bf16 --layers 24 --hidden 1024
            --experts 64 --topk 8 --moe-intermediate 256 --heads 16 --kv-heads 4 --head-dim 128 --vocab 32768
            --experts-impl grouped_mm)
  DEC=(--model 100m --batches 8,64,1 --prompt-len 64 --new-tokens 128 --variants "${DECODE_VARIANTS:-default,grouped}")
  HF_DEC=(--batches 8,64,1 --prompt-len 64 --new-tokens 128)
fi

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# part NAME CAP RESERVE CMD...: run CMD under timeout min(CAP, left - RESERVE) (RESERVE = the later
# parts' minimum); skip (recorded in results.jsonl) below 10 s. The part's limit is exported as
# PART_LIMIT so a driver can stop starting optional variants in time.
part() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local avail=$(( $(left) - reserve ))
  local t=$(( cap < avail ? cap : avail ))
  if (( t < 10 )); then
    echo "=== SKIP $name: $(left) s of the budget left, $reserve s reserved for later parts"
    echo "{\"part\": \"$name\", \"skipped\": \"budget\", \"left_s\": $(left)}" >> "$RES"
    return 0
  fi
  echo "=== $name (timeout ${t}s, elapsed $(( $(date +%s) - T0 ))s): $*"
  local s=$(date +%s)
  PART_LIMIT=$t timeout -k 5 "$t" "$@"
  local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - s ))s"
  if (( rc != 0 )); then
    echo "{\"part\": \"$name\", \"rc\": $rc, \"timed_out\": $([[ $rc == 124 || $rc == 137 ]] && echo true || echo false), \"wall_s\": $(( $(date +%s) - s ))}" >> "$RES"
  fi
  return 0
}

main() {
  echo "=== c2jax GPU bench $(date -u +%FT%TZ) host $(hostname) commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "pip install of .whl failed: unzipping the wheels into $SITE instead"
         $PY -c 'import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(".whl/*.whl")]' "$SITE"; }
  export PYTHONPATH="$SITE:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
  echo "PYTHONPATH=$PYTHONPATH JAX_PLATFORMS=$JAX_PLATFORMS XLA_FLAGS=${XLA_FLAGS:-} budget ${BUDGET}s"
  timeout 20 nvidia-smi || echo "nvidia-smi unavailable"
  part env_jax 45 300 $PY -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())'
  timeout 30 $PY -m pip list 2>/dev/null \
    | grep -iE '^(jax[^ ]*|flax|optax|orbax[^ ]*|chex|numpy|torch|transformers|tokenizers|safetensors|ml.collections|absl.py|pyyaml) ' || true

  part train_c2jax 100 400 $PY experiments/bench/gpu/train_c2jax.py "${TRAIN[@]}" "${JAX_SHAPE[@]}" \
    --jsonl "$RES"
  part train_hf 60 340 $PY_HF experiments/bench/gpu/hf_train_step_gpu.py "${HF_TRAIN[@]}" "${HF_SHAPE[@]}" \
    --device "$HF_DEVICE" --jsonl "$RES"
  part study_c2jax 130 210 $PY experiments/bench/gpu/train_c2jax.py "${STUDY[@]}" --profile-dir "$OUT/profile" \
    --jsonl "$RES"
  part study_hf 70 140 $PY_HF experiments/bench/gpu/hf_train_step_gpu.py "${HF_STUDY[@]}" \
    --device "$HF_DEVICE" --jsonl "$RES"
  rm -rf "$WDIR"
  part decode_c2jax 90 40 $PY experiments/bench/gpu/decode_c2jax.py "${DEC[@]}" --weights-dir "$WDIR" \
    --jsonl "$RES"
  if [[ -f "$WDIR/config.json" ]]; then
    part decode_hf 45 5 $PY_HF experiments/bench/gpu/hf_generate_gpu.py --weights "$WDIR" "${HF_DEC[@]}" \
      --device "$HF_DEVICE" --jsonl "$RES"
  else
    echo "=== SKIP decode_hf: no weights at $WDIR"
  fi
  timeout 30 $PY experiments/bench/gpu/summarize.py "$RES" --md "$OUT/summary.md" || echo "summarize failed"
  echo "=== done in $(( $(date +%s) - T0 ))s"
}

main 2>&1 | tee -a "$LOG"
