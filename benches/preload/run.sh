#!/usr/bin/env bash
# C malloc benchmark under glibc, LD_PRELOAD of Debian's libjemalloc.so.2, and
# LD_PRELOAD of libmemquota.so, interleaved in one run; prints medians and ratios.
# On demand only:  bash benches/preload/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-7}
source benches/baseline.sh
bin=$(mktemp -d)/churn
gcc -O2 -pthread benches/preload/churn.c -o "$bin"
echo "glibc = no preload, jemalloc = $jemalloc, memquota = $mq (MEMQUOTA_LIMIT=16g)"
echo "shared 2-core VM: absolute times are noise; read the ratios. $rounds rounds, medians."
python3 - "$bin" "$jemalloc" "$mq" "$rounds" <<'PY'
import statistics, subprocess, sys
binary, jem, mq, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
variants = {"glibc": {}, "jemalloc": {"LD_PRELOAD": jem}, "memquota": {"LD_PRELOAD": mq, "MEMQUOTA_LIMIT": "16g"}}
cases = [(w, t, ops) for w, ops in (("small", 4_000_000), ("mixed", 1_000_000), ("xthread", 2_000_000)) for t in (1, 2)]
print(f"{'workload':<9}{'thr':>4}{'glibc':>9}{'jemalloc':>10}{'memquota':>10}{'mq/jem':>8}{'glibc/jem':>10}")
worst = 0
for w, t, ops in cases:
    times = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants)[r % 3:] + list(variants)[:r % 3]
        for v in order:
            out = subprocess.run(["timeout", "120", "env", *[f"{k}={x}" for k, x in variants[v].items()], binary, str(t), str(ops), w],
                                 capture_output=True, text=True, check=True)
            times[v].append(float(out.stdout))
    m = {v: statistics.median(x) for v, x in times.items()}
    ratio = m["memquota"] / m["jemalloc"]
    worst = max(worst, ratio)
    print(f"{w:<9}{t:>4}{m['glibc']:>9.2f}{m['jemalloc']:>10.2f}{m['memquota']:>10.2f}{ratio:>8.3f}{m['glibc'] / m['jemalloc']:>10.3f}")
print(f"worst memquota/jemalloc: {worst:.3f} (target <= 1.05)")
PY
