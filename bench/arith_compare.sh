#!/usr/bin/env bash
# Teaching SmolLM2-135M 2-digit addition and subtraction (README: "A skill the model lacks"):
# plain GRPO (4 prompts x 8, or 8 x 4); the allocator with a prior per difficulty (Beta or grid
# prior, live groups or live answers, or each difficulty keeping its share of the answers); the
# curriculum; the allocator with one prior; DAPO dynamic sampling (4 steps: its
# refill rounds spend about the others' 24 steps of answers). Each from the same
# start for SEEDS, then a greedy eval of every final model and of the start, the table and the
# per-difficulty figure. About 6-12 minutes a run on 2 CPU cores (PPO: about 20).
# Longer: SEEDS=0 METHODS=grpo EXTRA="--steps 96 --eval-every 24" OUT=runs/arith-long
# bench/arith_compare.sh, then a larger eval of the final model:
#   grpolab eval --config examples/smollm2_addition.yaml --seed 0 --eval-size 600 \
#     --model-path runs/arith-long/grpo-s0/final --out-dir runs/arith-long/eval600
#   python bench/arith_table.py runs/arith-long --operators runs/arith-long/eval600 --seeds 0
# Mini-batches (4 optimiser steps on each batch): METHODS="grpo minibatches grpo-lr4" SEEDS="0 1 2"
# DAPO's soft overlong punishment: METHODS="grpo overlong"
# GRPO against PPO and REINFORCE++:
#   METHODS="grpo ppo ppo-g1 reinforce-pp reinforce-pp-baseline" TABLE=--estimators bench/arith_compare.sh
set -euo pipefail
OUT=${OUT:-runs/arith-cmp}
SEEDS=${SEEDS:-0 1}
METHODS=${METHODS:-grpo grpo-g4 allocate-kind allocate-kind-grid allocate-kind-grid-groups allocate-kind-answers allocate-by-kind curriculum allocate dynamic}
CFG=examples/smollm2_addition.yaml
for seed in $SEEDS; do
  [ -f "$OUT/base-s$seed/eval.json" ] || grpolab eval --config $CFG --seed "$seed" --out-dir "$OUT/base-s$seed"
  for m in $METHODS; do
    case $m in
      grpo) flag="" ;; allocate) flag="--allocate" ;; curriculum) flag="--curriculum" ;;
      grpo-g4) flag="--group-size 4" ;;  # 8 prompts x 4: the allocator's usual groups
      allocate-kind) flag="--allocate --predict-group-by difficulty" ;;
      allocate-kind-grid) flag="--allocate --predict-group-by difficulty --predict-prior grid
                                --allocate-objective live_answers" ;;
      allocate-kind-grid-groups) flag="--allocate --predict-group-by difficulty --predict-prior grid" ;;
      allocate-kind-answers) flag="--allocate --predict-group-by difficulty
                                   --allocate-objective live_answers" ;;
      allocate-by-kind) flag="--allocate --predict-group-by difficulty --allocate-by-kind" ;;
      dynamic) flag="--dynamic-sampling --steps 4 --eval-every 4" ;;  # ~ the others' answers
      minibatches) flag="--minibatches 4" ;;  # 4 optimiser steps a batch, a group each (verl)
      grpo-lr4) flag="--lr 1.2e-3" ;;  # one step at 4x the lr: as far per batch?
      overlong) flag="--rewards math,overlong:10" ;;  # DAPO's soft punishment past 30 tokens
      # the estimators GRPO is measured against (issue: PPO, REINFORCE++), KL in the reward
      ppo) flag="--estimator ppo --kl-in reward --kl-estimator k1 --critic-lr 1e-3" ;;
      ppo-g1) flag="--estimator ppo --kl-in reward --kl-estimator k1 --critic-lr 1e-3
                    --group-size 1" ;;  # 32 prompts x 1 answer
      reinforce-pp) flag="--estimator reinforce_pp --kl-in reward --kl-estimator k1" ;;
      reinforce-pp-baseline) flag="--estimator reinforce_pp_baseline --kl-in reward
                                   --kl-estimator k1" ;;
    esac
    grpolab train --config $CFG --seed "$seed" --no-progress --out-dir "$OUT/$m-s$seed" $flag \
      ${EXTRA:-}
    grpolab eval --config $CFG --seed "$seed" --model-path "$OUT/$m-s$seed/final" \
      --out-dir "$OUT/$m-s$seed/eval-final"
  done
done
# TABLE=--estimators: step time, peak memory and the critic's explained variance instead
python bench/arith_table.py "$OUT" --methods $METHODS --seeds $SEEDS --figure "$OUT/arith.png" ${TABLE:-}
