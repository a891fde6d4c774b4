#!/usr/bin/env bash
# Creates the MaxText environment (.venv-maxtext, gitignored) for the side-by-side TPU AOT
# benchmark (experiments/bench/tpu_aot.py). MaxText pins its own jax / libtpu / flax, so it
# lives apart from the project's .venv; the benchmark calls it by subprocess through
# experiments/reference/maxtext_aot_driver.py. No tokenizer, dataset or cloud storage is needed:
# MaxText's train_compile lowers and compiles the train step for a TPU topology on this CPU
# machine, from the model's yml config alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/experiments/reference/find_python.sh"
PY="$(find_python 3.12 PY312)"
VENV="$ROOT/.venv-maxtext"
MAXTEXT_VERSION="${MAXTEXT_VERSION:-0.2.5}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null || true
# The same jax and libtpu (the TPU compiler) as the project's .venv (requirements.lock), so both
# programs are compiled by one compiler version.
JAX_PIN="$(grep -E '^jax==' "$ROOT/requirements.lock")"
LIBTPU_PIN="$(grep -E '^libtpu==' "$ROOT/requirements.lock")"
"$VENV/bin/python" -m pip install "maxtext[tpu]==$MAXTEXT_VERSION" "$JAX_PIN" "${JAX_PIN/jax==/jaxlib==}" "$LIBTPU_PIN"
# train_compile's flags parse without a TPU; the driver prints the versions it runs with.
ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu "$VENV/bin/python" -c \
  "import maxtext.trainers.pre_train.train_compile, jax, importlib.metadata as m; print('ok maxtext', m.version('maxtext'), 'jax', jax.__version__, 'libtpu', m.version('libtpu'))"
