"""DuckDB governed through its own knob, ``memory_limit``.

DuckDB allocates through a private jemalloc that libmemquota.so does not see, so
memquota cannot refuse or count its memory; DuckDB's buffer manager, though, evicts
and spills to disk to stay under ``memory_limit``. The governor keeps that setting at
what the budget leaves DuckDB: what DuckDB holds now (``duckdb_memory()``) plus the
process's headroom (the limit less the process's resident memory, which holds
DuckDB's, Python's and everything else's), a fraction ``margin`` of it, never under
``floor``. It re-reads every ``interval`` and at once on memquota's pressure, when it
also takes what the reclaim asked for off the target: DuckDB is then told to evict
before the process is refused or killed.
"""

import os
import threading
import time

from . import _native, on_pressure, remove_pressure

MIB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Governor:
    """Keeps a DuckDB connection's ``memory_limit`` at what the budget leaves it.

    ``connection`` is a ``duckdb.DuckDBPyConnection``; the governor works through a
    cursor of its own (a second connection to the same database), so the program
    keeps using its connection on its own thread. ``memory_limit`` is a setting of the
    database: every connection to it is governed.
    """

    def __init__(self, connection, interval=0.05, margin=0.85, floor=32 * MIB):
        self.interval = float(interval)
        self.margin = float(margin)
        self.floor = int(floor)
        self._con = connection.cursor()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._need = 0
        self._thread = None
        self.limit_bytes = None
        self.spilled_peak = 0
        self.lowest = None
        self.updates = 0
        self.pressure_events = 0
        self.failures = 0
        self.last_error = None

    def duckdb_bytes(self):
        """What DuckDB's buffer manager holds now, in bytes (its own figure). Notes
        the most it had spilled to disk so far in ``spilled_peak``."""
        held, spilled = self._con.execute(
            "SELECT coalesce(sum(memory_usage_bytes), 0), coalesce(sum(temporary_storage_bytes), 0) "
            "FROM duckdb_memory()"
        ).fetchone()
        self.spilled_peak = max(self.spilled_peak, int(spilled))
        return int(held)

    def target(self, need=0):
        """The ``memory_limit`` the budget leaves DuckDB now."""
        lim = _native.json_of(_native.lib().memquota_stats_json)["limit_bytes"]
        headroom = int(self.margin * lim) - _rss() - need
        return max(self.floor, self.duckdb_bytes() + headroom)

    def _set(self, nbytes):
        try:
            self._con.execute(f"SET memory_limit = '{nbytes // 1024}KiB'")
        except Exception as e:  # DuckDB could not evict down to it: try again next round
            self.failures += 1
            self.last_error = str(e)
            return
        self.limit_bytes = nbytes
        self.updates += 1
        if self.lowest is None or nbytes < self.lowest:
            self.lowest = nbytes

    def update(self, need=0):
        """Sets ``memory_limit`` to the target, if it moved by more than 1/32."""
        t = self.target(need)
        if self.limit_bytes is None or abs(t - self.limit_bytes) > self.limit_bytes // 32:
            self._set(t)

    def _pressure(self, need):
        self.pressure_events += 1
        self._need += need
        self._wake.set()

    def _run(self):
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            need, self._need = self._need, 0
            try:
                self.update(need)
            except Exception as e:  # the database closed under us
                self.last_error = str(e)
                return

    def start(self):
        """Sets the limit once now, then keeps it from a thread of its own."""
        self.update()
        on_pressure(self._pressure)
        self._thread = threading.Thread(target=self._run, name="memquota-duckdb", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """Stops governing (``memory_limit`` stays where it was last set)."""
        remove_pressure(self._pressure)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._con.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
