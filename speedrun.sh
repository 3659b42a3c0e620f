#!/usr/bin/env bash
# nanopost speedrun: tokenizer -> base pretraining -> SFT -> DPO -> GRPO -> eval -> report card.
#
#   bash speedrun.sh              # no GPU: the tiny preset on synthetic data (2 CPU cores, ~10 minutes idle)
#                                 # one GPU: the small preset (~2.2 hours on a 24 GB card)
#                                 # 8 GPUs of >= 80 GB: the full preset with torchrun (~3.9 hours on 8xH100)
#   PRESET=small bash speedrun.sh # override the choice
#   bash speedrun.sh --choose     # only print the preset this machine gets, and why
#   WANDB_RUN=name bash speedrun.sh   # also log every stage to Weights & Biases
#   NANOPOST_HOME=/path bash speedrun.sh   # where tokenizer, checkpoints and report go (default ~/.cache/nanopost)
#   bash speedrun.sh --rlhf       # tiny preset: SFT -> reward model (rm.py) -> RL from the reward model, + report rows
#   bash speedrun.sh --rehearse   # the small and full presets' own chain on CPU: torchrun, 2 processes, tiny sizes
#
# Re-running after an interruption skips the stages that finished and resumes the one that was interrupted:
# every stage gets --resume, which continues from the stage's newest whole checkpoint (one that fails its checksums
# is skipped and reported), or exits at once if that checkpoint is marked finished. SIGTERM or Ctrl-C makes the
# running stage save a checkpoint after its current step and exit with status 75; nothing is lost.
#
# The GPU presets:
#   data       `python tasks.py prepare`: FineWeb-Edu sample-10BT and the post-training sets into $NANOPOST_HOME/data
#   tokenizer  65,536 tokens, BPE on 2B characters of FineWeb-Edu (CPU, ~2 min)
#   base       full: depth 20 (561M parameters), 15 tokens/parameter (8.4B tokens); small: depth 8 (92M), 8 tokens/param
#   SFT        SmolTalk + GSM8K train (calculator calls rendered as tool use)
#   DPO        UltraFeedback-binarized preference pairs
#   RL         GRPO on GSM8K train, verified by exact match of the '####' answer
#   eval       val bpb, CORE of base (GPU presets), ARC/MMLU, GSM8K pass@1/pass@k, coverage SFT vs RL, report.md
# The budget: `python plan.py --preset full|small`, from each stage's plan() (its --dry-run prints the same), not a
# measurement: FLOPs at an assumed MFU (40% pretraining, 25% post-training), rollouts and evaluations at an assumed
# decode rate (10,000 tokens/s per H100, 8,000 per 24 GB GPU), RL's sampling rounds per step from an assumed
# starting pass@1 with the slowest rank gating each step (common.expected_sampling_rounds), no old-log-prob pass;
# peak memory of the phase that holds most at once (the learner from model.training_memory at the micro-batch that
# fits, or RL's rollouts and eval's generation with their KV cache; pretraining: the eager bound, the compiled step
# keeps less). Download and tokenizer come on top. The two unknowns that move the total most are named under each
# table with what another value would change. tests/test_plan.py checks these lines.
#   full preset on 8xH100 80GB: minutes, peak GiB per GPU
#     base     157 min   49.3 GiB
#     sft        6 min   50.3 GiB
#     dpo        3 min   50.3 GiB
#     rl        64 min   30.7 GiB
#     eval       4 min   22.0 GiB
#     total    234 min
#     unknown: pretraining MFU 40% assumed; at 33%: +33 min, 50%: -31 min
#     unknown: RL 3.7 sampling rounds per step (gsm8k pass@1 5% at the start) assumed; at 1: -45 min, 4 (the cap): +5 min
#   small preset on 1x RTX 4090 24GB: minutes, peak GiB per GPU
#     base      76 min   14.2 GiB
#     sft        7 min   10.1 GiB
#     dpo        6 min   10.1 GiB
#     rl        35 min    8.3 GiB
#     eval       9 min    4.4 GiB
#     total    133 min
#     unknown: pretraining MFU 40% assumed; at 33%: +16 min, 50%: -15 min
#     unknown: RL 4.0 sampling rounds per step (gsm8k pass@1 2% at the start) assumed; at 1: -25 min
set -euo pipefail
cd "$(dirname "$0")"
# The interpreter every stage runs with: $PYTHON if set, else the `python` on PATH (an activated venv's), else python3
# (a stock Debian/Ubuntu has no bare `python`). torchrun is launched as `$PYTHON -m torch.distributed.run`, the same
# program as the `torchrun` script, so every rank runs the interpreter chosen here.
PYTHON="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [ -z "$PYTHON" ]; then
  echo "speedrun: no python or python3 on PATH; install Python 3.11+ and the requirements (README: Set-up)" >&2
  exit 1
fi
echo "speedrun: python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

if [ "${1:-}" = "--dry-run" ]; then
  # The full preset as far as a machine without GPUs or hub access can check it: every stage builds its config,
  # model and data pipeline on small local stand-in files of each hub dataset's schema, prints its plan
  # (parameters, token budgets, FLOPs) and stops without training. Needs ~4 GB of disk for the stand-in base.
  DRY=$(mktemp -d)
  trap 'rm -rf "$DRY"' EXIT
  export NANOPOST_HOME="$DRY/home" NANOPOST_DATA_DIR="$DRY/data"
  "$PYTHON" -c "import tasks; tasks.write_stand_in_data('$NANOPOST_DATA_DIR')"
  "$PYTHON" tokenizer.py --preset full --max-chars 20000000
  BASE="$NANOPOST_HOME/checkpoints/base"
  "$PYTHON" pretrain.py --preset full --dry-run --device cpu
  "$PYTHON" sft.py --preset full --dry-run --device cpu --ckpt "$BASE"
  "$PYTHON" dpo.py --preset full --dry-run --device cpu --ckpt "$BASE"
  "$PYTHON" rl.py --preset full --dry-run --device cpu --ckpt "$BASE"
  # The small preset, planned for one 24 GB GPU: its own stand-in base (depth 8, 1,024-token context).
  SMALL="$NANOPOST_HOME/checkpoints/base-small"
  "$PYTHON" pretrain.py --preset small --dry-run --device cpu --out "$SMALL"
  "$PYTHON" sft.py --preset small --dry-run --device cpu --ckpt "$SMALL"
  "$PYTHON" dpo.py --preset small --dry-run --device cpu --ckpt "$SMALL"
  "$PYTHON" rl.py --preset small --dry-run --device cpu --ckpt "$SMALL"
  "$PYTHON" plan.py --preset full
  "$PYTHON" plan.py --preset small
  echo "speedrun --dry-run: every stage of the full and small presets built its model and data pipeline"
  exit 0
fi

if [ "${1:-}" = "--rlhf" ]; then
  # The second path, for tasks no verifier can check: SFT -> reward model -> RL from the reward model's scores, on
  # the tiny preset (CPU). The verifier of the synthetic task is kept as the held-out judge only, next to the reward
  # model's score, so over-optimisation shows. Reuses finished tokenizer/base/SFT stages (each gets --resume).
  export NANOPOST_HOME="${NANOPOST_HOME:-$HOME/.cache/nanopost}"
  CK="$NANOPOST_HOME/checkpoints"
  [ -f "$NANOPOST_HOME/tokenizer/tokenizer.json" ] || "$PYTHON" tokenizer.py --preset tiny
  "$PYTHON" pretrain.py --preset tiny --resume
  "$PYTHON" sft.py --preset tiny --resume
  "$PYTHON" rm.py --preset tiny --resume
  # 12 steps of 8 prompts x 8 samples: enough for the reward model's score to rise well past where the verifier's
  # accuracy follows it (README: "RL from a reward model"), and short enough for the 15-minute budget.
  "$PYTHON" rl.py --preset tiny --resume --ckpt "$CK/sft" --out "$CK/rlhf" --reward rm --rm-ckpt "$CK/rm" \
    --num-steps 12 --eval-every 12 --prompts-per-step 8 --eval-problems 128 --eval-samples 4 --lr-frac 0.25
  "$PYTHON" eval.py --preset tiny --stage sft rlhf --num-samples 4 --k 1,4 --tasks synthetic --max-problems 128
  echo "speedrun --rlhf: done. Report card: $NANOPOST_HOME/report.md"
  exit 0
fi

# -----------------------------------------------------------------------------
# The chain, shared by the real run and the rehearsal: the same lines, only PRESET, LAUNCH, STAGE_FLAGS and LIMIT
# (the rehearsal's time limit in front of every command; empty otherwise) differ.

LIMIT=()

prepare_data() {
  # Hub data is downloaded once (resumable) and every stage reads it from disk: each rank its own row groups.
  # The small preset reads ~0.75B tokens: 2 of sample-10BT's ~0.7B-token files are enough. Data already there is
  # checked offline and kept; HF_HUB_OFFLINE=1 never contacts the hub.
  export NANOPOST_DATA_DIR="${NANOPOST_DATA_DIR:-$NANOPOST_HOME/data}"
  local shards=()
  [ "$PRESET" = small ] && shards=(--fineweb-shards 2)
  "${LIMIT[@]}" "$PYTHON" tasks.py prepare --dest "$NANOPOST_DATA_DIR" "${shards[@]}"
}

run_chain() {
  if [ -f "$NANOPOST_HOME/tokenizer/tokenizer.json" ]; then
    echo "speedrun: tokenizer already trained, skipping"
  else
    "${LIMIT[@]}" "$PYTHON" tokenizer.py --preset "$PRESET"
  fi
  "${LIMIT[@]}" "${LAUNCH[@]}" pretrain.py "${STAGE_FLAGS[@]}"
  "${LIMIT[@]}" "${LAUNCH[@]}" sft.py "${STAGE_FLAGS[@]}"
  "${LIMIT[@]}" "${LAUNCH[@]}" dpo.py "${STAGE_FLAGS[@]}"
  "${LIMIT[@]}" "${LAUNCH[@]}" rl.py "${STAGE_FLAGS[@]}"
  # Every checkpoint on its held-out tasks, then the coverage view: does RL's pass@1 gain cost pass@k?
  "${LIMIT[@]}" "${LAUNCH[@]}" eval.py --preset "$PRESET" --stage base sft dpo rl
  local coverage_task
  coverage_task=$([ "$PRESET" = tiny ] && echo synthetic || echo gsm8k)
  "${LIMIT[@]}" "${LAUNCH[@]}" eval.py --preset "$PRESET" --compare sft rl --num-samples 8 --k 1,8 \
    --tasks "$coverage_task"
}

if [ "${1:-}" = "--rehearse" ]; then
  # The small and full presets' own path (run_chain above, launched with torchrun) on CPU: 2 gloo processes,
  # stand-in hub data (tasks.write_stand_in_data), prepared offline. NANOPOST_REHEARSAL=1 makes every stage replace its
  # preset's sizes (common.REHEARSAL: depth, context, steps, problems) and print so; nothing else changes. It fails
  # on a non-zero exit, a launch still running after REHEARSAL_TIMEOUT seconds (default 600), a non-finite loss or
  # weight, ranks whose weights differ at a stage's end (common.check_ranks_agree), a report card missing a stage.
  # REHEARSAL_DIR=path keeps its files there (default: a temporary folder, removed at the end).
  if [ -n "${REHEARSAL_DIR:-}" ]; then
    REH="$REHEARSAL_DIR"
    mkdir -p "$REH"
  else
    REH=$(mktemp -d)
    trap 'rm -rf "$REH"' EXIT
  fi
  export NANOPOST_REHEARSAL=1 HF_HUB_OFFLINE=1 NANOPOST_DATA_DIR="$REH/data"
  LIMIT=(timeout -k 30 "${REHEARSAL_TIMEOUT:-600}")
  [ -d "$NANOPOST_DATA_DIR" ] || "${LIMIT[@]}" "$PYTHON" -c "import tasks; tasks.write_stand_in_data('$NANOPOST_DATA_DIR')"
  LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2)
  for PRESET in small full; do
    SECONDS=0
    export NANOPOST_HOME="$REH/$PRESET"
    STAGE_FLAGS=(--preset "$PRESET" --wandb-run dummy --resume)
    echo "speedrun --rehearse: preset $PRESET, launch: ${LAUNCH[*]} STAGE.py ${STAGE_FLAGS[*]}"
    prepare_data
    run_chain
    "${LIMIT[@]}" "$PYTHON" -c "import common; common.run_cli(lambda: common.check_report(['tokenizer', 'pretrain', \
'sft', 'dpo', 'rl', 'eval:base', 'eval:sft', 'eval:dpo', 'eval:rl', 'coverage:sft', 'coverage:rl']))"
    echo "speedrun --rehearse: preset $PRESET passed in ${SECONDS}s"
  done
  echo "speedrun --rehearse: the small and full presets' chains ran end to end under torchrun (2 gloo processes)"
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
# The preset from the GPUs found (plan.py --choose prints why; NANOPOST_FAKE_GPUS stubs the query in tests).
read -r CHOSEN NPROC < <("$PYTHON" plan.py --choose)
if [ -n "${PRESET:-}" ]; then
  echo "speedrun: PRESET=$PRESET overrides the choice ($CHOSEN)"
else
  PRESET=$CHOSEN
fi
case "$PRESET" in
  tiny) LAUNCH=("$PYTHON") ;;
  small|full) LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$([ "$NPROC" -gt 0 ] && echo "$NPROC" || echo 1)") ;;
  *) echo "speedrun: PRESET must be tiny, small or full, got '$PRESET'" >&2; exit 1 ;;
esac
STAGE_FLAGS=(--preset "$PRESET" --wandb-run "$RUN" --resume)
if [ "${1:-}" = "--choose" ]; then  # only say what would run here
  echo "speedrun: preset $PRESET, launch: ${LAUNCH[*]}"
  echo "speedrun: stage launch: ${LAUNCH[*]} STAGE.py ${STAGE_FLAGS[*]}"
  exit 0
fi
if [ "$PRESET" = tiny ]; then
  # One torch thread per core this process may run on (nproc: 2 on the reference machine): the tiny stages slow down
  # badly when more threads than cores share them. An OMP_NUM_THREADS already set is kept.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
  echo "speedrun: OMP_NUM_THREADS=$OMP_NUM_THREADS torch threads per stage"
fi
echo "speedrun: writing to $NANOPOST_HOME; wandb run: $RUN"

if [ "$PRESET" != tiny ]; then prepare_data; fi
run_chain
echo "speedrun: done. Report card: $NANOPOST_HOME/report.md"
echo "speedrun: chat with the result: $PYTHON engine.py --ckpt $NANOPOST_HOME/checkpoints/rl"
