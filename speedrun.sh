#!/usr/bin/env bash
# nanopost speedrun: tokenizer -> base pretraining -> SFT -> DPO -> GRPO -> eval -> report card.
#
#   bash speedrun.sh              # no GPU: the tiny preset on synthetic data (2 CPU cores, ~20 minutes)
#                                 # GPUs:   the full preset with torchrun on every GPU (~4 hours on 8xH100)
#   WANDB_RUN=name bash speedrun.sh   # also log every stage to Weights & Biases
#   NANOPOST_HOME=/path bash speedrun.sh   # where tokenizer, checkpoints and report go (default ~/.cache/nanopost)
#
# Re-running after an interruption skips the stages that finished and resumes the one that was interrupted:
# every stage gets --resume, which continues from the stage's newest whole checkpoint (one that fails its checksums
# is skipped and reported), or exits at once if that checkpoint is marked finished. SIGTERM or Ctrl-C makes the
# running stage save a checkpoint after its current step and exit with status 75; nothing is lost.
#
# The full preset (8xH100):
#   data       `python tasks.py prepare`: FineWeb-Edu sample-10BT and the post-training sets into $NANOPOST_HOME/data
#   tokenizer  65,536 tokens, BPE on 2B characters of FineWeb-Edu                                 ~2 min
#   base       depth 20 (~560M parameters), 15 tokens per parameter (8.4B tokens) of FineWeb-Edu   ~2.5 h
#   SFT        SmolTalk + GSM8K train (calculator calls rendered as tool use)                     ~20 min
#   DPO        UltraFeedback-binarized preference pairs                                            ~20 min
#   RL         GRPO on GSM8K train, verified by exact match of the '####' answer                   ~40 min
#   eval       val bpb, ARC/MMLU, GSM8K pass@1/pass@k, coverage SFT vs RL, report.md
set -euo pipefail
cd "$(dirname "$0")"

if [ "${1:-}" = "--dry-run" ]; then
  # The full preset as far as a machine without GPUs or hub access can check it: every stage builds its config,
  # model and data pipeline on small local stand-in files of each hub dataset's schema, prints its plan
  # (parameters, token budgets, FLOPs) and stops without training. Needs ~4 GB of disk for the stand-in base.
  DRY=$(mktemp -d)
  trap 'rm -rf "$DRY"' EXIT
  export NANOPOST_HOME="$DRY/home" NANOPOST_DATA_DIR="$DRY/data"
  python -c "import tasks; tasks.write_stand_in_data('$NANOPOST_DATA_DIR')"
  python tokenizer.py --preset full --max-chars 20000000
  BASE="$NANOPOST_HOME/checkpoints/base"
  python pretrain.py --preset full --dry-run --device cpu
  python sft.py --preset full --dry-run --device cpu --ckpt "$BASE"
  python dpo.py --preset full --dry-run --device cpu --ckpt "$BASE"
  python rl.py --preset full --dry-run --device cpu --ckpt "$BASE"
  echo "speedrun --dry-run: every stage of the full preset built its model and data pipeline"
  exit 0
fi

export NANOPOST_HOME="${NANOPOST_HOME:-$HOME/.cache/nanopost}"
# On SIGTERM/SIGINT a training stage finishes its step, saves a resumable checkpoint and exits with 75
# (common.PREEMPTED_EXIT); set -e stops the chain there. torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds (default 30) after forwarding the signal before it kills them: long enough to write a full-preset checkpoint.
on_exit() {
  status=$?
  [ "$status" -eq 75 ] && echo "speedrun: preempted; the stage saved a checkpoint: run bash speedrun.sh again to resume"
  exit "$status"
}
trap on_exit EXIT
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
RUN="${WANDB_RUN:-dummy}"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -gt 0 ]; then
  PRESET=full
  LAUNCH=(torchrun --standalone --nproc_per_node="$NGPU")
  echo "speedrun: $NGPU GPU(s) found -> full preset (hub data, torchrun on $NGPU processes)"
else
  PRESET=tiny
  LAUNCH=(python)
  echo "speedrun: no GPU found -> tiny preset (offline synthetic data, CPU)"
fi
echo "speedrun: writing to $NANOPOST_HOME; wandb run: $RUN"
STAGE_FLAGS=(--preset "$PRESET" --run "$RUN" --resume)

if [ "$PRESET" != tiny ]; then
  # Hub data is downloaded once (resumable) and every stage reads it from disk: each rank its own row groups.
  export NANOPOST_DATA_DIR="${NANOPOST_DATA_DIR:-$NANOPOST_HOME/data}"
  python tasks.py prepare --dest "$NANOPOST_DATA_DIR"
fi

if [ -f "$NANOPOST_HOME/tokenizer/tokenizer.json" ]; then
  echo "speedrun: tokenizer already trained, skipping"
else
  python tokenizer.py --preset "$PRESET"
fi
"${LAUNCH[@]}" pretrain.py "${STAGE_FLAGS[@]}"
"${LAUNCH[@]}" sft.py "${STAGE_FLAGS[@]}"
"${LAUNCH[@]}" dpo.py "${STAGE_FLAGS[@]}"
"${LAUNCH[@]}" rl.py "${STAGE_FLAGS[@]}"
# Every checkpoint on its held-out tasks, then the coverage view: does RL's pass@1 gain cost pass@k?
for STAGE in base sft dpo rl; do
  "${LAUNCH[@]}" eval.py --preset "$PRESET" --stage "$STAGE"
done
COVERAGE_TASK=$([ "$PRESET" = full ] && echo gsm8k || echo synthetic)
"${LAUNCH[@]}" eval.py --preset "$PRESET" --compare sft rl --num-samples 8 --k 1,8 --tasks "$COVERAGE_TASK"
echo "speedrun: done. Report card: $NANOPOST_HOME/report.md"
echo "speedrun: chat with the result: python engine.py --ckpt $NANOPOST_HOME/checkpoints/rl"
