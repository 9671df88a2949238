#!/usr/bin/env bash
# Checks (and, as root, installs) what building and testing gpubridge needs on
# Debian 12. A non-root user gets the list of packages to install.
set -euo pipefail

missing=()
need() { # need <command> <debian package>
  command -v "$1" >/dev/null 2>&1 || missing+=("$2")
}
need gcc gcc
need make make
need ip iproute2
need tc iproute2
need git git
need python3 python3
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ ! -e /usr/include/linux/if.h ] && [ ! -e /usr/include/x86_64-linux-gnu/sys/cdefs.h ]; then
  missing+=(libc6-dev)
fi
# Wanted for tests, installed only as root (make test as root runs them):
# libibverbs-dev's <infiniband/verbs.h>, which lib/ibverbs's ABI test checks
# gbverbs.h against (gpubridge builds without it).
if [ "$(id -u)" -eq 0 ] && [ ! -e /usr/include/infiniband/verbs.h ]; then
  missing+=(libibverbs-dev)
fi
# Deduplicate.
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >&2
  else
    echo "deps: missing Debian packages: ${missing[*]}" >&2
    echo "deps: install them as root: apt-get install ${missing[*]}" >&2
    exit 2
  fi
fi

if ! command -v go >/dev/null 2>&1; then
  echo "deps: Go is missing: gpubridge needs Go 1.21 or later on PATH (go.mod asks for 1.26, which a Go >= 1.21 fetches by itself)." >&2
  echo "deps: Debian 12's golang package is 1.19, too old; install Go from go.dev/dl or a backport." >&2
  exit 2
fi
