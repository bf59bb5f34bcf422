#!/usr/bin/env bash
# Installs autodist, then lets the search find a strategy for an example
# recommendation model (two embedding tables) on a local cluster of 2 worker +
# 1 PS processes, trains with it, and checks the weights against
# single-device Keras.
#
# TensorFlow servers bind every interface, so the cluster runs in a private
# network namespace (loopback only) when `unshare` is allowed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TF_CPP_MIN_LOG_LEVEL=2
mkdir -p demo_out
.venv/bin/autodist inspect ncf --save demo_out/ncf.pb
echo
cmd=(.venv/bin/autodist run --model ncf --builder search --workers 2 --ps 1 --epochs 2)
if unshare -n true 2>/dev/null; then
  unshare -n bash -c 'ip link set lo up && "$@"' bash "${cmd[@]}"
else
  "${cmd[@]}"
fi
