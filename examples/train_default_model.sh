#!/usr/bin/env bash
# The recipe of the shipped offline default model (mlx_tfm/assets/default-model/):
# distillation of Karpathy's stories260K (MIT) into a student trained by our own trainer.
#
#  1. examples/distill_stories.py samples ~1.5M tokens of short stories from the teacher
#     (batched decode, temperature 0.9, one story per jsonl line) into a /tmp folder;
#  2. `mlx-tfm train` trains a Llama from scratch on them: the "tiny" preset (hidden 128,
#     4 layers, 4 heads / 2 KV heads, d_ff 384, tied embeddings) with the teacher's
#     SentencePiece tokenizer (tok512, vocab 512).
#
#   examples/train_default_model.sh [OUTPUT] [extra mlx-tfm train flags]
#       (default OUTPUT: /tmp/default-stories-model)
#
# Then:  mlx-tfm generate --model OUTPUT --prompt "Once upon a time" --max-tokens 120
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
output="${1:-/tmp/default-stories-model}"
teacher="$here/../tests/data/stories260K-hf"  # in a clone of this repository
corpus="${CORPUS:-/tmp/stories-distill}"

if [ ! -f "$corpus/train.jsonl" ]; then
  python "$here/distill_stories.py" --teacher "$teacher" --output "$corpus" \
    --tokens 1500000 --batch-size 128 --max-tokens 256 --temperature 0.9 --seed 0
fi

mlx-tfm train \
  --config tiny \
  --tokenizer "$teacher" \
  --data "$corpus" \
  --output "$output" \
  --iters 700 \
  --batch-size 16 \
  --seq-len 256 \
  --learning-rate 3e-3 \
  --min-learning-rate 3e-4 \
  --warmup-steps 40 \
  --weight-decay 0.1 \
  --grad-clip 1.0 \
  --steps-per-report 50 \
  --steps-per-eval 100 \
  --val-batches 20 \
  --save-every 100 \
  --keep-checkpoints 1 \
  --seed 0 \
  "${@:2}"
