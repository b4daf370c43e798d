#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11+: installs what is missing
# (redis-server from Debian's packages, uv, the locked Python dependencies in .venv), then runs.
#
#   ./scripts/dev.sh flights [ARGS]   the main job: `python -m examples.flights` on embedded defaults
#   ./scripts/dev.sh test [ARGS]      the whole test suite (pytest ARGS), over 4 pytest-xdist workers
#   ./scripts/dev.sh bench [ARGS]     the throughput/latency benchmark (stress/bench.py)
#   ./scripts/dev.sh stress [ARGS]    the chaos harness (stress/chaos.py)
#   ./scripts/dev.sh setup            only install
#   --python 3.13 (after the command) runs on that Python, in .venv-3.13: an interpreter found
#   in pyenv's versions, by `uv python find`, or on PATH; none is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."

# uv trusts the system's certificate store (as pip and curl do), not only its built-in roots:
# networks that inspect TLS add their CA there.
export UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}"
# Interpreters are the machine's own: uv never downloads one.
export UV_PYTHON_DOWNLOADS=never

say() { printf '\033[1m[dev]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[dev] %s\033[0m\n' "$*" >&2; exit 1; }

as_root() {  # run a command as root, or say what to run
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"
  else die "need root to run: $* (run it yourself, then rerun this script)"
  fi
}

apt_install() {
  command -v apt-get >/dev/null || die "cannot install $* here (no apt-get): install it by hand"
  say "installing $* from Debian's packages"
  if [ -z "${_APT_UPDATED:-}" ]; then as_root apt-get update -qq; _APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

python_bin() {
  for py in python3.11 python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "$py"; return
    fi
  done
  die "Python 3.11 or newer is needed (Debian: apt-get install python3)"
}

ensure_redis() {
  if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null; then
    apt_install redis-server
  fi
  command -v redis-server >/dev/null || [ -n "${REDIS_URL:-}" ] \
    || die "redis-server is missing: apt-get install redis-server, or set REDIS_URL"
}

# Spark (eventbus.spark, the flights job's last step, its tests) runs on a JVM: Debian's headless
# JRE when no `java` is on PATH.
ensure_java() {
  command -v java >/dev/null && return
  apt_install default-jre-headless \
    || die "java is missing and could not be installed: apt-get install default-jre-headless"
  command -v java >/dev/null || die "java is still missing after installing default-jre-headless"
}

UV=""
ensure_uv() {
  if command -v uv >/dev/null; then UV=uv; return; fi
  local tools=.cache/uv-bootstrap
  if [ ! -x "$tools/bin/uv" ]; then
    local py; py=$(python_bin)
    say "bootstrapping uv into $tools"
    if ! "$py" -m venv "$tools" >/dev/null 2>&1; then
      rm -rf "$tools"
      apt_install python3-venv
      "$py" -m venv "$tools"
    fi
    "$tools/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5,<1"
  fi
  UV="$tools/bin/uv"
}

# The interpreter of `--python VERSION` (3.13 or 3.13.0): pyenv's versions, then `uv python
# find`, then pythonX.Y on PATH; the newest patch release first.
python_of() {
  local want=$1 py found=""
  [[ $want =~ ^3\.[0-9]+(\.[0-9]+)?$ ]] || die "--python takes a version such as 3.13, not '$want'"
  local minor; minor=$(cut -d. -f1,2 <<<"$want")
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  if command -v pyenv >/dev/null; then pyenv_root=$(pyenv root); fi
  for py in $(ls -d "$pyenv_root"/versions/"$want"* 2>/dev/null | sort -rV); do
    if [ -x "$py/bin/python$minor" ]; then found="$py/bin/python$minor"; break; fi
  done
  if [ -z "$found" ] && [ -n "$UV" ]; then
    found=$("$UV" python find --no-python-downloads --system "$want" 2>/dev/null) || found=""
  fi
  if [ -z "$found" ] && command -v "python$minor" >/dev/null; then found=$(command -v "python$minor"); fi
  if [ -z "$found" ] || ! "$found" -c "import sys; assert sys.version.startswith('$want')" 2>/dev/null; then
    die "Python $want not found (looked in $pyenv_root/versions, \`uv python find\`, PATH): install it (e.g. \`pyenv install $want\` or \`apt-get install python$minor python$minor-venv\`); this script does not download interpreters"
  fi
  "$found" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python $want is older than 3.11"
  echo "$found"
}

VENV=.venv
PYTHON=""  # set by --python
ensure_venv() {
  ensure_uv
  local py
  if [ -n "$PYTHON" ]; then py=$(python_of "$PYTHON"); else py=$(python_bin); fi
  # --frozen: install exactly what uv.lock pins; a stale lock is an error, not a silent update.
  # --compile-bytecode: the installed packages' .pyc files written once here, since Python
  # compiles every imported module from source in each process otherwise where
  # PYTHONDONTWRITEBYTECODE is set (it is on the CI machines): the suite's child processes,
  # pytest-xdist workers and Spark's Python workers each paid for it (docs/performance.md).
  UV_PROJECT_ENVIRONMENT="$VENV" "$UV" sync --frozen --all-extras --group dev --python "$py" \
    --no-python-downloads --compile-bytecode --quiet
  # and this checkout's own modules (a .pyc older than its source is not used: no stale code)
  "$VENV/bin/python" -m compileall -q -j 0 eventbus examples >/dev/null
}

setup() { ensure_redis; ensure_java; ensure_venv; }

# The suite mostly waits (Redis round trips, child processes, Spark), so it runs over more
# pytest-xdist workers than the machine has cores: each worker starts its own redis-server(s) on
# free ports, and tests/spark's tests share one worker's SparkSession (--dist loadgroup).
# EVENTBUS_TEST_WORKERS=0 runs in one process; an -n or -p no:xdist among ARGS wins.
run_tests() {
  local workers=${EVENTBUS_TEST_WORKERS:-4} arg
  for arg in "$@"; do
    case "$arg" in -n | -n[0-9a]* | --numprocesses | --numprocesses=* | no:xdist) workers=0 ;; esac
  done
  [[ $workers =~ ^[0-9]+$ ]] || die "EVENTBUS_TEST_WORKERS takes a number of workers, not '$workers'"
  if [ "$workers" != 0 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
  exec "$VENV/bin/pytest" "$@"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
args=()  # the command's own arguments, without --python VERSION
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || die "--python needs a version, e.g. --python 3.13"; PYTHON=$2; shift 2 ;;
    --python=*) PYTHON=${1#--python=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
if [ -n "$PYTHON" ]; then VENV=.venv-$(cut -d. -f1,2 <<<"$PYTHON"); fi
case "$cmd" in
  setup) setup ;;
  flights) setup; exec "$VENV/bin/python" -m examples.flights "$@" ;;
  test) setup; run_tests "$@" ;;
  bench) setup; exec "$VENV/bin/python" stress/bench.py "$@" ;;
  stress) setup; exec "$VENV/bin/python" stress/chaos.py "$@" ;;
  *) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
