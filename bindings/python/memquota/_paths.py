"""Where the wheel put libmemquota.so and the memquota command.

Both are installed side by side in the scripts directory (``bin/`` of a venv,
``~/.local/bin`` for ``--user``): the command finds the library next to itself. They are
found here through the installed files' record, whatever the install scheme.
"""

import os
from importlib import metadata


def _installed(name):
    try:
        files = metadata.files("memquota") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == name and f.parts[0] != "memquota":
            path = os.path.realpath(str(f.locate()))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"{name} is not installed with this memquota package: install the wheel "
        "(`bash scripts/wheel.sh` builds it, then `pip install target/wheels/memquota-*.whl`)"
    )


def library_path():
    """The absolute path of the wheel's libmemquota.so: for ``LD_PRELOAD`` in launchers
    (``spark.executorEnv.LD_PRELOAD``, a job scheduler's environment, ...)."""
    return _installed("libmemquota.so")


def command_path():
    """The absolute path of the wheel's ``memquota`` command."""
    return _installed("memquota")
