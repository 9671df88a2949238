#!/usr/bin/env bash
# Creates the project virtualenv .venv with ci/requirements.txt when it is
# missing or out of date. Prints nothing when it is current.
set -euo pipefail
cd "$(dirname "$0")/.."
req=ci/requirements.txt
stamp=.venv/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || {
  echo "venv: $py is older than 3.10; set PYTHON=/path/to/python3.10+" >&2
  exit 2
}
echo "venv: installing $req into .venv (torch is large: this takes minutes once)" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >&2
.venv/bin/python -m pip install -q -r "$req" >&2
echo "$want" > "$stamp"
