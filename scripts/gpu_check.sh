#!/usr/bin/env bash
# The GPU check: installs autodist with TensorFlow for CUDA and runs tests/gpu
# (NCCL all-reduce and GPU replicas against single-device Keras, each task
# given only its GPUs), then prints a summary. One bounded command for a
# machine with NVIDIA GPUs:
#
#     bash scripts/gpu_check.sh                        # installs into .venv-gpu (needs PyPI)
#     PYTHON=/path/to/python bash scripts/gpu_check.sh # a Python that already has
#                                                      # autodist[gpu,test] (no network)
#
# Bounds (seconds): GPU_CHECK_INSTALL_TIMEOUT (default 900), GPU_CHECK_TEST_TIMEOUT
# (default 1200). The clusters run in a private network namespace when
# `unshare -n` is allowed (TensorFlow servers bind every interface); elsewhere
# set GPU_CHECK_HOST_NETWORK=1 to run them on an isolated machine anyway, or
# they are skipped.
# Exit: 0 passed, 1 a test failed or none ran, 2 no GPU or the install failed, 124 timed
# out.
set -uo pipefail
cd "$(dirname "$0")/.."

say() { echo "gpu_check: $*"; }

if ! nvidia-smi -L; then
  say "nvidia-smi -L failed: no NVIDIA GPU (or driver) here"
  exit 2
fi
if [ -z "${PYTHON:-}" ]; then
  say "installing into .venv-gpu: pip install -e .[gpu,test]"
  if ! timeout "${GPU_CHECK_INSTALL_TIMEOUT:-900}" bash -c \
      '"${VENV_PYTHON:-python3}" -m venv .venv-gpu && .venv-gpu/bin/pip install -q -e ".[gpu,test]"'; then
    say "install failed or timed out (no network? give PYTHON=... with autodist[gpu,test])"
    exit 2
  fi
  PYTHON=.venv-gpu/bin/python
fi
export TF_CPP_MIN_LOG_LEVEL=2
info=$(timeout 300 "$PYTHON" -c '
import tensorflow as tf
gpus = len(tf.config.list_physical_devices("GPU"))
print(f"TensorFlow {tf.__version__}, CUDA build {tf.test.is_built_with_cuda()}, GPUs {gpus}")
' 2>&1 | tail -1)
say "$info"

log=$(mktemp -t gpu_check.XXXXXX.log)
pytest_args=(-m pytest -v -rs tests/gpu)
if unshare -n true 2>/dev/null; then
  where="private network namespace"
  timeout "${GPU_CHECK_TEST_TIMEOUT:-1200}" unshare -n bash -c \
    'ip link set lo up && AUTODIST_PRIVATE_NETNS=1 "$0" "$@"' "$PYTHON" "${pytest_args[@]}" 2>&1 | tee "$log"
  code=${PIPESTATUS[0]}
elif [ "${GPU_CHECK_HOST_NETWORK:-0}" = "1" ]; then
  where="host network (GPU_CHECK_HOST_NETWORK=1)"
  AUTODIST_PRIVATE_NETNS=1 timeout "${GPU_CHECK_TEST_TIMEOUT:-1200}" "$PYTHON" "${pytest_args[@]}" \
    2>&1 | tee "$log"
  code=${PIPESTATUS[0]}
else
  where="no namespace: cluster tests skipped (set GPU_CHECK_HOST_NETWORK=1 on an isolated machine)"
  timeout "${GPU_CHECK_TEST_TIMEOUT:-1200}" "$PYTHON" "${pytest_args[@]}" 2>&1 | tee "$log"
  code=${PIPESTATUS[0]}
fi

echo
say "summary"
say "  GPUs: $(nvidia-smi -L | wc -l) listed; $info"
say "  clusters: $where"
say "  result: $(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -1 | tr -d '=')"
grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/gpu_check:   /'
grep -E '^SKIPPED ' "$log" | sed 's/^/gpu_check:   /'
say "  full log: $log"
passed=$(grep -cE ' PASSED( |$)' "$log")
case $code in
  0) if [ "$passed" -gt 0 ]; then say "PASSED ($passed tests)"; else
       say "NO GPU TEST RAN (all skipped: see the reasons above)"; code=1; fi ;;
  124) say "TIMED OUT after ${GPU_CHECK_TEST_TIMEOUT:-1200}s" ;;
  5) say "no test ran"; code=1 ;;
  *) say "FAILED (pytest exit $code)"; code=1 ;;
esac
exit "$code"
