#!/usr/bin/env bash
# Creates the Tunix environment for the side-by-side TPU AOT compile of Tunix's GRPO policy
# update and c2jax's RL learner step (experiments/bench/tunix_rl_aot.py). Tunix (google-tunix on
# PyPI) lives apart from the project's .venv: it brings its own flax / optax / qwix / grain stack.
# The venv goes to $TUNIX_VENV (default: .venv-tunix under the repository root, gitignored). No model weights, tokenizer or dataset are needed: the
# benchmark builds Tunix's model abstractly and compiles for a TPU topology on this CPU machine.
#
#     bash experiments/reference/setup_tunix_env.sh
#     TUNIX_VENV=/some/dir PY312=/path/to/python3.12 bash experiments/reference/setup_tunix_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/experiments/reference/find_python.sh"
PY="$(find_python 3.12 PY312)"
VENV="${TUNIX_VENV:-$ROOT/.venv-tunix}"
TUNIX_VERSION="${TUNIX_VERSION:-0.1.7}"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null || true
# google-tunix 0.1.7 pins no jax version (only its `prod` extra asks for jax[tpu]>=0.6.0), so the
# same jax and libtpu (the TPU compiler) as the project's .venv (requirements.lock) go in: both
# programs are compiled by one compiler version.
JAX_PIN="$(grep -E '^jax==' "$ROOT/requirements.lock")"
LIBTPU_PIN="$(grep -E '^libtpu==' "$ROOT/requirements.lock")"
"$VENV/bin/python" -m pip install "google-tunix==$TUNIX_VERSION" "$JAX_PIN" "${JAX_PIN/jax==/jaxlib==}" "$LIBTPU_PIN"
# Tunix's model and GRPO learner import without a TPU; print the versions the benchmark runs with.
ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu "$VENV/bin/python" -c \
  "import tunix.models.qwen3.model, tunix.rl.grpo.grpo_learner, jax, flax, importlib.metadata as m; print('ok tunix', m.version('google-tunix'), 'jax', jax.__version__, 'flax', flax.__version__, 'libtpu', m.version('libtpu'))"
echo "venv: $VENV"
