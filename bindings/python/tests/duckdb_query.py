"""A DuckDB GROUP BY or join that peaks at 1.3 GiB plain (48 M rows, 16 M groups; a
30 M-row join), checked against its closed-form result. Used by test_wheel.py and by
the benchmark of docs/benchmarks.md ("DuckDB governed by memquota").

    duckdb_query.py (group|join) ROWS (govern|static=SIZE|plain)

govern: memquota.govern_duckdb on the connection (run it under `memquota run`);
static=SIZE: DuckDB's own memory_limit set once to SIZE; plain: DuckDB's defaults.
Prints one line:

    duckdb-query: ok=1 seconds=S maxrss=BYTES limit_set_lowest=B updates=N spilled_peak=B
"""

import resource
import sys
import time

import duckdb


def expected(what, n):
    if what == "group":
        groups = n // 3
        return (groups, n, n * (n - 1) // 2)
    # join: b.k = (i * 7919) % n is a permutation of 0..n-1 when gcd(7919, n) = 1,
    # so every a row matches one b row: sum of 2k over k plus sum of i over i.
    return (n, 3 * (n * (n - 1) // 2))


def run(con, what, n):
    if what == "group":
        sql = f"""SELECT count(*), sum(c), sum(s) FROM (
                    SELECT i % {n // 3} AS k, count(*) AS c, sum(i) AS s FROM range({n}) r(i) GROUP BY k)"""
    else:
        sql = f"""SELECT count(*), sum(a.v + b.w) FROM
                    (SELECT i AS k, i * 2 AS v FROM range({n}) r(i)) a JOIN
                    (SELECT (i * 7919) % {n} AS k, i AS w FROM range({n}) r(i)) b ON a.k = b.k"""
    return tuple(int(x) for x in con.execute(sql).fetchone())


def main():
    what, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    con = duckdb.connect()
    con.execute("SET threads = 2")
    governor = None
    if mode == "govern":
        import memquota

        governor = memquota.govern_duckdb(con)
    elif mode.startswith("static="):
        con.execute(f"SET memory_limit = '{mode.split('=', 1)[1]}'")
    started = time.monotonic()
    got = run(con, what, n)
    seconds = time.monotonic() - started
    ok = got == expected(what, n)
    extra = ""
    if governor is not None:
        governor.stop()
        extra = (
            f" limit_set_lowest={governor.lowest} updates={governor.updates}"
            f" pressure_events={governor.pressure_events} failures={governor.failures}"
            f" spilled_peak={governor.spilled_peak}"
        )
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"duckdb-query: ok={int(ok)} seconds={seconds:.2f} maxrss={maxrss}{extra}", flush=True)
    if not ok:
        print(f"duckdb-query: got {got}, expected {expected(what, n)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
