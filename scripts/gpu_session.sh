#!/usr/bin/env bash
# One GPU session: info, the whole test suite, tune, bench (ops, then end to end), check. Logs go to $OUT (or ./gpu_out).
# Usage: bash scripts/gpu_session.sh [--no-tune | --tune-only FAMILY]
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m fastft info 2>&1 | tee "$OUT/info.log"
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -n 40
case "${1:-}" in
  --no-tune) ;;
  --tune-only) python3 -m fastft tune --only "$2" 2>&1 | tee "$OUT/tune.log" ;;
  *) python3 -m fastft tune 2>&1 | tee "$OUT/tune.log" ;;
esac
cp autotune_cache/*.json "$OUT/" 2>/dev/null
python3 -m fastft bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
python3 -m fastft e2e --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log"
python3 -m fastft check --seconds 30 2>&1 | tee "$OUT/check.log" | tail -n 5
