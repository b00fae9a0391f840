"""memquota for Python: one memory budget for the whole process.

Run a program under the budget (the wheel's ``memquota`` command preloads
libmemquota.so, which replaces malloc)::

    memquota run --limit 2g -- python job.py
    python -m memquota run --limit 2g -- python job.py

Inside it, ``import memquota`` reads and steers the budget through the C ABI of the
library already loaded (never a second copy: one process, one budget)::

    memquota.stats()["native_bytes"], memquota.limit()
    with memquota.scope("load"):
        ...
    memquota.on_pressure(lambda need: cache.clear())
    memquota.govern_duckdb(con)

Outside such a process every call but ``library_path()`` raises MemquotaNotLoaded,
which says how to start one.
"""

import ctypes
import itertools
import os
import sys
import threading
import traceback

from . import _native
from ._native import MemquotaNotLoaded, loaded
from ._paths import library_path

__all__ = [
    "MemquotaNotLoaded",
    "Scope",
    "govern_duckdb",
    "library_path",
    "limit",
    "loaded",
    "on_pressure",
    "remove_pressure",
    "report_now",
    "scope",
    "set_limit",
    "stats",
]

__version__ = "0.1.0"


def stats():
    """The budget's figures now: a dict with the keys of the stats JSON
    (``memquota_stats_json``: ``limit_bytes``, ``native_bytes``, ``headroom_bytes``,
    ``process_rss_bytes``, ``oom_total``, ...), plus ``"limit"``, the limit in bytes
    (``limit_bytes`` under its short name). The calling thread's pending count is
    flushed first."""
    s = _native.json_of(_native.lib().memquota_stats_json)
    s["limit"] = s["limit_bytes"]
    return s


def limit():
    """The limit in bytes."""
    return stats()["limit_bytes"]


def set_limit(nbytes):
    """Sets the limit to ``nbytes`` (an int, > 0)."""
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"set_limit({nbytes}): the limit must be a positive number of bytes")
    if _native.lib().memquota_set_limit(nbytes) != 0:
        raise ValueError(f"set_limit({nbytes}) refused")


def report_now():
    """The figures an out-of-memory report shows, as they are now (limit, native and
    heap, reclaims, scopes, jemalloc's view), as text. Nothing is counted as a refusal."""
    return _native.text(_native.lib().memquota_report_now)


# ---- scopes ------------------------------------------------------------------------

_scope_ids = itertools.count(1)
_attached = threading.local()


class Scope:
    """A task scope (docs/scopes.md) over ``memquota_scope_begin``/``_end`` and
    ``_attach``/``_detach``: while the ``with`` block runs, the allocations of the
    thread that entered it are charged to the scope (and the process). On leaving,
    the thread goes back to the scope it was in before, if any, and the scope ends:
    ``leaked_bytes`` and ``report`` then say what it still held."""

    def __init__(self, name, priority=0):
        self.name = str(name)
        self.id = next(_scope_ids)
        self.priority = int(priority)
        self.handle = 0
        self.leaked_bytes = None
        self.report = None
        self.last = None

    def __enter__(self):
        lib = _native.lib()
        self.handle = lib.memquota_scope_begin(self.name.encode(), self.id, self.priority)
        if self.handle == 0:
            raise RuntimeError(f"memquota scope {self.name!r}: too many scopes alive")
        if lib.memquota_scope_attach(self.handle) != 0:
            lib.memquota_scope_end(self.handle, None, 0)
            self.handle = 0
            raise RuntimeError(f"memquota scope {self.name!r}: cannot attach")
        stack = getattr(_attached, "stack", None)
        if stack is None:
            stack = _attached.stack = []
        stack.append(self.handle)
        return self

    def stats(self):
        """This scope's figures now (``held_bytes``, ``peak_bytes``,
        ``allocated_bytes``, ``reserved_bytes``, ``threads``, ...), or, after it
        ended, the last ones read."""
        if self.handle:
            every = _native.json_of(_native.lib().memquota_scopes_json)
            for s in every["scopes"]:
                if s["id"] == self.id and s["name"] == self.name:
                    self.last = s
                    return s
        return self.last

    def __exit__(self, *exc):
        lib = _native.lib()
        stack = _attached.stack
        stack.pop()
        if stack:
            lib.memquota_scope_attach(stack[-1])
        else:
            lib.memquota_scope_detach()
        self.stats()
        report = ctypes.create_string_buffer(4096)
        self.leaked_bytes = lib.memquota_scope_end(self.handle, report, len(report))
        self.report = report.value.decode("utf-8", "replace")
        self.handle = 0
        return False


def scope(name, priority=0):
    """A task scope named ``name`` as a context manager (see Scope)."""
    return Scope(name, priority)


# ---- pressure ----------------------------------------------------------------------

_pressure_lock = threading.Lock()
_pressure_callbacks = []
_pressure_thread = None


def _serve_pressure(read_fd):
    while True:
        data = os.read(read_fd, 8 * 512)
        if not data:
            return
        need = sum(int.from_bytes(data[i : i + 8], sys.byteorder) for i in range(0, len(data) - 7, 8))
        with _pressure_lock:
            callbacks = list(_pressure_callbacks)
        for callback in callbacks:
            try:
                callback(need)
            except Exception:
                traceback.print_exc()


def on_pressure(callback):
    """Calls ``callback(need)`` when the budget asks for ``need`` bytes back (a
    reclaim: past the soft threshold, or an allocation over the limit).

    The callback runs on a Python thread of its own, ``memquota-pressure``, never on
    the allocating thread: memquota's reclaim only writes to a pipe this thread reads
    (``memquota_notify_fd``), so it never waits for the interpreter lock that the
    allocating thread may hold. What the callback frees helps the allocations after
    it, not the one that asked. Returns ``callback`` (usable as a decorator). Takes
    memquota's one reclaim slot for this process."""
    lib = _native.lib()
    with _pressure_lock:
        _pressure_callbacks.append(callback)
        if _pressure_thread is None:
            _start_pressure_thread(lib)
    return callback


def _start_pressure_thread(lib):
    global _pressure_thread
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    t = threading.Thread(target=_serve_pressure, args=(read_fd,), name="memquota-pressure", daemon=True)
    t.start()
    lib.memquota_on_reclaim(lib.notify_fd_address, write_fd)
    _pressure_thread = t


def _after_fork_in_child():
    # The thread did not survive the fork, and the pipe is shared with the parent,
    # whose thread would get the child's pressure: a pipe and a thread of its own.
    global _pressure_lock, _pressure_thread
    _pressure_lock = threading.Lock()
    _pressure_thread = None
    if _pressure_callbacks and _native.loaded():
        _start_pressure_thread(_native.lib())


os.register_at_fork(after_in_child=_after_fork_in_child)


def remove_pressure(callback):
    """Stops calling ``callback`` on pressure."""
    with _pressure_lock:
        if callback in _pressure_callbacks:
            _pressure_callbacks.remove(callback)


def govern_duckdb(connection, **options):
    """Keeps ``connection``'s DuckDB ``memory_limit`` at what the budget leaves it
    (see memquota.duckdb_governor.Governor); returns the running Governor."""
    from .duckdb_governor import Governor

    return Governor(connection, **options).start()


def _point_pyarrow_at_malloc():
    """pyarrow allocates from its own jemalloc or mimalloc pool by default, which
    memquota does not see: in a preloaded process its pool is the system one (malloc,
    memquota's), through pyarrow's own variable, or set directly if it is imported."""
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    pa = sys.modules.get("pyarrow")
    if pa is not None and os.environ["ARROW_DEFAULT_MEMORY_POOL"] == "system":
        try:
            pa.set_memory_pool(pa.system_memory_pool())
        except Exception:
            pass


if loaded():
    _point_pyarrow_at_malloc()
