#!/usr/bin/env bash
# The tests (what .ci/run runs): the whole suite on the installed packages (the test extra pins the oldest
# supported transformers), then the integration tests again on the newest supported transformers release;
# without a GPU, then every kernel launch of the first run compiled for a GPU (scripts/compile_kernels.py).
# Arguments (test paths, -k ...) go to both runs in place of their defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NEWEST=5.24.0  # fastft/integrations/transformers/versions.py NEWEST; tests/test_versions.py checks they agree
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
launches=${TMPDIR:-/tmp}/fastft-launches.json
if [ "$gpu" = 1 ]; then
  "$PY" -m pytest -q -p no:cacheprovider "$@"
else  # the interpreter's kernel launches, recorded to be compiled for a GPU below
  "$PY" scripts/compile_kernels.py record "$launches" -- -q -p no:cacheprovider "$@"
fi
dir=${TMPDIR:-/tmp}/fastft-transformers-$NEWEST
if [ ! -d "$dir/transformers" ]; then
  "$PY" -m pip install -q --no-deps --target "$dir" "transformers==$NEWEST"
fi
# On a CPU the second run takes the ops' torch paths: the first ran the Triton kernels in the interpreter on
# the same inputs, and what changes between transformers releases is the integration, not the kernels.
backend=$([ "$gpu" = 1 ] && echo auto || echo torch)
echo "integration tests on transformers $NEWEST (FASTFT_BACKEND=${FASTFT_BACKEND:-$backend})"
if [ $# -eq 0 ]; then
  set -- tests/test_integrations_*.py tests/test_examples.py tests/test_versions.py
fi
FASTFT_BACKEND=${FASTFT_BACKEND:-$backend} PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider "$@"
if [ "$gpu" = 0 ]; then  # no GPU: every kernel the first run launched, compiled for H100/H200 and A100
  "$PY" scripts/compile_kernels.py compile "$launches" --arch 90 80
fi
