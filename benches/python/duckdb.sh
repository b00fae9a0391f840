#!/usr/bin/env bash
# DuckDB governed by memquota (memquota.govern_duckdb) against DuckDB's own static
# memory_limit at the same figure, no limit at all, and no knob under the same budget:
# a GROUP BY (48 M rows, 16 M groups) and a join (30 M rows each side), each 1.3 GiB
# at peak with no limit (bindings/python/tests/duckdb_query.py). Interleaved rounds;
# prints the median time and the highest peak RSS of each. On demand only:
#     bash benches/python/duckdb.sh [ROUNDS] [LIMIT]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
limit=${2:-512m}
wheel=$(scripts/wheel.sh | tail -n 1)
venv=target/wheel-bench-venv
base=$(python3 -c 'import sys; print(sys.executable)')
rm -rf "$venv"
"$base" -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "$wheel" duckdb==2.0.0
echo "limit $limit; $rounds rounds; shared 2-core VM: times are noisy"
"$venv/bin/python" - "$venv" "$limit" "$rounds" <<'PY'
import statistics, subprocess, sys
venv, limit, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
units = {"m": 1 << 20, "g": 1 << 30}
limit_bytes = int(limit[:-1]) * units[limit[-1].lower()]
py, mq = f"{venv}/bin/python", f"{venv}/bin/memquota"
script = "bindings/python/tests/duckdb_query.py"
variants = {
    "no limit": lambda q: [py, script, *q, "plain"],
    f"duckdb memory_limit={limit}": lambda q: [py, script, *q, f"static={limit_bytes // 1024}KiB"],
    f"memquota run --limit {limit}, no knob": lambda q: [mq, "run", "--limit", limit, "--", py, script, *q, "plain"],
    f"memquota run --limit {limit} + govern_duckdb": lambda q: [mq, "run", "--limit", limit, "--", py, script, *q, "govern"],
}
base = subprocess.run([py, "-c", "import resource, duckdb; duckdb.connect().execute('SELECT 1').fetchone(); "
                       "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"], capture_output=True, text=True, check=True)
print(f"interpreter with duckdb imported: {int(base.stdout) / 1024:.1f} MiB")
for q in (["group", "48000000"], ["join", "30000000"]):
    runs = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants)[r % 4:] + list(variants)[:r % 4]
        for v in order:
            out = subprocess.run(["timeout", "600", *variants[v](q)], capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("duckdb-query:")]
            f = dict(kv.split("=", 1) for kv in line[-1].split()[1:]) if line else {}
            runs[v].append((out.returncode, f))
    print(f"\n{q[0]} {q[1]}")
    print(f"{'variant':<48}{'ok':>6}{'s (median)':>12}{'peak MiB':>10}{'x limit':>9}{'spilled MiB':>13}")
    for v, rs in runs.items():
        ok = sum(1 for rc, f in rs if rc == 0 and f.get("ok") == "1")
        secs = [float(f["seconds"]) for rc, f in rs if f.get("ok") == "1"]
        peak = max((int(f["maxrss"]) for rc, f in rs if "maxrss" in f), default=0)
        spilled = max((int(f.get("spilled_peak", 0)) for rc, f in rs), default=0)
        med = f"{statistics.median(secs):.1f}" if secs else "-"
        sp = f"{spilled / 2**20:.0f}" if "govern" in v else ""
        print(f"{v:<48}{ok:>3}/{len(rs):<2}{med:>12}{peak / 2**20:>10.0f}{peak / limit_bytes:>9.2f}{sp:>13}")
PY
