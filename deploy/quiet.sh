#!/usr/bin/env bash
# quiet.sh NAME WHAT -- COMMAND...
#
# Runs a long step (a build, a download) with its whole output in a log file
# and one line on stderr saying what runs, for how long, and where the log is:
#   building kube-apiserver … (~12 min cold) 1m05s  [log: .cache/logs/k8s.log]
# On a terminal the line's clock ticks; elsewhere (CI, a log) the line starts
# when the step does and ends with its time. A step that fails prints its whole log. V=1 shows everything as
# it comes, as if this script were not there. Logs go to $PROXYAUDIT_LOGS
# (default: <repo>/.cache/logs). Exit status: the command's.
set -uo pipefail
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 NAME WHAT -- COMMAND..." >&2
  exit 2
fi
name=$1 what=$2
shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
logs=${PROXYAUDIT_LOGS:-${PROXYAUDIT_CACHE:-$repo/.cache}/logs}
mkdir -p "$logs"
log="$logs/$name.log"
shown=$log
case $log in "$PWD"/*) shown=${log#"$PWD"/} ;; esac

if [ "${V:-0}" = 1 ]; then
  echo "$what" >&2
  "$@" 2>&1 | tee "$log" >&2
  exit "${PIPESTATUS[0]}"
fi

clock() {
  local s=$((SECONDS - start))
  if [ $s -ge 60 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60)); else printf '%ds' $s; fi
}
start=$SECONDS
"$@" >"$log" 2>&1 </dev/null &
pid=$!
trap 'kill $pid 2>/dev/null' INT TERM
if [ -t 2 ]; then
  while kill -0 $pid 2>/dev/null; do
    printf '\r  %s … %s  [log: %s]\033[K' "$what" "$(clock)" "$shown" >&2
    sleep 1
  done
  printf '\r\033[K  %s … ' "$what" >&2
else
  printf '  %s … ' "$what" >&2
fi
rc=0
wait $pid || rc=$?
if [ $rc -eq 0 ]; then
  printf 'done in %s  [log: %s]\n' "$(clock)" "$shown" >&2
  exit 0
fi
printf 'FAILED after %s (exit status %d); its whole output (%s):\n' "$(clock)" $rc "$shown" >&2
sed 's/^/    /' "$log" >&2
exit $rc
