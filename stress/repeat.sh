#!/usr/bin/env bash
# Run short chaos scenarios (the tests of tests/stress/test_chaos.py) N times each and print the
# pass counts: flake hunting for CI (issue 9 item 7).
#
#   stress/repeat.sh SCENARIO[,SCENARIO...]|every N [--load] [--snapshot] [--keep-dir DIR]
#
# SCENARIO is a scenario name (steady kill pause term redis-restart client-kill client-pause
# net-delay partition poison slow failover all cluster cluster-failover), or "every" for all
# of them (one scenario at a time, in
# turn). --load runs a CPU-heavy process alongside (stress-ng --cpu 1 when installed, else a
# Python busy loop), stopped when this script ends. --snapshot runs the committed tree (git
# archive HEAD, exported under DIR) instead of the working tree, which others may be editing.
# The ledgers of failed runs are kept under DIR (default /tmp/chaos-repeat-<date>), one folder
# per run: pytest's tmp_path with the ledgers, the report JSON and pytest's output. Exit
# status: 0 when every run passed.
set -u
cd "$(dirname "$0")/.."

declare -A TEST=(
  [steady]=test_steady
  [kill]=test_kill_consumers
  [pause]=test_pause_past_liveness_ttl
  [term]=test_sigterm_hands_over_without_waiting_for_the_ttl
  [redis-restart]=test_redis_restart_with_aof
  [client-kill]=test_client_kill
  [client-pause]=test_client_pause
  [net-delay]=test_net_delay
  [partition]=test_partition
  [poison]=test_poison_events_are_dead_lettered_while_others_go_on
  [slow]=test_slow_handler_with_backpressure
  [failover]=test_failover_of_the_sentinel_primary
  [all]=test_all_faults_mixed
  [cluster]=test_cluster_faults_mixed
  [cluster-failover]=test_cluster_failover_of_primaries_incl_the_hashtags
)
ORDER=(steady kill pause term redis-restart client-kill client-pause net-delay partition poison
       slow failover all cluster cluster-failover)

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
scenario=$1 n=$2
shift 2
load=0 snapshot=0 keep="/tmp/chaos-repeat-$(date +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
  case $1 in
    --load) load=1 ;;
    --snapshot) snapshot=1 ;;
    --keep-dir) keep=$2; shift ;;
    *) usage ;;
  esac
  shift
done
if [ "$scenario" = every ]; then
  scenarios=("${ORDER[@]}")
else
  IFS=, read -r -a scenarios <<<"$scenario"
  for s in "${scenarios[@]}"; do
    [ -n "${TEST[$s]:-}" ] || usage
  done
fi
[[ $n =~ ^[0-9]+$ ]] || usage

PY=${PYTHON:-$PWD/.venv/bin/python}
plugins=()
mkdir -p "$keep"
keep=$(cd "$keep" && pwd)
if [ $snapshot = 1 ]; then
  rev=$(git rev-parse --short HEAD)
  mkdir -p "$keep/src"
  git archive HEAD | tar -x -C "$keep/src"
  cd "$keep/src"
  export PYTHONPATH=$PWD
  # plugins registered by the shared venv may name modules the snapshot does not have yet
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  plugins=(-p anyio.pytest_plugin)
  echo "snapshot: $rev in $PWD"
fi
hog=
cleanup() { [ -n "$hog" ] && kill "$hog" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ $load = 1 ]; then
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu 1 --quiet &
  else
    "$PY" -c 'while True: pass' &
  fi
  hog=$!
  echo "load: pid $hog ($(ps -o args= -p $hog))"
fi

declare -A PASS FAIL SECS
status=0
for ((i = 1; i <= n; i++)); do
  for s in "${scenarios[@]}"; do
    dir="$keep/$s-$i"
    t=$SECONDS
    if "$PY" -m pytest -q -p no:cacheprovider "${plugins[@]}" --basetemp "$dir" \
        "tests/stress/test_chaos.py::${TEST[$s]}" >"$dir.out" 2>&1; then
      PASS[$s]=$((${PASS[$s]:-0} + 1))
      rm -rf "$dir" "$dir.out"
      verdict=pass
    else
      FAIL[$s]=$((${FAIL[$s]:-0} + 1))
      status=1
      verdict="FAIL (kept $dir, $dir.out)"
    fi
    SECS[$s]=$((${SECS[$s]:-0} + SECONDS - t))
    echo "$s run $i/$n: $verdict in $((SECONDS - t)) s" >&2
  done
done

echo "scenario        passed  failed  mean s$([ $load = 1 ] && echo '  (with a CPU hog)')"
for s in "${scenarios[@]}"; do
  p=${PASS[$s]:-0} f=${FAIL[$s]:-0}
  printf '%-15s %6d  %6d  %6d\n' "$s" "$p" "$f" $((SECS[$s] / n))
done
exit $status
