#!/usr/bin/env bash
# The main job on the bundled example model, end to end:
#   profile -> split -> fit -> solve -> compare -> export (all four formats) -> verify -> evaluate
# Everything lands in runs/example/ (or $1). Re-running starts from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/example}"
ep="${EP:-4}"
# Replace only an earlier run (marked, or the default folder) or an empty directory: a
# mistyped $1 (a home directory, a project) must never be deleted.
if [ -e "$out" ]; then
  if [ -f "$out/.moeplan-example" ] || [ "$out" = "runs/example" ] || [ -z "$(ls -A "$out")" ]; then
    rm -rf "$out"
  else
    echo "run_example.sh: $out exists and is not an earlier run of this script; choose another directory" >&2
    exit 2
  fi
fi
mkdir -p "$out" && touch "$out/.moeplan-example"

echo "== 1. profile: record how examples/tiny_moe routes examples/prompts.jsonl"
moeplan profile --model examples/tiny_moe/model --prompts examples/prompts.jsonl \
  --out "$out/trace" --save-embeddings

echo "== 2. split the trace by request: half to fit on, half held out"
moeplan trace split "$out/trace" --fit-out "$out/fit" --heldout-out "$out/heldout" --holdout 0.5 --seed 0

echo "== 3. fit the predictors on the fitting half; report their accuracy on the held-out half"
# --holdout 0.5 with the same seed holds out exactly the requests of step 2's held-out trace.
# --ngram-routed keeps every routed expert in the n-gram statistics (better tables, slower fit).
moeplan fit "$out/trace" --holdout 0.5 --seed 0 --ngram-routed --out "$out/predictor"

echo "== 4. solve: place experts and tokens on $ep devices with CEO"
moeplan solve "$out/predictor" --method ceo --ep "$ep" --out "$out/plan" --jobs 2

echo "== 5. compare every solver on the held-out half"
# The ILP solves exactly on the most frequent tokens that fit its variable budget.
moeplan compare "$out/predictor" "$out/heldout" --ep "$ep" --jobs 2 \
  --methods ceo,metis,kmeans,alternating,ilp,vanilla --time-limit 10 \
  --options '{"ilp": {"max_variables": 3000}}' --plot "$out/compare.png"

echo "== 6. export the CEO plan to all four formats and verify the bundle"
moeplan export "$out/plan" --out "$out/bundle" --format moeplan,sglang,vllm-ascend,trtllm
moeplan export --verify "$out/bundle" > /dev/null && echo "bundle verified: $out/bundle"

echo "== 7. evaluate the exported bundle on the held-out half"
moeplan evaluate "$out/bundle" "$out/heldout" --hidden-size 128 --plot "$out/evaluate.png"
