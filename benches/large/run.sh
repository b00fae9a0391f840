#!/usr/bin/env bash
# The large-block loop (large.c: 1-8 MiB blocks allocated, every page written, freed)
# under glibc, LD_PRELOAD of Debian's libjemalloc.so.2, LD_PRELOAD of libmemquota.so
# (its default purging: src/policy/purge.rs), and libmemquota.so with jemalloc's own decay
# given back by the user (MALLOC_CONF=dirty_decay_ms:10000, what the preload did
# before). Interleaved in one run; prints medians and the ratios to glibc.
# On demand only:  bash benches/large/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
source benches/baseline.sh
bin=$(mktemp -d)/large
gcc -O2 -pthread benches/large/large.c -o "$bin"
echo "glibc = no preload, jemalloc = $jemalloc, memquota = $mq (MEMQUOTA_LIMIT=16g)"
echo "shared 2-core VM: absolute times are noise; read the ratios. $rounds rounds, medians."
python3 - "$bin" "$jemalloc" "$mq" "$rounds" <<'PY'
import statistics, subprocess, sys
binary, jem, mq, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
variants = {
    "glibc": {},
    "jemalloc": {"LD_PRELOAD": jem},
    "memquota": {"LD_PRELOAD": mq, "MEMQUOTA_LIMIT": "16g"},
    "mq+jemdecay": {"LD_PRELOAD": mq, "MEMQUOTA_LIMIT": "16g", "MALLOC_CONF": "dirty_decay_ms:10000"},
}
print(f"{'thr':>3}{'variant':>13}{'us/op':>9}{'faults':>10}{'peak MiB':>10}{'freed MiB':>10}{'/glibc':>8}{'/jemalloc':>10}")
worst = 0
for t, ops in ((1, 3000), (2, 1500)):
    runs = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants)[r % 4:] + list(variants)[:r % 4]
        for v in order:
            out = subprocess.run(["timeout", "300", "env", *[f"{k}={x}" for k, x in variants[v].items()], binary, str(t), str(ops)],
                                 capture_output=True, text=True, check=True)
            runs[v].append([float(x) for x in out.stdout.split()])
    med = {v: [statistics.median(x[i] for x in rs) for i in range(4)] for v, rs in runs.items()}
    for v, (ns, faults, peak, freed) in med.items():
        print(f"{t:>3}{v:>13}{ns / 1000:>9.1f}{faults:>10.0f}{peak / 1024:>10.1f}{freed / 1024:>10.1f}"
              f"{ns / med['glibc'][0]:>8.3f}{ns / med['jemalloc'][0]:>10.3f}")
    worst = max(worst, med["memquota"][0] / med["glibc"][0])
print(f"worst memquota/glibc: {worst:.3f} (target <= 1.1)")
PY
