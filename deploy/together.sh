#!/usr/bin/env bash
# together.sh WHAT -- SCRIPT...
#
# Runs build scripts side by side (deploy/k8s-tools/*.sh, each building
# with quiet.sh, or finding its cached result) and shows one line for all of
# them: what runs, for how long, and each step as it ends:
#   building the demo's tools … 3m10s  [k8s-tools, coredns done 1m48s, helm done 1m04s]
# One Go build leaves part of two cores idle (linking, long packages);
# side by side the smaller builds fill it. Each step's whole output is in
# its log under .cache/logs/, as quiet.sh writes it; a step that fails
# prints its log and the others are stopped. V=1 runs them one after
# the other with everything shown. Exit status: the first failure's.
set -uo pipefail
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
  echo "usage: $0 WHAT -- SCRIPT..." >&2
  exit 2
fi
what=$1
shift 2
if [ "${V:-0}" = 1 ]; then
  for s in "$@"; do "$s" >/dev/null || exit; done
  exit 0
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
logs=${PROXYAUDIT_LOGS:-${PROXYAUDIT_CACHE:-$repo/.cache}/logs}
case $logs in "$PWD"/*) logs=${logs#"$PWD"/} ;; esac
dir=$(mktemp -d)
pids=()
i=0
for s in "$@"; do
  QUIET_STATUS="$dir/$i" "$s" >/dev/null 2>"$dir/$i.err" </dev/null &
  pids[i]=$!
  names[i]=$(basename "$s" .sh)
  i=$((i + 1))
done
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$dir"' EXIT
trap 'exit 130' INT TERM
start=$SECONDS
clock() {
  local s=$((SECONDS - start))
  if [ $s -ge 60 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60)); else printf '%ds' $s; fi
}
# state: each step's name and how it ended (cached: nothing to build).
state() {
  local out="" j st
  for j in "${!pids[@]}"; do
    st=""
    [ -s "$dir/$j" ] && st=$(tail -n1 "$dir/$j")
    case $st in
      done*) st=" $st" ;;
      failed*) st=" FAILED" ;;
      *) st=""; if ! kill -0 "${pids[j]}" 2>/dev/null && [ ! -s "$dir/$j" ]; then st=" cached"; fi ;;
    esac
    out="$out${out:+, }$(head -n1 "$dir/$j" 2>/dev/null || echo "${names[j]}")$st"
  done
  printf '%s' "$out"
}
running() {
  local p
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}
if [ -t 2 ]; then
  while running; do
    printf '\r  %s … %s  [%s]\033[K' "$what" "$(clock)" "$(state)" >&2
    sleep 1
  done
  printf '\r\033[K  %s … ' "$what" >&2
else
  printf '  %s … ' "$what" >&2
fi
rc=0
for j in "${!pids[@]}"; do
  wait "${pids[j]}"
  r=$?
  if [ $r -ne 0 ] && [ $rc -eq 0 ]; then
    rc=$r
    kill "${pids[@]}" 2>/dev/null
    printf 'FAILED after %s: %s\n' "$(clock)" "${names[j]}" >&2
    cat "$dir/$j.err" >&2
  fi
done
if [ $rc -eq 0 ]; then
  printf 'done in %s  [%s; logs: %s/]\n' "$(clock)" "$(state)" "$logs" >&2
fi
exit $rc
