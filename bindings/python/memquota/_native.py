"""The C ABI of the libmemquota.so this process already runs under (ctypes).

Never a second copy: a library loaded again would keep a second, independent budget.
The functions are looked up in the process's global namespace (``dlopen(NULL)``),
where ``LD_PRELOAD`` puts them.
"""

import ctypes
import json
import os

from ._paths import library_path


class MemquotaNotLoaded(RuntimeError):
    """This process does not run under libmemquota.so."""


MemquotaNotLoaded.__module__ = "memquota"


HOW_TO_START = (
    "this Python process does not run under memquota's budget (libmemquota.so is not "
    "preloaded). Start it under one: `memquota run --limit 2g -- python job.py`, "
    "`python -m memquota run --limit 2g -- python job.py`, or "
    "`LD_PRELOAD=<memquota.library_path()> MEMQUOTA_LIMIT=2g python job.py`"
)

_lib = None


def _declare(lib):
    c = ctypes
    sigs = {
        "memquota_stats_json": (c.c_size_t, [c.c_char_p, c.c_size_t]),
        "memquota_scopes_json": (c.c_size_t, [c.c_char_p, c.c_size_t]),
        "memquota_report_now": (c.c_size_t, [c.c_char_p, c.c_size_t]),
        "memquota_set_limit": (c.c_int, [c.c_uint64]),
        "memquota_flush": (None, []),
        "memquota_on_reclaim": (None, [c.c_void_p, c.c_void_p]),
        "memquota_scope_begin": (c.c_uint64, [c.c_char_p, c.c_uint64, c.c_int32]),
        "memquota_scope_end": (c.c_int64, [c.c_uint64, c.c_char_p, c.c_size_t]),
        "memquota_scope_attach": (c.c_int, [c.c_uint64]),
        "memquota_scope_detach": (c.c_int, []),
    }
    for name, (restype, argtypes) in sigs.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    # Its address, handed to memquota_on_reclaim: called there, never through ctypes.
    lib.notify_fd_address = ctypes.cast(lib.memquota_notify_fd, ctypes.c_void_p).value


def lib():
    """The preloaded library's functions, or MemquotaNotLoaded."""
    global _lib
    if _lib is None:
        found = ctypes.CDLL(None)
        if not hasattr(found, "memquota_stats_json"):
            raise MemquotaNotLoaded(HOW_TO_START)
        if not hasattr(found, "memquota_notify_fd"):
            raise MemquotaNotLoaded(
                "the libmemquota.so this process runs under is older than this memquota "
                f"package (it lacks memquota_notify_fd): preload the package's own, {library_path()}"
            )
        _declare(found)
        _lib = found
    return _lib


def text(fn):
    """Calls an snprintf-like function of the ABI until its text fits."""
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(buf, size)
        if n < size:
            return buf.value.decode("utf-8", "replace")
        size = n + 1


def json_of(fn):
    return json.loads(text(fn))


def loaded():
    """Whether this process runs under libmemquota.so."""
    try:
        lib()
        return True
    except MemquotaNotLoaded:
        return False


def loaded_path():
    """The path of the libmemquota.so mapped into this process, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path) == "libmemquota.so":
                    return path
    except OSError:
        pass
    return None
