#!/usr/bin/env bash
# Installs what the tests need, then runs them all. The README's second command, and
# what CI runs. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }

say "toolchain and the programs the tests compile or run"
command -v cargo >/dev/null || { echo "cargo is missing: install Rust (https://rustup.rs)" >&2; exit 1; }
cargo --version
need=()
# gdb: a test's watchdog prints every thread's stack with it when a check hangs.
# go: `go tool pprof` reads the heap profiles back (tests/support/pprof.rs).
for tool in gcc:gcc g++:g++ gdb:gdb nm:binutils timeout:coreutils sort:coreutils java:default-jdk-headless javac:default-jdk-headless python3:python3 go:golang-go; do
    command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
# The preload's jemalloc API tests compile a program with -ljemalloc (Debian's jemalloc).
[ -e /usr/include/jemalloc/jemalloc.h ] || need+=(libjemalloc-dev)
# The preload's C++ tests build a library on LLVM's libc++ too (with g++), for a process
# with two private C++ runtimes.
[ -e /usr/include/c++/v1/new ] && [ -e /usr/lib/x86_64-linux-gnu/libc++abi.so ] || need+=(libc++-dev libc++abi-dev)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing: ${need[*]}"
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}"
fi

say "pyspark in target/spark-venv for the Spark test (cached; ~30 s the first time)"
scripts/spark-venv.sh

say "duckdb and polars in target/engines-venv for the private-allocator test (cached; ~10 s the first time)"
scripts/engines-venv.sh

say "build (the preload tests run target/release/libmemquota.so)"
cargo build --release

say "unit, integration and property tests (release: the drift test does 1.2M operations)"
timeout 1500 cargo test --release --workspace

say "the arbitration fuzzer: random plans of tasks at the limit for ${MEMQUOTA_FUZZ_SECS:-60} s (MEMQUOTA_FUZZ_SECS)"
# `test = false` in Cargo.toml keeps it out of the workspace run above: it runs once,
# here, under a timeout of its own. A failing seed prints the command that re-runs it.
timeout 300 cargo test --release --test fuzz_arbitration

say "the README's main job: the demo runs to its end"
timeout 120 cargo run --release --example demo >/dev/null

say "Python: the wheel (scripts/wheel.sh) installed in a fresh venv with duckdb and pytest, its tests"
# maturin reuses the release build above: only the command is linked again, stripped.
wheel=$(scripts/wheel.sh | tail -n 1)
base=$(python3 -c 'import sys; print(sys.executable)')   # python3 may be a pyenv shim
rm -rf target/wheel-test-venv
"$base" -m venv target/wheel-test-venv
target/wheel-test-venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -q \
    "$wheel" duckdb==2.0.0 pytest==9.2.0
# From another directory: the installed package, never the source tree, is imported.
(cd target && timeout 600 wheel-test-venv/bin/python -m pytest -v -s ../bindings/python/tests)

say "library mode: a Rust JNI library with its own budget in a JVM (bindings/java/jvm_lib/, its own package and target dir)"
# Its second run loads the library under the preload built above.
preload_so="$(realpath -m "${CARGO_TARGET_DIR:-target}")/release/libmemquota.so"
(cd bindings/java/jvm_lib && CARGO_TARGET_DIR=../../../target/jvm_lib MEMQUOTA_PRELOAD_SO="$preload_so" timeout 900 cargo test --release)

say "DataFusion: memquota-datafusion (integrations/datafusion/, its own package and target dir; DataFusion takes 8-20 minutes to build on 2 cores, once)"
# Unit tests, the queries under 64/128/256 MiB, a query too big to spill, two at once,
# and collect_query: a join planned again by sort-merge, a query no plan fits; queries at
# once (tests/concurrent.rs): a light one completes while a heavy one spills or gives way.
(cd integrations/datafusion && CARGO_TARGET_DIR=../../target/datafusion timeout 2400 cargo test --release)
# An operator that allocates without reserving: its unreserved bytes by site in the
# query's ResourcesExhausted (needs memquota's profile: the package's `profile` feature).
(cd integrations/datafusion && CARGO_TARGET_DIR=../../target/datafusion timeout 1200 \
    cargo test --release --features profile --test unreserved)
# The README's DataFusion command runs to its end; a bad limit is a clear error, not a run.
(cd integrations/datafusion && CARGO_TARGET_DIR=../../target/datafusion timeout 300 \
    cargo run --release --example query -- --limit 128m >/dev/null)
out=$(cd integrations/datafusion && CARGO_TARGET_DIR=../../target/datafusion timeout 60 \
    cargo run -q --release --example query -- --limit abc 2>&1) && { echo "query --limit abc ran: $out" >&2; exit 1; }
grep -q 'bad --limit "abc": expected a size' <<<"$out" || { echo "query --limit abc: $out" >&2; exit 1; }

say "loom models of the reclaim coordinator and the account (separate target dir: --cfg loom)"
CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" timeout 900 cargo test --release -p memquota --lib loom

say "all tests passed"
