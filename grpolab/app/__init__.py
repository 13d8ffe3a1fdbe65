"""The command line, the commands behind it and the Python API."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The ``grpolab`` command (``grpolab.app.cli.main``), loaded here so that Ctrl-C while
    torch loads ends in one line and exit code 130, as it does later."""
    try:
        from grpolab.app.cli import main as command
    except KeyboardInterrupt:
        print("grpolab: interrupted; nothing was written", file=sys.stderr)
        return 130
    return command(argv)
