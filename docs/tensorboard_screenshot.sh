#!/usr/bin/env bash
# Screenshot of TensorBoard's time-series page for a run, headless (how docs/tensorboard-smollm2.png
# was made). Needs the tensorboard package and Debian's chromium-headless-shell
# (apt-get install chromium-headless-shell). Usage: docs/tensorboard_screenshot.sh LOGDIR OUT.png
# TAGS: the tag regex (URL-encoded, e.g. reward_mean%7Cdead_share); WAIT: seconds to let
# TensorBoard load the run before the shot (default 10; more on a busy machine).
set -euo pipefail
LOGDIR=$1; OUT=$2; PORT=${PORT:-6111}
tensorboard --logdir "$LOGDIR" --port "$PORT" >/dev/null 2>&1 & TB=$!
trap 'kill $TB' EXIT
sleep ${WAIT:-10}
# The SCALARS page: the TIME SERIES page draws with WebGL, which rendered blank cards headless
# for a 40-step run (swiftshader or not); SCALARS renders. TAGS is a URL-encoded regex.
chromium-headless-shell --no-sandbox --use-angle=swiftshader --enable-unsafe-swiftshader \
  --use-gl=angle --hide-scrollbars --window-size=1800,1150 --virtual-time-budget=60000 \
  --run-all-compositor-stages-before-draw --screenshot="$OUT" \
  "http://localhost:$PORT/#scalars&tagFilter=${TAGS:-%5E(reward_mean%7Cheldout_acc%7Cdead_share%7Cposterior_dead_share)%24}" \
  2>/dev/null
