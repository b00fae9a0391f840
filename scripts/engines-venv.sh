#!/usr/bin/env bash
# Creates target/engines-venv with DuckDB and Polars for the test of engines with a
# private allocator (ld_preload/tests/python_engines.rs), once (scripts/venv.sh; two
# wheels of 20 and 54 MB, 11 s here). Prints the venv's python on stdout. Safe to re-run.
set -euo pipefail
# Both wheels bundle their own jemalloc: the memory the test is about.
exec "$(dirname "$0")/venv.sh" engines-venv duckdb==2.0.0 polars==2.1.0
