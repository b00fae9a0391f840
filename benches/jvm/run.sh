#!/usr/bin/env bash
# JVM benchmark: a fixed amount of heap churn and direct buffers (JvmWorkload work),
# 8 threads, -Xmx512m, under a plain JVM (glibc malloc), Debian's libjemalloc.so.2
# preloaded, libmemquota.so preloaded alone, and libmemquota.so as preload + agent
# with a 1 GiB budget. Interleaved in one run; prints median wall time, JVM
# collections and memquota's GCs, and the ratios to the plain JVM.
# On demand only:  bash benches/jvm/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
source benches/baseline.sh
classes=$(mktemp -d)
javac -d "$classes" java/org/memquota/*.java ld_preload/tests/java/JvmWorkload.java
echo "shared 2-core VM: absolute times are noise; read the ratios. $rounds rounds, medians."
python3 - "$classes" "$jemalloc" "$mq" "$rounds" <<'PY'
import re, statistics, subprocess, sys
classes, jem, mq, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
java = ["java", "-Xmx512m", "-cp", classes]
work = ["JvmWorkload", "work", "300", "8"]
variants = {
    "plain JVM": ([], []),
    "jemalloc": ([f"LD_PRELOAD={jem}"], []),
    "mq preload": ([f"LD_PRELOAD={mq}"], []),
    "mq agent 1g": ([f"LD_PRELOAD={mq}"], [f"-agentpath:{mq}=limit=1g"]),
}
runs = {v: [] for v in variants}
for r in range(rounds):
    order = list(variants)[r % 4:] + list(variants)[:r % 4]
    for v in order:
        env, agent = variants[v]
        out = subprocess.run(["timeout", "300", "env", *env, *java[:2], *agent, *java[2:], *work],
                             capture_output=True, text=True, check=True).stdout
        ms, coll, gcs, ooms = map(int, re.search(r"work ms (\d+) jvm collections (\d+) memquota gcs (\d+) ooms (\d+)", out).groups())
        assert ooms == 0, out
        runs[v].append((ms, coll, gcs))
    print(f"round {r + 1}/{rounds} done", file=sys.stderr)
med = {v: [statistics.median(x[i] for x in rs) for i in range(3)] for v, rs in runs.items()}
base = med["plain JVM"]
print(f"{'variant':<13}{'wall ms':>9}{'ratio':>7}{'JVM GCs':>9}{'ratio':>7}{'mq GCs':>8}")
for v, (ms, coll, gcs) in med.items():
    print(f"{v:<13}{ms:>9.0f}{ms / base[0]:>7.2f}{coll:>9.0f}{coll / base[1]:>7.2f}{gcs:>8.0f}")
PY
