#!/usr/bin/env bash
# Instructions per operation of the small-object workloads, counted by valgrind
# (callgrind, in the thread that runs the workload): the Rust face (benches/alloc.rs, Q =
# QuotaAlloc<Jemalloc> against J = bare jemalloc, inlined and through
# `#[inline(never)]` shims) and the preload (benches/preload/churn.c, libmemquota.so
# against Debian's libjemalloc.so.2, MEMQUOTA_LIMIT=16g). Each figure is the
# instructions of the one thread that runs the workload, divided by its operations:
# start-up, the main thread and background threads are left out.
#
# A proxy for time, not time: an instruction that waits on memory counts as much as
# one that does not, and the extra instructions of an allocator wrapper run beside
# jemalloc's. But the counts repeat to within about 1% from run to run, where wall
# time on a shared VM spreads by tens of percent (docs/benchmarks.md), so they show
# a change in the fast path that a timed run cannot.
# On demand only:  bash benches/instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/baseline.sh
if ! command -v valgrind > /dev/null; then
    echo "installing valgrind (instruction counts)"
    install_packages valgrind
fi
churn=$(mktemp -d)/churn
gcc -O2 -pthread benches/preload/churn.c -o "$churn"
bench=$(cargo bench -p memquota --bench alloc --no-run 2>&1 | sed -n 's/.*Executable benches\/alloc.rs (\(.*\))/\1/p')
[ -x "$bench" ] || { echo "benches/instructions.sh: could not find the alloc bench's executable" >&2; exit 1; }
echo "valgrind --tool=callgrind, the workload's thread; instructions per op (one allocation + one free)"
python3 - "$bench" "$churn" "$jemalloc" "$mq" <<'PY'
import os, re, subprocess, sys, tempfile
bench, churn, jem, mq = sys.argv[1:]

def instructions(argv, env):
    """Instructions of the busiest thread of the last (traced) process: the workload's.
    Background threads (jemalloc's, memquota's) wake by the clock, and valgrind makes
    a run last fifty times as long, so they are left out."""
    with tempfile.TemporaryDirectory() as out:
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--trace-children=yes",
               f"--callgrind-out-file={out}/cg.%p"] + argv
        p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        threads = [int(m.group(1)) for f in os.listdir(out)
                   for m in [re.search(r"^(?:summary|totals): (\d+)", open(f"{out}/{f}").read(), re.M)] if m]
        if p.returncode != 0 or not threads:
            sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}{p.stderr[-2000:]}")
        return max(threads), p.stdout

def rust(allocator, workload, shim):
    env = {"MEMQUOTA_BENCH_ONLY": allocator, "MEMQUOTA_BENCH_DIVIDE": "20",
           "MEMQUOTA_BENCH_THREADS": "1", "MEMQUOTA_BENCH_SHIM": "1" if shim else "0"}
    n, out = instructions([bench, "--bench", workload], env)
    return n / int(re.search(r"(\d+) ops", out).group(1))

def preload(lib, workload, ops=1_000_000):
    n, _ = instructions(["env", f"LD_PRELOAD={lib}", "MEMQUOTA_LIMIT=16g", churn, "1", str(ops), workload], {})
    return n / ops

print(f"{'face':<15}{'workload':<13}{'jemalloc':>10}{'memquota':>10}{'extra':>8}{'ratio':>8}", flush=True)
rows = []
def row(face, w, j, q):
    rows.append((face, w, q / j))
    print(f"{face:<15}{w:<13}{j:>10.1f}{q:>10.1f}{q - j:>8.1f}{q / j:>8.3f}", flush=True)
for shim in (False, True):
    for w in ("small-churn", "mixed-sizes", "prod-cons"):
        row(f"rust, {'shims' if shim else 'inlined'}", w, rust("J", w, shim), rust("Q", w, shim))
for w in ("small", "mixed"):
    row("preload", w, preload(jem, w), preload(mq, w))
face, w, ratio = max(rows, key=lambda r: r[2])
print(f"worst: {ratio:.3f} ({face}, {w}); the target (<= 1.05x) is wall time: these are instructions")
PY
