"""The memquota wheel as a user gets it: installed in a fresh venv (scripts/test.sh
makes one with the wheel, duckdb and pytest), `memquota run` from the venv's bin/
running small Python programs under a limit, which read and steer their budget with
`import memquota`. pytest itself runs outside the preload.

    target/wheel-test-venv/bin/python -m pytest bindings/python/tests -v
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MEMQUOTA = os.path.join(BIN, "memquota")
PREFIX = "result: "


def run(program, limit="128m", env=None, args=(), launcher=None):
    """Runs `program` (Python source) under `memquota run --limit LIMIT` with this
    venv's python. Returns (the JSON its line `result: {...}` printed, the process)."""
    cmd = launcher or [MEMQUOTA, "run", "--limit", limit, "--"]
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("LD_PRELOAD", None)
    # `timeout` outside the preload: a broken preload would hang a preloaded timeout.
    proc = subprocess.run(
        ["timeout", "-k", "5", "120"] + cmd + [sys.executable, "-c", textwrap.dedent(program)] + list(args),
        capture_output=True,
        text=True,
        env=full_env,
    )
    said = f"status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [l[len(PREFIX) :] for l in proc.stdout.splitlines() if l.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, said
    return json.loads(lines[-1]), proc


def test_the_wheel_installs_the_command_and_the_library_side_by_side():
    import memquota

    # The installed package, not the source tree next to this file.
    assert os.path.realpath(memquota.__file__).startswith(os.path.realpath(sys.prefix)), memquota.__file__
    lib = memquota.library_path()
    assert os.path.isfile(lib) and os.path.isabs(lib)
    assert os.path.dirname(lib) == os.path.realpath(BIN), lib
    with open(lib, "rb") as f:
        assert f.read(4) == b"\x7fELF"
    assert os.access(MEMQUOTA, os.X_OK)


def test_outside_a_preloaded_process_every_call_says_how_to_start_one():
    import memquota

    assert not memquota.loaded()
    for call in (memquota.stats, memquota.limit, memquota.report_now, lambda: memquota.set_limit(MIB)):
        with pytest.raises(memquota.MemquotaNotLoaded) as e:
            call()
        assert "memquota run --limit 2g -- python job.py" in str(e.value)
    with pytest.raises(memquota.MemquotaNotLoaded):
        memquota.on_pressure(lambda need: None)
    with pytest.raises(memquota.MemquotaNotLoaded):
        with memquota.scope("x"):
            pass


def test_stats_limit_and_set_limit_from_inside_a_run():
    got, _ = run(
        """
        import json, memquota
        before = memquota.stats()
        block = bytearray(32 << 20)
        after = memquota.stats()
        memquota.set_limit(100 << 20)
        print("result: " + json.dumps({"before": before, "after": after, "limit": memquota.limit(),
              "loaded": memquota.loaded()}))
        """,
        limit="128m",
    )
    before, after = got["before"], got["after"]
    assert got["loaded"] is True
    assert before["limit"] == before["limit_bytes"] == 128 * MIB
    for key in ("native_bytes", "native_peak_bytes", "headroom_bytes", "oom_total", "process_rss_bytes"):
        assert key in before, key
    assert after["native_bytes"] - before["native_bytes"] >= 32 * MIB
    assert after["headroom_bytes"] <= before["headroom_bytes"] - 32 * MIB
    assert got["limit"] == 100 * MIB


def test_python_m_memquota_runs_the_command():
    got, proc = run(
        'import json, memquota; print("result: " + json.dumps(memquota.limit()))',
        launcher=[sys.executable, "-m", "memquota", "run", "--limit", "96m", "--"],
    )
    assert got == 96 * MIB
    assert "memquota: `" in proc.stderr and "exited with status 0" in proc.stderr, proc.stderr


def test_a_scope_counts_its_threads_allocations_and_reports_a_leak():
    got, _ = run(
        """
        import json, memquota
        with memquota.scope("load") as load:
            kept = bytearray(16 << 20)
            inside = load.stats()
        with memquota.scope("scratch") as scratch:
            tmp = bytearray(24 << 20)
            del tmp
        print("result: " + json.dumps({"inside": inside, "load_leaked": load.leaked_bytes,
              "load_report": load.report, "scratch_leaked": scratch.leaked_bytes,
              "scratch_peak": scratch.last["peak_bytes"], "scratch_report": scratch.report}))
        """
    )
    assert got["inside"]["name"] == "load"
    assert got["inside"]["held_bytes"] >= 16 * MIB
    assert got["inside"]["threads"] == 1
    assert got["load_leaked"] >= 16 * MIB, got
    assert "leak detected" in got["load_report"], got
    assert got["scratch_peak"] >= 24 * MIB, got
    assert got["scratch_leaked"] < MIB, got


def test_report_now_shows_the_figures():
    got, _ = run('import json, memquota; print("result: " + json.dumps(memquota.report_now()))', limit="64m")
    assert "limit            64.0 MiB" in got, got
    assert "native tracked" in got, got


def test_a_pressure_callback_frees_a_cache_on_a_thread_of_its_own():
    # Soft threshold at half of 128 MiB: the 48 MiB cache plus 32 MiB more cross it,
    # memquota's background reclaim signals, the callback drops the cache.
    got, proc = run(
        """
        import json, threading, memquota
        cache = [bytearray(8 << 20) for _ in range(6)]
        done = threading.Event()
        seen = {}

        def drop(need):
            seen["need"] = need
            seen["thread"] = threading.current_thread().name
            seen["on_main"] = threading.current_thread() is threading.main_thread()
            cache.clear()
            done.set()

        memquota.on_pressure(drop)
        before = memquota.stats()["native_bytes"]
        more = bytearray(32 << 20)
        ran = done.wait(30)
        after = memquota.stats()
        print("result: " + json.dumps(dict(seen, ran=ran, cache=len(cache), before=before,
              after=after["native_bytes"], reclaims=after["reclaims_total_background"]
              + after["reclaims_total_sync"])))
        """,
        limit="128m",
        env={"MEMQUOTA_SOFT_RATIO": "0.5"},
    )
    assert got["ran"] is True, proc.stderr
    assert got["thread"] == "memquota-pressure" and got["on_main"] is False, got
    assert got["need"] > 0 and got["cache"] == 0, got
    assert got["reclaims"] >= 1, got
    # The 48 MiB cache is gone; the 32 MiB bytearray stays.
    assert got["after"] <= got["before"] + 32 * MIB - 40 * MIB, got


DUCKDB_ROWS = "12000000"  # 4 M groups: 400 MiB peak with no limit, 1.4 s here
DUCKDB_LIMIT = "192m"


def test_duckdb_governed_through_its_memory_limit_spills_and_stays_in_the_budget():
    pytest.importorskip("duckdb")
    script = os.path.join(HERE, "duckdb_query.py")
    base, _ = run(
        """
        import json, resource, duckdb, memquota
        con = duckdb.connect(); con.execute("SET threads = 2"); con.execute("SELECT 1").fetchone()
        print("result: " + json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        """,
        limit=DUCKDB_LIMIT,
    )

    def query(mode):
        proc = subprocess.run(
            ["timeout", "-k", "5", "300", MEMQUOTA, "run", "--limit", DUCKDB_LIMIT, "--", sys.executable,
             script, "group", DUCKDB_ROWS, mode],
            capture_output=True, text=True,
        )
        line = [l for l in proc.stdout.splitlines() if l.startswith("duckdb-query:")]
        fields = dict(kv.split("=", 1) for kv in line[-1].split()[1:]) if line else {}
        return proc, fields

    proc, governed = query("govern")
    assert proc.returncode == 0 and governed.get("ok") == "1", proc.stdout + proc.stderr
    limit = 192 * MIB
    peak = int(governed["maxrss"])
    print(f"\ngoverned: {governed}, interpreter with duckdb {base / MIB:.1f} MiB", file=sys.stderr)
    assert peak <= 1.15 * limit + base, (peak, base)
    assert int(governed["spilled_peak"]) > 0, governed  # it had to spill
    assert int(governed["limit_set_lowest"]) < limit, governed

    # Measured, not asserted: the same query with no knob under the same budget.
    proc, plain = query("plain")
    print(f"without the governor: status {proc.returncode}, {plain}", file=sys.stderr)


def test_a_forked_child_gets_its_own_pressure_thread():
    # The child's reclaims must reach the child's callbacks, not the parent's thread
    # reading the pipe they share after the fork.
    got, proc = run(
        """
        import json, os, threading, memquota
        cache = []
        done = threading.Event()
        where = {}

        def drop(need):
            where.setdefault("pid", os.getpid())
            cache.clear()
            done.set()

        memquota.on_pressure(drop)
        pid = os.fork()
        if pid == 0:
            cache.extend(bytearray(8 << 20) for _ in range(6))
            more = bytearray(32 << 20)
            os._exit(0 if done.wait(30) and where.get("pid") == os.getpid() else 1)
        _, status = os.waitpid(pid, 0)
        print("result: " + json.dumps({"child_status": os.waitstatus_to_exitcode(status),
              "parent_called": done.is_set()}))
        """,
        limit="128m",
        env={"MEMQUOTA_SOFT_RATIO": "0.5"},
    )
    assert got["child_status"] == 0, proc.stderr


def test_over_the_limit_the_refusal_comes_at_once_and_the_callback_frees_for_the_retry():
    # The allocating thread holds the interpreter lock while its 80 MiB bytearray is
    # over the limit: the synchronous reclaim only signals and the bytearray is
    # refused (MemoryError) without waiting for Python; the callback then drops the
    # cache on its own thread, and the same request succeeds.
    got, proc = run(
        """
        import json, threading, memquota
        cache = [bytearray(8 << 20) for _ in range(8)]
        done = threading.Event()

        def drop(need):
            cache.clear()
            done.set()

        memquota.on_pressure(drop)
        try:
            big = bytearray(80 << 20)
            first = "granted"
        except MemoryError:
            first = "MemoryError"
        ran = done.wait(30)
        big = bytearray(80 << 20)
        s = memquota.stats()
        print("result: " + json.dumps({"first": first, "ran": ran, "second": len(big),
              "oom_total": s["oom_total"], "sync": s["reclaims_total_sync"]}))
        """,
        limit="128m",
    )
    assert got["first"] == "MemoryError", got
    assert got["ran"] is True and got["second"] == 80 << 20, got
    assert got["oom_total"] >= 1 and got["sync"] >= 1, got
