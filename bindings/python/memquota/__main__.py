"""``python -m memquota ...``: the wheel's ``memquota`` command with these arguments
(``python -m memquota run --limit 2g -- python job.py``)."""

import os
import sys

from ._paths import command_path


def main():
    try:
        command = command_path()
    except FileNotFoundError as e:
        sys.exit(f"memquota: {e}")
    os.execv(command, [command] + sys.argv[1:])


if __name__ == "__main__":
    main()
