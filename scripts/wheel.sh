#!/usr/bin/env bash
# Builds the memquota wheel, target/wheels/memquota-<version>-<tags>.whl: the memquota
# command and libmemquota.so (installed side by side in the scripts directory, bin/ of
# a venv) and the `memquota` Python package (bindings/python/). Installs with
# `pip install` on a machine with no Rust toolchain. Prints the wheel's path on stdout
# (the last line). Safe to re-run.
#
# maturin (from the registry, in target/wheel-venv) builds the command with cargo in
# this workspace's target directory, so the release build that scripts/test.sh makes
# is reused: cli/ asks for the core's features the workspace build unifies to, and
# the same .cargo/config.toml applies (maturin runs inside the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '%s\n' "wheel: $*" >&2; }

command -v strip >/dev/null || { say "strip is missing: install binutils"; exit 1; }
py=$(scripts/venv.sh wheel-venv maturin==1.16.0 auditwheel==6.8.2 | tail -n 1)
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")

say "cargo build --release (libmemquota.so and the command)"
cargo build --release >&2

# The library goes in without its debug information (17 MB of 18): the symbols stay.
data=bindings/python/memquota.data/scripts
rm -rf bindings/python/memquota.data
mkdir -p "$data"
strip --strip-debug -o "$data/libmemquota.so" "$target/release/libmemquota.so"

rm -f "$target"/wheels/memquota-*.whl
say "maturin build"
(cd bindings/python && CARGO_TARGET_DIR="$target" "$py" -m maturin build --release --strip \
    --out "$target/wheels" >&2)
wheel=$(ls "$target"/wheels/memquota-*.whl)
say "built $wheel ($(du -h "$wheel" | cut -f1))"
echo "$wheel"
