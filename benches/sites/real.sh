#!/usr/bin/env bash
# What the sampled profile costs real programs under the preload: each program run
# with MEMQUOTA_PROFILE_SAMPLE=0 (the profile's hook installed, no sample taken) and
# =512k (Go's rate), libmemquota.so preloaded, MEMQUOTA_LIMIT=16g, instructions of the
# program's threads in its processes and their children counted by valgrind
# (callgrind; memquota's service thread apart). Prints each program's instructions,
# the ratio, the samples taken (calls of memquota's stack hook) and the instructions
# spent inside the hook (the stack walks). The programs: docs/benchmarks.md,
# "Allocation sites: what real programs pay".
# MQ=/path/to/libmemquota.so measures another build (built here otherwise);
# PY_FILES=N: python parses N stdlib modules (default 120).
# On demand only:  bash benches/sites/real.sh [PROGRAM ...]   (python sqlite gcc java)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${MQ:-}" ]; then
    cargo build --release -p memquota-preload -q
fi
mq=${MQ:-$PWD/target/release/libmemquota.so}
here=$PWD/benches/sites
zstd=$(ls -d "$HOME"/.cargo/registry/src/*/zstd-sys-*/zstd/lib 2>/dev/null | head -n 1)
work=$(mktemp -d)
cat > "$work/Churn.java" <<'JAVA'
import java.util.*;
public class Churn {
    public static void main(String[] a) {
        long sum = 0;
        for (int r = 0; r < Integer.parseInt(a[0]); r++) {
            Map<String, List<Integer>> m = new HashMap<>();
            for (int i = 0; i < 20000; i++) m.computeIfAbsent("k" + (i % 997), k -> new ArrayList<>()).add(i);
            for (List<Integer> l : m.values()) sum += l.size();
            sum += java.nio.ByteBuffer.allocateDirect(64 << 10).capacity();
        }
        System.out.println(sum);
    }
}
JAVA
declare -A cmd=(
    [python]="/usr/bin/python3 $here/stdlib.py ${PY_FILES:-120}"
    [sqlite]="sh -c 'exec sqlite3 :memory: < $here/sqlite.sql'"
    [gcc]="gcc -O2 -c -I$zstd -I$zstd/common $zstd/compress/zstd_compress.c -o $work/z.o"
    [java]="java -Xshare:auto -XX:TieredStopAtLevel=1 -Xmx256m -cp $work Churn 100"
)
[ $# -gt 0 ] || set -- python sqlite gcc java
programs=("$@")
[[ " ${programs[*]} " == *" java "* ]] && javac -d "$work" "$work/Churn.java"
SITES_CMDS=$(for k in "${!cmd[@]}"; do printf "%s=%s\n" "$k" "${cmd[$k]}"; done) \
python3 - "$mq" "$work" "${programs[@]}" <<'PY'
import os, re, shlex, subprocess, sys, tempfile
mq, work, programs = sys.argv[1], sys.argv[2], sys.argv[3:]
cmds = {k: v for k, v in (l.split("=", 1) for l in os.environ["SITES_CMDS"].split("\n") if l)}

def count(argv, sample):
    """Instructions of the program's threads in every process, of memquota's service
    thread (it wakes by the clock, and valgrind stretches a run fifty times: its count
    follows the run's length), the hook's calls and their inclusive cost."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONHASHSEED": "0", "LD_PRELOAD": mq, "MEMQUOTA_LIMIT": "16g",
               "MEMQUOTA_PROFILE_SAMPLE": sample}
        cg = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--separate-threads=yes",
              f"--callgrind-out-file={out}/cg.%p"]
        p = subprocess.run(cg + argv, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"failed ({p.returncode}): {argv}\n{p.stderr[-3000:]}")
        program = service = calls = inside = 0
        for f in os.listdir(out):
            names, target, total, own = {}, None, 0, False
            for line in open(f"{out}/{f}", errors="replace"):
                if line.startswith("totals:"):
                    total = int(line.split()[1])
                elif line.startswith(("fn=", "cfn=")):
                    m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
                    if m.group(2):
                        names[m.group(1)] = m.group(2).strip()
                        own = own or m.group(2).strip().endswith("threads::service_main")
                    target = names.get(m.group(1), "") if line.startswith("cfn=") else None
                elif line.startswith("calls=") and target and target.endswith("profile::hook::backtrace"):
                    calls += int(line.split()[0][6:])
                    target = "cost"
                elif target == "cost":
                    inside += int(line.split()[1])
                    target = None
            if own:
                service += total
            else:
                program += total
        return program, service, calls, inside

print(f"{'program':<8}{'off (M instr)':>15}{'512k (M instr)':>16}{'ratio':>8}{'samples':>9}{'in hook (M)':>13}"
      f"{'per sample':>12}{'service off/512k (M)':>22}", flush=True)
for name in programs:
    argv = shlex.split(cmds[name])
    off, s_off, _, _ = count(argv, "0")
    on, s_on, n, inside = count(argv, "512k")
    per = inside / n if n else 0
    print(f"{name:<8}{off / 1e6:>15.1f}{on / 1e6:>16.1f}{on / off:>8.4f}{n:>9}{inside / 1e6:>13.2f}{per:>12.0f}"
          f"{s_off / 1e6:>13.1f} / {s_on / 1e6:.1f}", flush=True)
PY
