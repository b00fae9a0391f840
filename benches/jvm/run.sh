#!/usr/bin/env bash
# JVM benchmark: a fixed amount of heap churn and direct buffers (JvmWorkload work),
# 8 threads, -Xmx512m, under a plain JVM (glibc malloc), Debian's libjemalloc.so.2
# preloaded, libmemquota.so preloaded alone, and libmemquota.so as preload + agent
# with a 1 GiB budget. Interleaved in one run; prints median wall time, JVM
# collections and memquota's GCs, CPU time (user + system: steadier than wall time on
# a loaded machine), peak RSS and minor faults, and the ratios to the plain JVM.
# MQ_BASE=/path/to/libmemquota.so adds the agent variant of another build (a base to
# compare a change with, in the same run).
# On demand only:  bash benches/jvm/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
source benches/baseline.sh
if [ ! -x /usr/bin/time ]; then
    echo "installing time (GNU time: peak RSS and page faults of each run)"
    install_packages time
fi
classes=$(mktemp -d)
javac -d "$classes" bindings/java/org/memquota/*.java ld_preload/tests/java/JvmWorkload.java
echo "shared 2-core VM: absolute times are noise; read the ratios. $rounds rounds, medians."
base=
if [ -n "${MQ_BASE:-}" ]; then
    # Under its own name: MemQuota.java finds the agent's library by that name in
    # /proc/self/maps (another name would load a second copy for the Java side).
    base=$(mktemp -d)/libmemquota.so
    cp "$MQ_BASE" "$base"
    echo "base = $MQ_BASE"
fi
python3 - "$classes" "$jemalloc" "$mq" "$rounds" "$base" <<'PY'
import re, statistics, subprocess, sys
classes, jem, mq, rounds, base = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
java = ["java", "-Xmx512m", "-cp", classes]
work = ["JvmWorkload", "work", "300", "8"]
variants = {
    "plain JVM": ([], []),
    "jemalloc": ([f"LD_PRELOAD={jem}"], []),
    "mq preload": ([f"LD_PRELOAD={mq}"], []),
    "mq agent 1g": ([f"LD_PRELOAD={mq}"], [f"-agentpath:{mq}=limit=1g"]),
}
if base:
    variants["base agent 1g"] = ([f"LD_PRELOAD={base}"], [f"-agentpath:{base}=limit=1g"])
names = list(variants)
runs = {v: [] for v in variants}
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for v in order:
        env, agent = variants[v]
        # /usr/bin/time's line goes to stderr: peak RSS (KiB) and minor faults.
        done = subprocess.run(["timeout", "300", "/usr/bin/time", "-f", "rss %M faults %R cpu %U %S", "env", *env,
                               *java[:2], *agent, *java[2:], *work], capture_output=True, text=True, check=True)
        ms, coll, gcs, ooms = map(int, re.search(r"work ms (\d+) jvm collections (\d+) memquota gcs (\d+) ooms (\d+)", done.stdout).groups())
        rss, faults, user, system = re.search(r"rss (\d+) faults (\d+) cpu ([\d.]+) ([\d.]+)", done.stderr).groups()
        rss, faults, cpu = int(rss), int(faults), float(user) + float(system)
        assert ooms == 0, done.stdout
        runs[v].append((ms, coll, gcs, rss / 1024, faults / 1e6, cpu))
    print(f"round {r + 1}/{rounds} done", file=sys.stderr)
med = {v: [statistics.median(x[i] for x in rs) for i in range(6)] for v, rs in runs.items()}
first = med["plain JVM"]
print(f"{'variant':<14}{'wall ms':>8}{'ratio':>7}{'CPU s':>7}{'ratio':>7}{'JVM GCs':>9}{'ratio':>7}{'mq GCs':>8}"
      f"{'peak RSS MiB':>14}{'faults M':>10}")
for v, (ms, coll, gcs, rss, faults, cpu) in med.items():
    print(f"{v:<14}{ms:>8.0f}{ms / first[0]:>7.2f}{cpu:>7.2f}{cpu / first[5]:>7.2f}{coll:>9.0f}{coll / first[1]:>7.2f}"
          f"{gcs:>8.0f}{rss:>14.0f}{faults:>10.2f}")
PY
