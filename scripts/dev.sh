#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11: installs what is missing
# (redis-server from Debian's packages, uv, the locked Python dependencies in .venv), then runs.
#
#   ./scripts/dev.sh flights [ARGS]   the main job: `python -m examples.flights` on embedded defaults
#   ./scripts/dev.sh test [ARGS]      the whole test suite (pytest ARGS)
#   ./scripts/dev.sh bench [ARGS]     the throughput/latency benchmark (stress/bench.py)
#   ./scripts/dev.sh stress [ARGS]    the chaos harness (stress/chaos.py)
#   ./scripts/dev.sh setup            only install
set -euo pipefail
cd "$(dirname "$0")/.."

# uv trusts the system's certificate store (as pip and curl do), not only its built-in roots:
# networks that inspect TLS add their CA there.
export UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}"

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

ensure_venv() {
  ensure_uv
  local py; py=$(python_bin)
  # --frozen: install exactly what uv.lock pins; a stale lock is an error, not a silent update.
  "$UV" sync --frozen --all-extras --group dev --python "$py" --quiet
}

setup() { ensure_redis; ensure_java; ensure_venv; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  flights) setup; exec .venv/bin/python -m examples.flights "$@" ;;
  test) setup; exec .venv/bin/pytest "$@" ;;
  bench) setup; exec .venv/bin/python stress/bench.py "$@" ;;
  stress) setup; exec .venv/bin/python stress/chaos.py "$@" ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
