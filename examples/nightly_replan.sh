#!/usr/bin/env bash
# The nightly re-plan: fresh traces in; the serving bundle replaced only when a plan solved
# from them is better on fresh traffic neither plan was fitted on.
#
#   examples/nightly_replan.sh FRESH_TRACE DEPLOYED_BUNDLE [WORK_DIR]
#
# FRESH_TRACE: a v1 trace of recent traffic (`moeplan profile`, `moeplan trace ingest`).
# DEPLOYED_BUNDLE: the bundle serving now (`moeplan export`); its EP size is kept.
# WORK_DIR: where the fitted predictor, the plan, the new bundle and verdict.json go (a new
# temporary directory by default; one that exists must be empty).
#
# Steps: split FRESH_TRACE by request (HOLDOUT of it held out), fit on the rest, solve with
# the deployed plan's device numbers and a move cost (`solve --align-to --move-cost`),
# export, verify, and score the new bundle against the deployed one on the held-out
# requests (`evaluate --against --require-better`). Only a verdict of `better` (beyond the
# 90% interval over requests) rolls the new bundle out: copied beside DEPLOYED_BUNDLE, the
# deployed one renamed to DEPLOYED_BUNDLE.previous (replacing an older one) and the copy
# renamed into its place, so a reader finds the old bundle or the new one, whole.
#
# Environment: METHOD (ceo), MOVE_COST (0.002), HOLDOUT (0.3), SEED (0), JOBS (2),
# FORMATS (moeplan,sglang,vllm-ascend,trtllm), MOEPLAN (the moeplan executable).
# Exit 0 when the run decided (the last line says `rolled out` or `kept`); a failed step
# exits with its status and leaves DEPLOYED_BUNDLE as it was.
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 FRESH_TRACE DEPLOYED_BUNDLE [WORK_DIR]" >&2
  exit 2
fi
fresh="$1"
deployed="${2%/}"
work="${3:-$(mktemp -d -t moeplan-nightly-XXXXXX)}"
method="${METHOD:-ceo}"
move_cost="${MOVE_COST:-0.002}"
holdout="${HOLDOUT:-0.3}"
seed="${SEED:-0}"
jobs="${JOBS:-2}"
formats="${FORMATS:-moeplan,sglang,vllm-ascend,trtllm}"
moeplan="${MOEPLAN:-moeplan}"

if [ -e "$work" ] && [ -n "$(ls -A "$work")" ]; then
  echo "nightly_replan.sh: $work is not empty; give a new or empty work directory" >&2
  exit 2
fi
mkdir -p "$work"
# the deployed bundle is checked (and its EP size read) before any work
verified=$("$moeplan" export --verify "$deployed" --json)  # a bad path: one line, exit 2
ep=$(python -c 'import json, sys; r = json.loads(sys.argv[1]); print(r["ep_size"] if r["ok"] else "")' \
  "$verified")
if [ -z "$ep" ]; then
  echo "nightly_replan.sh: $deployed does not verify as a bundle (moeplan export --verify $deployed)" >&2
  exit 2
fi

echo "== split $fresh: $holdout of its requests held out to judge the plans on"
"$moeplan" trace split "$fresh" --fit-out "$work/fit" --heldout-out "$work/heldout" \
  --holdout "$holdout" --seed "$seed"
echo "== fit on the rest"
"$moeplan" fit "$work/fit" --ngram-routed --out "$work/predictor" --json > "$work/fit.json"
echo "== solve ($method, EP $ep) with the deployed devices' numbers, move cost $move_cost"
"$moeplan" solve "$work/predictor" --method "$method" --ep "$ep" --out "$work/plan" \
  --jobs "$jobs" --align-to "$deployed" --move-cost "$move_cost" --json > "$work/solve.json"
echo "== export and verify"
"$moeplan" export "$work/plan" --out "$work/bundle" --format "$formats" > /dev/null
"$moeplan" export --verify "$work/bundle" > /dev/null
echo "== the new bundle against $deployed on the held-out requests"
status=0
"$moeplan" evaluate "$work/bundle" "$work/heldout" --against "$deployed" --require-better \
  --json > "$work/verdict.json" || status=$?
summary=$(python -c '
import json, sys
v = json.load(open(sys.argv[1]))["against"]
low, high = v["ratio_ci90"] or ("-", "-")
ratio, verdict, moved, experts = v["ratio"], v["verdict"], v["experts_moved"], v["experts"]
print(f"ratio {ratio} (90% interval {low}-{high}), {verdict}; "
      f"{moved} of {experts} experts change device")
' "$work/verdict.json")
if [ "$status" -eq 1 ]; then
  echo "kept $deployed: $summary"
  exit 0
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi
incoming="$deployed.incoming"
rm -rf "$incoming"
cp -r "$work/bundle" "$incoming"  # beside the deployed bundle: the renames stay on one disk
rm -rf "$deployed.previous"
mv "$deployed" "$deployed.previous"
mv "$incoming" "$deployed"
echo "rolled out to $deployed (the previous bundle is $deployed.previous): $summary"
