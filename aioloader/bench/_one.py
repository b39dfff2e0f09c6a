"""``python -m aioloader.bench._one SPEC_JSON``: one measurement in a fresh interpreter, as JSON.

The bench itself forks its measurements; this entry is for profiling one of them, e.g.
``py-spy record -s -- python -m aioloader.bench._one '{"kind": "throughput", "side": "torch"}'``.
"""

from __future__ import annotations

import json
import sys

from ._first import measure
from ._measure import Spec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m aioloader.bench._one SPEC_JSON", file=sys.stderr)
        return 2
    print(json.dumps(measure(Spec.from_json(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
