#!/usr/bin/env bash
# Plain GRPO, the allocator, the curriculum and DAPO dynamic sampling on SmolLM2-135M, one after
# the other, each with 32 answers a step (README: "Dead groups predicted for any model").
# 16 training questions reused over 16 steps, so each prompt is seen about four times and the
# pass-rate posteriors have something to learn from. About 25 minutes on 2 CPU cores.
set -euo pipefail
OUT=${OUT:-runs/smollm2-cmp}
for v in grpo allocate curriculum dynamic; do
  case $v in
    grpo) flag="" ;; allocate) flag="--allocate" ;; curriculum) flag="--curriculum" ;;
    dynamic) flag="--dynamic-sampling" ;;
  esac
  grpolab train --config examples/smollm2_arith.yaml --dataset-size 16 --steps 16 \
    --eval-every 16 --eval-size 100 --checkpoint-every 0 --no-progress \
    --out-dir "$OUT/$v" $flag
done
python bench/compare_table.py "$OUT"/grpo "$OUT"/allocate "$OUT"/curriculum "$OUT"/dynamic
