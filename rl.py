"""
Reinforcement learning from verifiable rewards: the GRPO family, one loop written out below.

    python rl.py --preset tiny                                  # CPU, synthetic arithmetic, ~2 minutes
    python rl.py --preset small                                 # GSM8K, depth 8, on one 24 GB GPU
    torchrun --nproc_per_node=8 rl.py --preset full             # one node, 8 GPUs (--nnodes=2 ... for two)
    python rl.py --preset tiny --ckpt CK/sft --out CK/rlhf --reward rm --rm-ckpt CK/rm   # RL from a reward model
    python rl.py --preset tiny --lora-rank 8                    # LoRA adapters (model.LoRA) on a frozen policy

Each step, on every rank (a group never spans ranks): rollout (Engine.generate, G completions per prompt, their ids
and behavior log-probs kept: text is never re-tokenized) -> score (the verifier; dynamic sampling) ->
group_advantages -> old log-probs and the ratio -> policy_loss -> aggregate (+ KL) -> optimizer step -> log, eval,
save. The math is objectives.py, the mechanism rollout.py, the opt-in systems rl_systems.py; PPO with a critic is
ppo.py. The default recipe (--preset chooses data, sizes and learning rates only):
    - GRPO advantages (r - mean) / (std + eps) (Shao et al. 2024); with binary rewards every kept prompt gets the
      same total weight; Dr. GRPO (Liu et al. 2025): --adv-scale none; RLOO: --adv-baseline loo.
    - dynamic sampling (DAPO, Yu et al. 2025): zero-contrast groups are dropped and more are sampled.
    - the ppo loss with clip-higher eps 0.2 / 0.28 (DAPO) and token-mean aggregation (DAPO).
    - no KL and no reference model (DAPO, Dr. GRPO): a verifier cannot be flattered. --reward rm (Ziegler et al.
      2019; Ouyang et al. 2022) turns KL on (0.05) and std scaling off: a learned reward can be exploited.
    - truncated importance sampling, cap 2 (Yao et al. 2025): min(pi_trainer / pi_engine, 2) corrects the
      sampler/learner numerical gap.
    - fully on-policy: one epoch of one minibatch, so the ratio is 1 and the learner's own pass gives the old
      log-probs; with --epochs or --minibatches > 1 a no-grad pass scores them first.
Opt-in systems, off by default (measured in docs/results.md, "RL systems flags"): --task a:w,b:w mixtures,
--decontaminate, --difficulty-filter, --ptgs, --async.
"""

import argparse
import math
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch

from common import (ASSUMED_PASS_RATE, FINISHED, HARDWARE, Logger, add_stage_flags, append_report,
                    batch_tokens_for_device, check_ranks_agree, checkpoint_dir, compute_cleanup, compute_init,
                    exit_preempted, expected_sampling_rounds, fit_batch_tokens, inference_memory, kv_cache_bytes,
                    load_checkpoint, load_optimizers, model_size, preempted, print0, print_plan, resume_or_finish,
                    rl_models_bytes, run_cli, save_checkpoint, set_lr, stage_plan, synchronize)
from engine import Engine, load_model
from model import (EMBEDDING_LR, LOGITS_CHUNK_TOKENS, MATRIX_LR, UNEMBEDDING_LR, add_lora_flags, attach_lora,
                   check_lora_flags, lora_checkpoint, trainable_params)
from objectives import aggregate, group_advantages, kl_penalty, policy_loss
from rollout import (PRESETS, account_sources, add_flags, add_loss_stats, all_reduce_gradients, batch_counts,
                     evaluate_held_out, finish_args, group_rewards, learner_batches, learner_tally, load_reward_model,
                     prepare_prompts, print_step, reduce_tally, reference_sampling, report_record, reward_judge,
                     row_sampling, score_old, step_metrics, token_logprobs)
from rl_systems import Rollouts, difficulty_prompts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run = add_stage_flags(parser, PRESETS, preset="fills the defaults below; explicit flags win",
                          seed="seeds prompt draws and sampling", run="wandb run name ('dummy': no wandb)",
                          ckpt="input checkpoint folder (default: $NANOPOST_HOME/checkpoints/dpo)",
                          out="output checkpoint folder (default: $NANOPOST_HOME/checkpoints/rl)",
                          resume="continue from the latest checkpoint in --out; exit if it is finished")
    recipe = add_flags(parser, run)["recipe"]
    recipe.add_argument("--adv-scale", choices=["std", "none"], default=None,
                        help="std: GRPO; none: Dr. GRPO (default: std, none with --reward rm: a group of near-tied "
                             "scores divided by its tiny std would get full-size advantages)")
    recipe.add_argument("--adv-baseline", choices=["mean", "loo"], default="mean",
                        help="mean: GRPO; loo: RLOO leave-one-out")
    add_lora_flags(parser.add_argument_group("LoRA"))
    args = parser.parse_args(argv)
    check_lora_flags(parser, args)
    if args.lora_rank and args.async_rollouts:
        parser.error("--async sends the policy's weights to a plain GPT in the rollout process; with --lora-rank drop "
                     "--async")
    args = finish_args(parser, args)
    if args.adv_scale is None:
        args.adv_scale = "none" if args.reward == "rm" else "std"
    return args


def main(argv=None):
    args = parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device, seed=args.seed)
    if args.prompts_per_step % world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world_size} ranks")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    truncated = args.top_k is not None or args.top_p is not None  # the KL then needs its own untruncated scoring
    ckpt = Path(args.ckpt) if args.ckpt else checkpoint_dir("dpo")
    out = Path(args.out) if args.out else checkpoint_dir("rl")

    # Model: the previous stage's checkpoint, or our own to resume from (with LoRA: the base from --ckpt, the adapters
    # from ours); the frozen reference (with LoRA: the same model with its adapters off) and reward models.
    resume = resume_or_finish(out, args.resume, "rl")  # the newest whole step folder, or None
    if resume is FINISHED:
        return
    model, tokenizer, meta = load_model(resume if resume and not args.lora_rank else ckpt, device)
    lora = attach_lora(model, args)  # None without --lora-rank
    ref_model = None
    if args.kl_coef > 0:
        ref_model = model if lora else load_model(ckpt, device)[0].requires_grad_(False)
    reference_off = lora.disabled if lora else nullcontext  # the reference forward: adapters off, or nothing to do
    reward_model = load_reward_model(args, tokenizer, device)
    engine = Engine(model, tokenizer)
    pad_id = tokenizer.token_id("<|assistant_end|>")  # any id: padded positions have target -1
    print0(f"model: {model.num_params():,} parameters from {out if resume else ckpt} on {device}, {world_size} rank(s)")

    # Data: training prompts (mixture, decontamination) and the held-out problems.
    train_task, test_task, eval_indices, decontaminated = prepare_prompts(args, world_size, reward_judge(args))
    optimizers = lora.optimizers(args.lora_lr) if lora else model.setup_optimizers(
        matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    if lora:
        print0(f"{lora.extra_repr()}: {lora.num_trainable():,} trainable parameters, the base frozen")
    longest_prompt = max(len(tokenizer.render_for_completion(train_task[i])) for i in range(min(64, len(train_task))))
    print0(f"plan: {args.num_steps} steps; each samples {args.prompts_per_step} x {args.group_size} completions of <= "
           f"{args.max_tokens} tokens per round (<= {args.max_sampling_rounds} rounds), then {args.epochs} epoch(s) "
           f"x {args.minibatches} minibatch(es) of optimizer steps; loss {args.loss} ({args.loss_agg}), advantages "
           f"{args.adv_scale}/{args.adv_baseline}, KL {args.kl_coef}, mismatch {args.mismatch}; reward "
           f"{args.reward}; prompts up to {longest_prompt} + {args.max_tokens} tokens "
           f"(model context {model.config.sequence_len})")
    held = kv_cache_bytes(model.config, math.ceil(args.prompts_per_step // world_size * args.oversample)
                          * args.group_size, longest_prompt + args.max_tokens)
    held += 4 * model.num_params() if ref_model is not None and not lora else 0
    args.device_batch_tokens = batch_tokens_for_device("rl", None if args.fit_batch else args.device_batch_tokens,
                                                       device, model.config, args.device_batch_tokens,
                                                       longest_prompt + args.max_tokens, LOGITS_CHUNK_TOKENS, held)
    if args.dry_run:
        if args.preset in HARDWARE:
            print_plan(plan(args, model.config))
        print0("dry run: model, optimizers and data are built; stopping before the first rollout")
        compute_cleanup()
        return
    train_task = difficulty_prompts(args, engine, train_task, ckpt, resume, sampling)
    start_step, history, source_totals, extra = 0, [], Counter(), {}  # source_totals: the run's sums, checkpointed
    tokens_sampled = 0  # every sampled completion token, dynamic sampling's dropped groups too: the rollout budget
    if resume:
        _, _, extra = load_checkpoint(resume, device=device)
        load_optimizers(optimizers, extra["optimizers"])
        if lora:
            lora.load_state_dict(extra["lora"])
        start_step, history, tokens_sampled = extra["step"], extra["history"], extra["tokens_sampled"]
        source_totals.update(extra["source_totals"])
        print0(f"resuming at step {start_step}")
    logger = Logger(args.run, vars(args), series=extra.get("curves"))  # on --resume, the curves so far
    if start_step == 0:
        history.append(evaluate_held_out(engine, test_task, eval_indices, args, 0, reward_model))
        logger.log({f"eval/{k}": v for k, v in history[-1].items() if k != "step"}, step=0)
    # The worker of --async loads the checkpoint the policy came from (out on resume); weights come per job.
    rollouts = Rollouts(args, engine, train_task, out if resume else ckpt, start_step, reward_model,
                        state=extra)

    def save(step, finished):
        if finished:
            check_ranks_agree(model, f"rl step {step}")
        if rank != 0:
            return
        state = {"optimizers": [o.state_dict() for o in optimizers], "step": step, "history": history,
                 "source_totals": dict(source_totals), "tokens_sampled": tokens_sampled, "curves": logger.series}
        state.update(rollouts.state_dict())  # PTGS counts, the --async worker's pending weights
        meta = {"stage": "rl", "source": str(ckpt), "args": vars(args), "finished": finished,
                "eval": history[-1] if history else None}
        save_checkpoint(out, step, tokenizer=tokenizer, **lora_checkpoint(model, lora, meta, state))

    t_start = time.time()
    for step in range(start_step, args.num_steps):
        # 1-2. Rollout and score: this rank's groups, with dynamic sampling.
        synchronize(device)
        t0 = time.time()
        groups, rollout_tally, info = rollouts.next_groups(step)
        synchronize(device)
        t1 = time.time()

        # 3. Advantages: every token of a completion carries its group advantage; an errored completion has none.
        rewards, valid = group_rewards(groups)  # (N,), (N,) in group order
        advantages = group_advantages(rewards, args.group_size, scale=args.adv_scale, baseline=args.adv_baseline,
                                      valid=valid)  # (N,)
        minibatches, positions = learner_batches(groups, advantages.tolist(), args, pad_id, device)

        # 4a. Old log-probs, the engine/trainer gap, entropy (score_old); the reference log-probs; the global counts
        # the loss is averaged over. One epoch of one minibatch updates once, after every micro-batch is scored: its
        # ratio is exactly 1, so the learner pass's own log-probs, detached, are the old ones and no extra no-grad
        # pass runs.
        tally = learner_tally(rollout_tally, groups, positions)
        account_sources(tally, (micro for mb in minibatches for micro in mb))
        old_from_learner = args.epochs == 1 and args.minibatches == 1
        with torch.no_grad():
            for micro in (micro for mb in minibatches for micro in mb):
                if not old_from_learner:
                    score_old(micro, *token_logprobs(model, micro["inputs"], micro["targets"],
                                                     row_sampling(sampling, micro)), tally, args)
                if ref_model is not None:
                    with reference_off():
                        micro["ref_logp"], _ = token_logprobs(ref_model, micro["inputs"], micro["targets"],
                                                              reference_sampling(row_sampling(sampling, micro)))
        counts, _ = batch_counts(minibatches, args.loss_agg, device)

        # 4b. The update: --epochs passes over the batch, one optimizer step per minibatch.
        lr_multiplier = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
        set_lr(optimizers, lr_multiplier)
        optimizer_steps, grad_norms = 0, []  # the same on every rank (grad norms are taken after the all-reduce)
        for epoch in range(args.epochs):
            for minibatch, count in zip(minibatches, counts):
                if count == 0:  # nothing to learn from on any rank (every group filtered or masked)
                    continue
                for micro in minibatch:
                    logp, entropy = token_logprobs(model, micro["inputs"], micro["targets"],
                                                   row_sampling(sampling, micro))
                    if old_from_learner:
                        score_old(micro, logp.detach(), entropy.detach(), tally, args)
                    loss, stats = policy_loss(logp, micro["old_logp"], micro["advantages"], micro["mask"],
                                              kind=args.loss, eps_low=args.eps_low, eps_high=args.eps_high,
                                              agg=args.loss_agg, dual_clip=args.dual_clip, weights=micro["weights"],
                                              max_len=args.max_tokens, count=count)
                    if ref_model is not None:
                        kl_logp = logp if not truncated else token_logprobs(
                            model, micro["inputs"], micro["targets"],
                            reference_sampling(row_sampling(sampling, micro)))[0]
                        kl = kl_penalty(kl_logp, micro["ref_logp"], args.kl_kind)  # (B, T)
                        loss = loss + args.kl_coef * aggregate(kl, micro["mask"], args.loss_agg,
                                                               max_len=args.max_tokens, count=count)
                        tally["kl_sum"] += float((kl.detach() * micro["mask"]).sum())
                    loss.backward()
                    add_loss_stats(tally, loss, stats, float(micro["mask"].sum()))
                if ddp:
                    all_reduce_gradients(model)
                if args.max_grad_norm > 0:
                    grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
                for optimizer in optimizers:
                    optimizer.step()
                model.zero_grad(set_to_none=True)
                optimizer_steps += 1
        synchronize(device)
        t2 = time.time()
        rollouts.after_update(step)

        # Logs: rollout outcomes of every sampled group (filtered ones included), learner statistics, timings.
        tally = reduce_tally(tally, device)
        tokens_sampled += int(tally["length_sum"])
        metrics = step_metrics(tally, optimizer_steps, grad_norms, (t1 - t0, t2 - t1), info, train_task.tasks,
                               source_totals)
        extra_line = ""
        if ref_model is not None:
            metrics["policy/kl"] = tally["kl_sum"] / (tally["loss_tokens"] or math.nan)  # NaN: no token trained
        if reward_model is not None:
            metrics["reward/rm_score"] = tally["rm_score_sum"] / max(tally["completions"], 1)  # before normalising
            extra_line = f"| rm score {metrics['reward/rm_score']:+.3f} verifier acc {metrics['reward/accuracy']:.3f} "
        logger.log(metrics, step=step + 1)
        eta = (time.time() - t_start) / (step + 1 - start_step) * (args.num_steps - step - 1)
        print_step(step, args.num_steps, metrics, extra_line, (t1 - t0, t2 - t1), eta)

        # 5. Held-out evaluation and periodic checkpoints.
        last = step + 1 == args.num_steps
        if (args.eval_every and (step + 1) % args.eval_every == 0) or last:
            history.append({**evaluate_held_out(engine, test_task, eval_indices, args, step + 1, reward_model),
                            "tokens_sampled": tokens_sampled})
            logger.log({f"eval/{k}": v for k, v in history[-1].items() if k != "step"}, step=step + 1)
        if preempted(device):  # SIGTERM/SIGINT: keep this step's work, see common.py
            save(step + 1, finished=False)
            exit_preempted(out)
        if not last and args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1, finished=False)

    rollouts.close()
    save(args.num_steps, finished=True)
    # Its own row of the report card: RL from the reward model (speedrun.sh --rlhf) next to GRPO's.
    append_report(report_record("rlhf" if reward_model is not None else "rl", args, history, len(eval_indices),
                                time.time() - t_start, source_totals, decontaminated, len(train_task)), logger)
    logger.finish()
    compute_cleanup()


PLAN_PROMPT_TOKENS = 256  # a GSM8K prompt, rendered, is at most ~250 tokens: for the budget (plan)


def plan(args, config):
    """
    The preset's budget (common.stage_plan). Rollouts dominate: each sampling round decodes prompts x group_size x
    oversample rows of max_tokens (the batch runs until its longest row ends); dynamic sampling runs rounds until
    every rank holds its groups with contrast, common.expected_sampling_rounds of them from the task's assumed
    starting pass rate (common.ASSUMED_PASS_RATE; one round without the filter or without an assumed rate), plus the
    held-out evaluations; at HARDWARE's assumed decode rate. The learner: every kept row at prompt + max_tokens
    positions, 6N FLOPs per token plus the chunked logits' second lm_head forward, a no-grad old-log-prob pass (2N)
    only when --epochs or --minibatches > 1 (skipped otherwise), a reference pass (2N) with --kl-coef. Memory: the
    larger of the learner at the largest micro-batch that fits (gradients summed in place, no DDP buckets) and the
    rollout (weights, optimizer state, this rank's KV cache of a round, bf16), which never coexist: the engine's
    cache is freed when generate returns; both plus the reference, reward model and critic the flags load
    (common.rl_models_bytes). With --lora-rank the learner keeps gradients and AdamW state of the adapters only.
    """
    hw = HARDWARE[args.preset]
    flops = model_size(config)[1]
    positions = PLAN_PROMPT_TOKENS + args.max_tokens
    rows = args.prompts_per_step * args.group_size * args.oversample  # per sampling round, all ranks
    pass_rate = ASSUMED_PASS_RATE.get(args.task, {}).get(args.preset)
    filtered = args.filter_zero_contrast and args.reward == "verifier" and pass_rate is not None
    rounds = expected_sampling_rounds(pass_rate, args.group_size, math.ceil(args.prompts_per_step / hw["gpus"]),
                                      args.oversample, hw["gpus"], args.max_sampling_rounds) if filtered else 1.0
    evals = (args.num_steps // args.eval_every if args.eval_every else 1) + 1  # the start, periodic, the end
    decode = (args.num_steps * rounds * rows * args.max_tokens
              + evals * args.eval_problems * args.eval_samples * args.max_tokens)
    passes = args.epochs * (flops + 2 * config.n_embd * config.vocab_size)
    passes += (flops / 3 if args.epochs > 1 or args.minibatches > 1 else 0) + (flops / 3 if args.kl_coef > 0 else 0)
    tokens = args.num_steps * args.prompts_per_step * args.group_size * positions
    trainable = trainable_params(config, args)  # with --lora-rank: the adapters' gradients and AdamW state only
    # With LoRA the reference is the policy with its adapters off: no second copy.
    extra = sum(rl_models_bytes(config, reference=args.kl_coef > 0 and trainable is None,
                                reward_model=args.reward == "rm", critic=False).values())
    rollout = inference_memory(config, math.ceil(rows / hw["gpus"]), positions, math.ceil(rows / hw["gpus"]),
                               optimizer=True) + extra
    micro = fit_batch_tokens("rl", config, hw["memory"], args.device_batch_tokens, positions, LOGITS_CHUNK_TOKENS,
                             extra, ddp=False, trainable=trainable)
    why = f"pass@1 {pass_rate:.0%} assumed, slowest of {hw['gpus']} rank(s)" if filtered else "no contrast filter"
    return dict(stage_plan("rl", args.preset, config, micro, LOGITS_CHUNK_TOKENS, tokens, passes, decode_tokens=decode,
                           extra_bytes=extra, ddp=False, phase_bytes=rollout, trainable=trainable,
                           note=f"{rounds:.2f} sampling rounds per step ({why}), --oversample {args.oversample:g}"),
                sampling_rounds=rounds)


if __name__ == "__main__":
    run_cli(main, preemptible=True)
