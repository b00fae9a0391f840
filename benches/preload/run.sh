#!/usr/bin/env bash
# C malloc benchmark under glibc, LD_PRELOAD of Debian's libjemalloc.so.2, and
# LD_PRELOAD of libmemquota.so, interleaved in one run; prints medians and ratios.
# On demand only:  bash benches/preload/run.sh [ROUNDS]
# CHURN_CLOCK=cpu: time by CPU time instead of wall time (for a loaded machine).
# MQ_BASE=/path/to/libmemquota.so: a fourth variant, another build of the preload
# (for example the base commit's), in the same interleaved rounds.
# CHURN_SCALE=N: N times the operations per run (default 1). Runs of tens of
# milliseconds spread by 2x on some VMs; at 5 the medians settle.
# CHURN_WORKLOADS="small mixed": only these workloads (default: small mixed xthread).
# CHURN_THREADS="1": only these thread counts (default: 1 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-7}
source benches/baseline.sh
bin=$(mktemp -d)/churn
gcc -O2 -pthread benches/preload/churn.c -o "$bin"
echo "glibc = no preload, jemalloc = $jemalloc, memquota = $mq (MEMQUOTA_LIMIT=16g)"
echo "shared 2-core VM: absolute times are noise; read the ratios. $rounds rounds, medians."
echo "clock: ${CHURN_CLOCK:-wall}${MQ_BASE:+; base = $MQ_BASE}; operations x${CHURN_SCALE:-1}"
python3 - "$bin" "$jemalloc" "$mq" "$rounds" "${MQ_BASE:-}" "${CHURN_SCALE:-1}" \
    "${CHURN_WORKLOADS:-small mixed xthread}" "${CHURN_THREADS:-1 2}" <<'PY'
import statistics, subprocess, sys
binary, jem, mq, rounds, base = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
ops_of = {"small": 4_000_000, "mixed": 1_000_000, "xthread": 2_000_000}
workloads, threads = sys.argv[7].split(), sys.argv[8].split()
if not workloads or any(w not in ops_of for w in workloads):
    sys.exit(f"CHURN_WORKLOADS must name some of {' '.join(ops_of)}, not {sys.argv[7]!r}")
if not threads or any(not (t.isascii() and t.isdigit()) or int(t) < 1 for t in threads):
    sys.exit(f"CHURN_THREADS must be thread counts of 1 or more, not {sys.argv[8]!r}")
try:
    scale = float(sys.argv[6])
except ValueError:
    scale = 0
if not scale > 0:
    sys.exit(f"CHURN_SCALE must be a positive number, not {sys.argv[6]!r}")
variants = {"glibc": {}, "jemalloc": {"LD_PRELOAD": jem}, "memquota": {"LD_PRELOAD": mq, "MEMQUOTA_LIMIT": "16g"}}
if base:
    variants["base"] = {"LD_PRELOAD": base, "MEMQUOTA_LIMIT": "16g"}
cases = [(w, int(t), int(ops_of[w] * scale)) for w in workloads for t in threads]
extra = f"{'base':>9}{'base/jem':>9}{'fastest':>8}" if base else ""
print(f"{'workload':<9}{'thr':>4}{'glibc':>9}{'jemalloc':>10}{'memquota':>10}{'mq/jem':>8}{'glibc/jem':>10}{'mq/jem rounds':>16}"
      f"{'fastest':>8}{extra}")
worst = 0
for w, t, ops in cases:
    times = {v: [] for v in variants}
    n = len(variants)
    for r in range(rounds):
        order = list(variants)[r % n:] + list(variants)[:r % n]
        for v in order:
            out = subprocess.run(["timeout", "600", "env", *[f"{k}={x}" for k, x in variants[v].items()], binary, str(t), str(ops), w],
                                 capture_output=True, text=True, check=True)
            times[v].append(float(out.stdout))
    m = {v: statistics.median(x) for v, x in times.items()}
    ratio = m["memquota"] / m["jemalloc"]
    worst = max(worst, ratio)
    rr = [q / j for q, j in zip(times["memquota"], times["jemalloc"])]
    # The fastest run of each over jemalloc's fastest: what the machine's load added least to.
    fastest = {v: min(x) / min(times["jemalloc"]) for v, x in times.items()}
    extra = f"{m['base']:>9.2f}{m['base'] / m['jemalloc']:>9.3f}{fastest['base']:>8.3f}" if base else ""
    print(f"{w:<9}{t:>4}{m['glibc']:>9.2f}{m['jemalloc']:>10.2f}{m['memquota']:>10.2f}{ratio:>8.3f}{m['glibc'] / m['jemalloc']:>10.3f}"
          f"{min(rr):>9.3f}..{max(rr):<5.3f}{fastest['memquota']:>8.3f}{extra}")
print(f"worst memquota/jemalloc: {worst:.3f} (target <= 1.05)")
PY
