#!/usr/bin/env bash
# The GPU check of issue 29, prepared to run once on a lent device (15 minutes in all):
#   bash bench/gpu_check.sh MODEL_DIR [OUT]
# MODEL_DIR: a model folder of SmolLM2-135M's shape (shared/gpu/README.md: random_model.py
# makes one from config.json + tokenizer); OUT (default gpu-out): logs and reports.
# Order: the CUDA-only tests first (cheap), then the bench at 32 x 64 and at 256 x 256.
set -u
model=${1:?usage: bench/gpu_check.sh MODEL_DIR [OUT]}
out=${2:-gpu-out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__,
torch.cuda.get_device_name())" 2>&1 | tee "$out/device.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_graphdecode.py \
    2>&1 | tail -n 30 > "$out/tests-cuda.log"
for size in "32 64" "256 256"; do
    set -- $size
    timeout 300 python3 bench/vs_trl_real.py --model "$model" --device cuda --dtype bfloat16 \
        --fixed-length --batch "$1" --max-new-tokens "$2" --rounds 1 --steps 2 --warmup 1 \
        --out "$out/bench-$1x$2.md" > "$out/bench-$1x$2.log" 2>&1
done
tail -n 3 "$out"/*.log
