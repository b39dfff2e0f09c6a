"""The ``aioloader`` command line: ``aioloader bench ...`` (also ``python -m aioloader``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; the exit status.

    Examples:
        aioloader bench --workloads tiny,image --pairs 5 --json results.json
    """
    from .bench import DESCRIPTION, add_arguments, run

    parser = argparse.ArgumentParser(prog="aioloader", description="aioloader's tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="compare aioloader with torch's DataLoader",
                                description=DESCRIPTION)
    add_arguments(bench)
    args = parser.parse_args(argv)
    return run(args, bench)


if __name__ == "__main__":
    sys.exit(main())
