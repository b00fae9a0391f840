#!/usr/bin/env bash
# Creates target/spark-venv with pyspark for the Spark test (ld_preload/tests/spark.rs),
# once: a venv that already imports the pinned pyspark is reused. Prints progress on
# stderr and the venv's python on stdout (the last line). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# 4.x needs Java 17 or newer, which is what Debian 12 ships (default-jre-headless).
PYSPARK_VERSION=${PYSPARK_VERSION:-4.3.0}
venv=$PWD/target/spark-venv
py=$venv/bin/python

say() { printf '%s\n' "spark-venv: $*" >&2; }

if [ -x "$py" ] && "$py" -c "import pyspark, sys; sys.exit(pyspark.__version__ != '$PYSPARK_VERSION')" 2>/dev/null; then
    say "pyspark $PYSPARK_VERSION already in $venv"
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
say "pip install pyspark==$PYSPARK_VERSION (a 456 MB download; 31 s here)"
"$py" -m pip install --disable-pip-version-check --progress-bar off "pyspark==$PYSPARK_VERSION" >&2
"$py" -c 'import pyspark; print("spark-venv: pyspark", pyspark.__version__, "from", pyspark.__file__)' >&2
say "done in $(($(date +%s) - start)) s"
echo "$py"
