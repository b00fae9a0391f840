"""A query on an engine that allocates through its own private jemalloc, run by
ld_preload/tests/python_engines.rs under LD_PRELOAD=libmemquota.so.

    query.py (duckdb|polars) ROWS        the query; prints its figures
    query.py react ROWS                  MEMQUOTA_UNTRACKED=count: a DuckDB table makes
                                         memquota reclaim and refuse what it does see

The query, the same in both engines: ROWS generated rows (i, k = i % 1000003,
h = i as 24 digits), grouped by k (count, sum of i, the h joined with commas), the
groups ordered by that sum, descending, and numbered. It prints

    memquota-engines: result groups=G rows=R rank_weighted=W joined_bytes=B

with W the sum of rank * k over the groups, which only the right order gives.

Run with the venv of scripts/engines-venv.sh:

    LD_PRELOAD=target/release/libmemquota.so MEMQUOTA_REPORT=exit \
        target/engines-venv/bin/python ld_preload/tests/python_engines/query.py duckdb 10000000
"""

import ctypes
import json
import sys
import time

PREFIX = "memquota-engines:"
M = 1000003


def say(*words):
    print(PREFIX, *words, flush=True)


def duckdb_query(n):
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads=2")
    return con.execute(
        f"""
        SELECT count(*), sum(c), sum(rn * k)::HUGEINT, sum(length(hs)) FROM (
          SELECT k, c, hs, row_number() OVER (ORDER BY s DESC) AS rn FROM (
            SELECT k, count(*) AS c, sum(i) AS s, string_agg(h, ',') AS hs FROM (
              SELECT i, i % {M} AS k, lpad(i::VARCHAR, 24, '0') AS h FROM range({n}) r(i)
            ) GROUP BY k))"""
    ).fetchone()


def polars_query(n):
    import polars as pl

    rows = (
        pl.DataFrame({"i": pl.int_range(0, n, eager=True)})
        .lazy()
        .with_columns(k=pl.col("i") % M, h=pl.col("i").cast(pl.String).str.pad_start(24, "0"))
    )
    groups = rows.group_by("k").agg(c=pl.len(), s=pl.col("i").sum(), hs=pl.col("h").str.join(","))
    ranked = groups.sort("s", descending=True).with_row_index("rn", offset=1)
    return ranked.select(
        pl.len(),
        pl.col("c").sum(),
        (pl.col("rn").cast(pl.Int128) * pl.col("k")).sum(),
        pl.col("hs").str.len_bytes().sum(),
    ).collect().row(0)


def stats(lib):
    """The budget's figures through the C ABI (memquota_stats_json)."""
    buf = ctypes.create_string_buffer(1 << 16)
    n = lib.memquota_stats_json(buf, len(buf))
    assert n < len(buf), n
    return json.loads(buf.value)


def react(n):
    """Under MEMQUOTA_UNTRACKED=count: a Python cache memquota sees (64 MiB of
    bytearrays, dropped by a reclaim callback registered through the C ABI), then a
    DuckDB table memquota does not see. Its samples of the table push the budget
    past the soft threshold: the callback runs. Then a 256 MiB bytearray, which the
    table leaves no room for, is refused: MemoryError."""
    import duckdb

    lib = ctypes.CDLL(None)  # the preload's symbols
    lib.memquota_stats_json.restype = ctypes.c_size_t
    lib.memquota_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    cache = [bytearray(8 << 20) for _ in range(8)]
    asked = []

    @ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.c_void_p)
    def reclaim(need, _ctx):
        asked.append(need)
        cache.clear()

    lib.memquota_on_reclaim(reclaim, None)
    con = duckdb.connect()
    con.execute("SET threads=2")
    con.execute(f"CREATE TABLE t AS SELECT i, i % {M} AS k, lpad(i::VARCHAR, 24, '0') AS h FROM range({n}) r(i)")
    # The sampler reads every 50 ms; its reclaim runs on memquota's own thread.
    deadline = time.monotonic() + 5
    while cache and time.monotonic() < deadline:
        time.sleep(0.05)
    s = stats(lib)
    say(f"reclaimed cache={'dropped' if not cache else 'kept'} asked={asked}")
    say(f"table rows={con.execute('SELECT count(*) FROM t').fetchone()[0]}")
    say(f"stats untracked={s['untracked_bytes']} native={s['native_bytes']} limit={s['limit_bytes']}")
    try:
        big = bytearray(256 << 20)
        say(f"bytearray granted={len(big)}")
    except MemoryError:
        say("bytearray refused=MemoryError")
    lib.memquota_on_reclaim(None, None)


def main():
    what, n = sys.argv[1], int(sys.argv[2])
    if what == "react":
        react(n)
        return
    started = time.monotonic()
    groups, rows, weighted, joined = {"duckdb": duckdb_query, "polars": polars_query}[what](n)
    say(f"result groups={groups} rows={rows} rank_weighted={weighted} joined_bytes={joined}")
    say(f"took seconds={time.monotonic() - started:.2f}")


if __name__ == "__main__":
    main()
