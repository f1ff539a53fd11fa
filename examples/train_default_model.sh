#!/usr/bin/env bash
# Train the tiny offline default model with our own trainer: a byte-level Llama
# (the "tiny" preset: hidden 128, 4 layers, 4 heads / 2 KV heads, ~0.8M parameters,
# 3.3 MB in float32) on Tiny Shakespeare. 18 minutes on a shared 2-core box (~4,500 tokens/s).
#
#   examples/train_default_model.sh [OUTPUT]      (default: examples/default-model-candidate)
#
# Then:  mlx-tfm generate --model OUTPUT --prompt "ROMEO:" --max-tokens 200
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
output="${1:-$here/default-model-candidate}"
corpus="$here/../../shared/data/tinyshakespeare/input.txt"

mlx-tfm train \
  --config tiny \
  --tokenizer byte \
  --data "$corpus" \
  --output "$output" \
  --iters 1200 \
  --batch-size 16 \
  --seq-len 256 \
  --learning-rate 3e-3 \
  --min-learning-rate 3e-4 \
  --warmup-steps 60 \
  --weight-decay 0.1 \
  --grad-clip 1.0 \
  --steps-per-report 50 \
  --steps-per-eval 200 \
  --val-batches 20 \
  --save-every 200 \
  --keep-checkpoints 1 \
  --seed 0 \
  "${@:2}"
