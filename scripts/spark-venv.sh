#!/usr/bin/env bash
# Creates target/spark-venv with pyspark for the Spark test (ld_preload/tests/spark.rs),
# once (scripts/venv.sh; a 456 MB download, 31 s here). Prints the venv's python on
# stdout. Safe to re-run.
set -euo pipefail
# 4.x needs Java 17 or newer, which is what Debian 12 ships (default-jre-headless).
exec "$(dirname "$0")/venv.sh" spark-venv "pyspark==${PYSPARK_VERSION:-4.3.0}"
