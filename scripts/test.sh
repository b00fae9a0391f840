#!/usr/bin/env bash
# Installs what the tests need, then runs them all. The README's second command, and
# what CI runs. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }

say "toolchain"
command -v cargo >/dev/null || { echo "cargo is missing: install Rust (https://rustup.rs)" >&2; exit 1; }
cargo --version

say "unit, integration and property tests (release: the drift test does 1.2M operations)"
timeout 1500 cargo test --release --workspace

say "loom models of the reclaim coordinator and the account (separate target dir: --cfg loom)"
CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" timeout 900 cargo test --release --lib loom

say "all tests passed"
