#!/usr/bin/env bash
# Usage: scripts/venv.sh NAME PACKAGE==VERSION...
# Creates target/NAME, a Python venv with the pinned packages from the registry, once:
# a venv that already has every pinned version is reused. Prints progress on stderr
# and the venv's python on stdout (the last line). Safe to re-run. The tests that run
# Python under the preload use it through scripts/spark-venv.sh and
# scripts/engines-venv.sh, which hold the pins.
set -euo pipefail
cd "$(dirname "$0")/.."

name=$1
shift
venv=$PWD/target/$name
py=$venv/bin/python

say() { printf '%s\n' "$name: $*" >&2; }

# Every NAME==VERSION installed as pinned.
pinned() {
    "$py" - "$@" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))
PY
}

if [ -x "$py" ] && pinned "$@"; then
    say "$* already in $venv"
    echo "$py"
    exit 0
fi

# `python3` may be a pyenv shim: build the venv from the interpreter it runs.
base=$(python3 -c 'import sys; print(sys.executable)')
start=$(date +%s)
say "creating $venv with $base"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
if ! "$base" -m venv "$venv" >&2; then
    # Debian's python3 has no ensurepip without python3-venv.
    say "installing python3-venv"
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3-venv >&2
    rm -rf "$venv"
    "$base" -m venv "$venv"
fi
say "pip install $*"
if ! "$py" -m pip install --disable-pip-version-check --progress-bar off "$@" >&2; then
    say "FAILED: pip could not install $* from the registry (see pip's message above)"
    exit 1
fi
pinned "$@" || { say "FAILED: installed, but not at the pinned versions $*"; exit 1; }
say "done in $(($(date +%s) - start)) s"
echo "$py"
