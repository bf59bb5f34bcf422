#!/usr/bin/env bash
# Installs autodist, captures an example model and builds strategies for a local cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TF_CPP_MIN_LOG_LEVEL=2
mkdir -p demo_out
.venv/bin/autodist inspect ncf --save demo_out/ncf.pb
echo
.venv/bin/autodist strategy build Parallax --model demo_out/ncf.pb --out demo_out/parallax.pb
echo
.venv/bin/autodist strategy show demo_out/parallax.pb --graph-item demo_out/ncf.pb
