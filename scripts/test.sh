#!/usr/bin/env bash
# Installs autodist and runs the test suite.
#
# TensorFlow gRPC servers bind every interface, so the tests run in a private
# network namespace (loopback only) when `unshare` is allowed; otherwise they
# run as they are and tests needing the namespace are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TF_CPP_MIN_LOG_LEVEL=2
if unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && export AUTODIST_PRIVATE_NETNS=1 && .venv/bin/python -m pytest -q "$@"' bash "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
