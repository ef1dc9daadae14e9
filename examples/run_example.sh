#!/usr/bin/env bash
# The main job on the bundled example model: profile -> (fit -> solve -> export -> evaluate).
# Everything lands in runs/example/ (or $1). Re-running starts from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/example}"
rm -rf "$out" && mkdir -p "$out"

echo "== 1. profile: record how examples/tiny_moe routes examples/prompts.jsonl"
moeplan profile --model examples/tiny_moe/model --prompts examples/prompts.jsonl \
  --out "$out/trace" --save-embeddings

echo "== 2. the trace"
moeplan trace info "$out/trace"
