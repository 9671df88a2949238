"""Copies the JSON rows (lines starting with "{") of stdin to stdout with
"config" set to the one argument, so that one rows file can hold several
runs of gbbridge bench (or gloo_allreduce.py) and bench/report.py tells them
apart. Other lines are dropped (the bench's text is on stderr anyway).

    bin/gbbridge bench --json ... | python3 bench/tag_rows.py CONFIG >> rows.jsonl
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python3 bench/tag_rows.py CONFIG < rows", file=sys.stderr)
        return 2
    for raw in sys.stdin:
        line = raw.strip()
        if line.startswith("{"):
            row = json.loads(line)
            row["config"] = sys.argv[1]
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
