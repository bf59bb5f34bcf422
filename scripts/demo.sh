#!/usr/bin/env bash
# Installs autodist, then lets the search find a strategy for an example
# recommendation model (two embedding tables) on a local cluster of 2 worker +
# 1 PS processes, trains with it, and checks the weights against
# single-device Keras.
#
# TensorFlow servers bind every interface, so autodist runs the cluster's tasks
# in a private network namespace (loopback only; `unshare --net` as root, else
# an unprivileged user namespace). Where it cannot make one, the run stops with
# an error saying why; `AUTODIST_ALLOW_EXPOSED=1 bash scripts/demo.sh` then runs
# it reachable from other hosts, with a warning naming the ports (trusted
# networks only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TF_CPP_MIN_LOG_LEVEL=2
mkdir -p demo_out
.venv/bin/autodist inspect ncf --save demo_out/ncf.pb
echo
.venv/bin/autodist run --model ncf --builder search --workers 2 --ps 1 --epochs 2
