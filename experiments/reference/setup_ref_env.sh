#!/usr/bin/env bash
# Creates the PyTorch / Hugging Face reference environment (.venv-ref, gitignored).
# It is separate from the JAX environment: the JAX tests never import torch.
# torch is installed FIRST from the local CPU wheel (pip find-links /opt/wheels), so that
# transformers' dependency resolution does not pull a multi-GB CUDA torch from PyPI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"
PY="$(find_python 3.11 PY311)"
VENV="$ROOT/.venv-ref"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null || true
"$VENV/bin/python" -m pip install "torch==2.13.0"
# Refuse to continue if torch is a CUDA build (would mean the CPU wheel was not used).
"$VENV/bin/python" - <<'PY'
import torch, sys
print("torch", torch.__version__, "cuda build:", torch.version.cuda)
sys.exit(1 if torch.version.cuda else 0)
PY
"$VENV/bin/python" -m pip install "transformers==5.23.0" safetensors numpy
# compressed-tensors: its own int4 quantize / pack_to_int32 build the pack-quantized fixtures.
"$VENV/bin/python" -m pip install "compressed-tensors==0.20.1"
"$VENV/bin/python" -c "import torch, transformers, safetensors, numpy; print('ok torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
