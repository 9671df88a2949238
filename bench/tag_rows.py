"""Copies the JSON rows (lines starting with "{") of stdin to stdout with
"config" set to the first argument, so that one rows file can hold several
runs of gbbridge bench (or gloo_allreduce.py) and bench/report.py tells them
apart; each further KEY=N argument sets the integer field KEY too (e.g. the
setting a run varied). Other lines are dropped (the bench's text is on
stderr anyway).

    bin/gbbridge bench --json ... | python3 bench/tag_rows.py CONFIG [KEY=N ...] >> rows.jsonl
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    usage = "usage: python3 bench/tag_rows.py CONFIG [KEY=N ...] < rows"
    if len(sys.argv) < 2:
        print(usage, file=sys.stderr)
        return 2
    fields: dict[str, int] = {}
    for arg in sys.argv[2:]:
        key, eq, value = arg.partition("=")
        if not key or not eq or not value.lstrip("-").isdigit():
            print(f"tag_rows.py: {arg!r} is not KEY=N; {usage}", file=sys.stderr)
            return 2
        fields[key] = int(value)
    for raw in sys.stdin:
        line = raw.strip()
        if line.startswith("{"):
            row = json.loads(line)
            row["config"] = sys.argv[1]
            row.update(fields)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
