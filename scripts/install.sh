#!/usr/bin/env bash
# Creates .venv (if absent) and installs autodist with the CPU TensorFlow, the test tools
# (pytest, protoc, the notebook runner), matplotlib for the pictures (the plot extra; its
# tests draw figures) and the documentation tools (mkdocs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[cpu,test,docs,plot]"
