#!/usr/bin/env bash
# The nightly re-plan: fresh traces in; the serving bundle replaced only when a plan solved
# from them is better on fresh traffic neither plan was fitted on.
#
#   examples/nightly_replan.sh FRESH_TRACE DEPLOYED_BUNDLE [WORK_DIR]
#
# FRESH_TRACE: a v1 trace of recent traffic (`moeplan profile`, `moeplan trace ingest`).
# DEPLOYED_BUNDLE: the bundle serving now (`moeplan export`); its EP size is kept.
# WORK_DIR: where the fitted predictor, the plan, the new bundle and verdict.json go (a new
# temporary directory by default, named on the first line; one that exists must be empty,
# and it may not lie inside DEPLOYED_BUNDLE). It is kept.
#
# Steps: split FRESH_TRACE by request (HOLDOUT of it held out), fit on the rest, solve with
# the deployed plan's device numbers and a move cost (`solve --align-to --move-cost`),
# export, verify, and score the new bundle against the deployed one on the held-out
# requests (`evaluate --against --require-better`). Only a verdict of `better` (beyond the
# 90% interval over requests) rolls the new bundle out: copied beside DEPLOYED_BUNDLE and
# swapped into its place in one step (Linux; the deployed one then renamed to
# DEPLOYED_BUNDLE.previous, replacing an older one). A reader finds the old bundle or the
# new one, each whole, never none. Where the swap is not supported (other systems, some
# filesystems) it takes two renames, with an instant between them when there is none (an
# engine reads its bundle when it starts); if the second fails, the first is undone.
#
# Environment: METHOD (ceo), MOVE_COST (0.002), HOLDOUT (0.3), SEED (0), JOBS (2),
# FORMATS (moeplan,sglang,vllm-ascend,trtllm), MOEPLAN (the moeplan executable), PYTHON
# (python3). Exit 0 when the run decided (the last line says `rolled out` or `kept`); a
# failed step exits non-zero and leaves DEPLOYED_BUNDLE as it was. Two runs on one
# DEPLOYED_BUNDLE at once are refused (a lock file beside it).
set -euo pipefail
fail() {
  echo "nightly_replan.sh: $*" >&2
  exit 2
}
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 FRESH_TRACE DEPLOYED_BUNDLE [WORK_DIR]" >&2
  exit 2
fi
fresh="$1"
[ -d "$2" ] || fail "$2 is not a directory (the bundle serving now)"
deployed=$(cd -- "$2" && pwd -P)  # absolute, no trailing slash: the renames go beside it
[ "$deployed" != "/" ] || fail "the deployed bundle cannot be /"
exec 9> "$deployed.lock"
flock -n 9 || fail "another run is re-planning $deployed (it holds $deployed.lock)"
work="${3:-$(mktemp -d -t moeplan-nightly-XXXXXX)}"
method="${METHOD:-ceo}"
move_cost="${MOVE_COST:-0.002}"
holdout="${HOLDOUT:-0.3}"
seed="${SEED:-0}"
jobs="${JOBS:-2}"
formats="${FORMATS:-moeplan,sglang,vllm-ascend,trtllm}"
moeplan="${MOEPLAN:-moeplan}"
python="${PYTHON:-python3}"

work=$(realpath -m -- "$work")  # absolute and resolved, before anything is made there
case "$work/" in
  "$deployed"/*) fail "the work directory $work lies inside the deployed bundle $deployed" ;;
esac
if [ -e "$work" ] && [ -n "$(ls -A "$work")" ]; then
  fail "$work is not empty; give a new or empty work directory"
fi
mkdir -p "$work"
echo "work directory: $work"
# the deployed bundle is checked (and its EP size read) before any work
verified=$("$moeplan" export --verify "$deployed" --json)  # not a bundle: one line, exit 2
ep=$("$python" -c 'import json, sys; print(json.loads(sys.argv[1])["ep_size"])' "$verified")

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
if [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
  exit "$status"  # evaluate failed (its one-line error is above); nothing was decided
fi
summary=$("$python" -c '
import json, sys
v = json.load(open(sys.argv[1]))["against"]
low, high = v["ratio_ci90"] or ("-", "-")
ratio, verdict, moved, experts = v["ratio"], v["verdict"], v["experts_moved"], v["experts"]
print(verdict)
print(f"ratio {ratio} (90% interval {low}-{high}), {verdict}; "
      f"{moved} of {experts} experts change device")
' "$work/verdict.json")
verdict=$(head -n 1 <<< "$summary")
summary=$(tail -n +2 <<< "$summary")
if [ "$status" -eq 1 ] || [ "$verdict" != "better" ]; then
  echo "kept $deployed: $summary"
  exit 0
fi
# the new bundle is copied beside the deployed one (the renames stay on one disk), under a
# name of its own (a fixed one could be a user's), removed again if the run stops before it
# is in place
incoming=$(mktemp -d "$deployed.incoming.XXXXXX") ||
  fail "cannot make a directory beside $deployed; it is as it was"
trap 'rm -rf -- "$incoming"' EXIT
cp -r -- "$work/bundle/." "$incoming/" ||
  fail "could not copy the new bundle beside $deployed (disk full?); $deployed is as it was"
chmod --reference="$work/bundle" "$incoming"  # mktemp made it private
# One step where the system can swap two directories (Linux renameat2 RENAME_EXCHANGE, via
# planner._io.exchange_paths): a reader never finds no bundle. Elsewhere two renames.
swap='import sys; from planner._io import exchange_paths; sys.exit(0 if exchange_paths(*sys.argv[1:]) else 3)'
swapped=0
"$python" -c "$swap" "$incoming" "$deployed" 2> /dev/null || swapped=$?
if [ "$swapped" -ne 0 ] && [ "$swapped" -ne 3 ]; then
  echo "note: $python cannot import planner (set PYTHON to moeplan's python); two renames" >&2
fi
rm -rf "$deployed.previous"
if [ "$swapped" -eq 0 ]; then
  trap - EXIT  # $incoming holds the previous bundle now
  how="swapped in one step"
  mv "$incoming" "$deployed.previous" ||
    fail "rolled out to $deployed, but the previous bundle stays at $incoming: $summary"
else
  how="two renames"
  mv "$deployed" "$deployed.previous"
  if ! mv "$incoming" "$deployed"; then
    mv "$deployed.previous" "$deployed"
    fail "could not move the new bundle into place; $deployed is as it was"
  fi
  trap - EXIT
fi
echo "rolled out to $deployed ($how; the previous bundle is $deployed.previous): $summary"
