#!/usr/bin/env bash
# ci/torch-venv.sh VERSION: creates the virtualenv .venv-torch-VERSION with
# torch==VERSION and ci/requirements-torch.txt, for running the plugin's tests
# on a torch other than .venv's; recreates it when the requirements changed.
# Prints nothing when it is current.
#
# PyPI's Linux wheel of torch is the CUDA build, and it needs its nvidia-*
# libraries even on CPU (`import torch` loads libcublas, libcudnn, libnccl...;
# without them it fails: "libcublasLt.so.*[0-9] not found"), so torch is
# installed with its dependencies: about 5-6 GB and 1-2 minutes per version.
set -euo pipefail
cd "$(dirname "$0")/.."
v=${1:-}
if [[ ! $v =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: ci/torch-venv.sh TORCH_VERSION (e.g. 2.8.0)" >&2
  exit 2
fi
venv=.venv-torch-$v
req=ci/requirements-torch.txt
stamp=$venv/.requirements.sha256
want=$({ echo "torch==$v"; cat "$req"; } | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || {
  echo "torch-venv: $py is older than 3.10; set PYTHON=/path/to/python3.10+" >&2
  exit 2
}
echo "torch-venv: installing torch $v and $req into $venv (5-6 GB; minutes, once)" >&2
rm -rf "$venv" # no leftovers of another torch (its CUDA libraries differ)
"$py" -m venv "$venv"
echo '*' > "$venv/.gitignore" # as Python 3.13's venv does: git ignores the venv
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q "torch==$v" -r "$req" >&2
got=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$got" != "$v" ]; then
  echo "torch-venv: $venv has torch $got, not $v" >&2
  exit 1
fi
echo "$want" > "$stamp"
