"""
PPO with a critic for language models (Schulman et al. 2017; Ziegler et al. 2019; Stiennon et al. 2020; Ouyang et al.
2022): the rollouts of rl.py, but advantages from a learned value function instead of the group's other answers.

    python ppo.py --preset tiny --ckpt CK/sft --out CK/ppo                          # CPU, synthetic arithmetic
    python ppo.py --preset tiny --ckpt CK/sft --out CK/ppo --reward rm --rm-ckpt CK/rm   # the RLHF recipe, reward model
    torchrun --nproc_per_node=8 ppo.py --preset full --ckpt CK/sft --out CK/ppo

Each step, on every rank:
    1. rollout   rl.py's (rl_systems.Rollouts: prompts, G completions of each, the verifier's or the reward model's
                 score)
    2. rewards   token_rewards: the KL to the reference on every token (--kl-placement reward, the default: the
                 penalty is part of the reward), the completion's score on its last token
    3. advantage the critic (a copy of the policy's trunk with a zero-started scalar head, its own optimizers; with
                 --reward rm a copy of the reward model, as InstructGPT initialises its value function, Ouyang et al.
                 2022, sec. 3.5) gives V(s_t) at every token; gae turns rewards and values into advantages and
                 returns, whitened over the batch of every rank
    4. update    policy_loss on the advantages, value_loss on the returns, each with its own optimizer step
    5. evaluation and checkpoints as rl.py's; the critic and its optimizers are saved with the policy

Dynamic sampling stays on with the verifier (a group whose answers agree has no contrast; with a critic it would
still teach, A = R - V is not 0, but the flag is rl.py's and keeps its meaning here).
"""

import argparse
import math
import time
from collections import Counter
from pathlib import Path

import torch

from common import (FINISHED, Logger, add_stage_flags, append_report, autocast_ctx, batch_tokens_for_device,
                    check_ranks_agree, checkpoint_dir, compute_cleanup, compute_init, exit_preempted, kv_cache_bytes,
                    load_checkpoint, load_optimizers, preempted, print0, resume_or_finish, run_cli, save_checkpoint,
                    set_lr, synchronize)
from engine import Engine, load_model
from model import EMBEDDING_LR, LOGITS_CHUNK_TOKENS, MATRIX_LR, UNEMBEDDING_LR, ScalarHeadModel
from objectives import aggregate, kl_penalty, policy_loss, whiten
from rollout import (PRESETS, account_sources, add_flags, add_loss_stats, all_reduce_gradients, batch_counts,
                     check_numeric_flags, evaluate_held_out, finish_args, global_moments, group_rewards,
                     learner_batches, learner_tally, load_reward_model, prepare_prompts, print_step, reduce_tally,
                     reference_sampling, report_record, reward_judge, row_sampling, score_old, step_metrics,
                     token_logprobs)
from rl_systems import Rollouts, difficulty_prompts

# -----------------------------------------------------------------------------
# The math: per-token rewards, GAE, the clipped value loss


def token_rewards(scores, kl, mask, kl_coef):
    """
    Per-token rewards (B, T) of PPO for language models (Ziegler et al. 2019; Stiennon et al. 2020; OpenRLHF's
    compute_reward): the KL penalty on every valid token, the sequence's score on its last valid token,

        r_t = -kl_coef * kl_t                  for every t with mask_t = 1
        r_T = -kl_coef * kl_T + score          T = the last t with mask_t = 1 (the answer's <|assistant_end|>)

    scores (B,); kl (B, T) a per-token KL estimate, e.g. k1 = old_logp - ref_logp (detached: the penalty is part of
    the reward, not a loss); mask (B, T). A row with no valid token gets no reward.
    """
    mask = mask.float()
    rewards = -kl_coef * kl * mask  # (B, T)
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    last = (mask * positions).argmax(-1)  # (B,) index of the last valid token (0 for an empty row)
    rewards[torch.arange(mask.size(0), device=mask.device), last] += scores * (mask.sum(-1) > 0)
    return rewards


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """
    Generalized advantage estimation (Schulman et al. 2016, eqs. 11-16), backwards over each row's valid tokens:

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t),     A_t = delta_t + gamma lam A_{t+1},     R_t = A_t + V(s_t)

    rewards, values, mask: (B, T); values[:, t] = V(s_t), the critic's estimate before token t is chosen. s_{t+1} is
    the state of the next *valid* token: positions with mask 0 (prompt, forced tool output, padding) are not actions,
    so they are skipped and the value is bootstrapped across them; after a row's last valid token V = 0 (the episode
    ends). Rewards at mask-0 positions are ignored. gamma = lam = 1 with V = 0 gives A_t = the reward-to-go.
    Returns (advantages, returns), (B, T), 0 where mask is 0.
    """
    valid = mask > 0
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    next_value = torch.zeros(rewards.size(0), device=rewards.device)  # V(s_{t+1}) of the next valid token
    next_advantage = torch.zeros_like(next_value)  # A_{t+1}
    for t in reversed(range(rewards.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
        next_value = torch.where(valid[:, t], values[:, t].float(), next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
    returns = (advantages + values) * valid
    return advantages, returns


def value_loss(values, old_values, returns, mask, clip_eps=0.2, count=None):
    """
    PPO's clipped value loss (OpenAI baselines ppo2; OpenRLHF's ValueLoss), per token:

        V_clip = V_old + clip(V - V_old, -clip_eps, clip_eps),     l_t = 0.5 max((V_clip - R_t)^2, (V - R_t)^2)

    so a value step cannot profit from moving V further than clip_eps from where the rollout's critic had it.
    values (B, T) with gradient; old_values, returns (B, T) detached. Token-mean over mask (N_tokens = `count`
    when the batch is split into micro-batches, as in aggregate). Returns (loss, fraction of valid tokens whose
    clipped term is the larger one, i.e. the token gets no gradient).
    """
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    unclipped_sq, clipped_sq = (values - returns).square(), (clipped - returns).square()
    loss = aggregate(0.5 * torch.maximum(unclipped_sq, clipped_sq), mask, "token-mean", count=count)
    valid = mask > 0
    clip_frac = float(((clipped_sq > unclipped_sq) & valid).sum()) / max(int(valid.sum()), 1)
    return loss, clip_frac


def explained_variance(pairs, device):
    """
    1 - Var[R - V] / Var[R] over the valid tokens of every rank (global_moments), from (values, returns, mask) of
    each micro-batch: 1 is a perfect critic, 0 one no better than a constant. Undefined (NaN) when the returns do
    not vary (their variance below 1e-8, or fewer than 2 tokens): any critic would divide by ~0 there.
    """
    pairs = list(pairs)
    n, _, var_returns = global_moments([(r, m) for _, r, m in pairs], device)
    _, _, var_error = global_moments([(r - v, m) for v, r, m in pairs], device)
    if n < 2 or var_returns < 1e-8:
        return float("nan")
    return 1 - var_error / var_returns


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run = add_stage_flags(parser, PRESETS, preset="fills the defaults below; explicit flags win",
                          seed="seeds prompt draws and sampling", run="wandb run name ('dummy': no wandb)",
                          ckpt="input checkpoint folder (default: $NANOPOST_HOME/checkpoints/sft)",
                          out="output checkpoint folder (default: $NANOPOST_HOME/checkpoints/ppo)",
                          resume="continue from the latest checkpoint in --out; exit if it is finished")
    add = parser.add_argument_group("PPO: the critic, GAE, where the KL goes").add_argument
    add_flags(parser, run)
    add("--kl-placement", choices=["loss", "reward"], default="reward",
        help="reward: -kl_coef * (logp - ref_logp) on every token's reward (PPO-RLHF, token_rewards); loss: "
             "kl_coef * KL(--kl-kind) added to the policy loss, as GRPO does")
    add("--gamma", type=float, default=1.0, help="discount of GAE")
    add("--lam", type=float, default=0.95, help="lambda of GAE")
    add("--value-clip", type=float, default=0.2, help="the critic's clip range eps_v (see value_loss)")
    add("--critic-lr-frac", type=float, default=None,
        help="the critic's learning rates as a fraction of pretraining's (default: 2x --lr-frac)")
    add("--critic-head-lr-mult", type=float, default=1.0,
        help="the critic's scalar head's learning rate as a multiple of its lm_head-scaled rate (rm.py's reward "
             "head uses 10: a zero-started head has further to travel than the trunk)")
    add("--critic-warmup-steps", type=int, default=0,
        help="the first N steps train the critic only (the policy waits), so the first policy update's advantages "
             "come from a critic that has fitted the policy's returns")
    args = finish_args(parser, parser.parse_args(argv))
    if args.critic_lr_frac is None:
        args.critic_lr_frac = 2 * args.lr_frac
    check_numeric_flags(parser, args, {"gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
                                       "lam": (lambda v: 0 <= v <= 1, "in [0, 1]"),
                                       "value_clip": (lambda v: v > 0, "> 0"),
                                       "critic_lr_frac": (lambda v: v > 0, "> 0"),
                                       "critic_head_lr_mult": (lambda v: v > 0, "> 0"),
                                       "critic_warmup_steps": (lambda v: v >= 0, ">= 0 (0: none)")})
    return args


def main(argv=None):
    args = parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device, seed=args.seed)
    if args.prompts_per_step % world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world_size} ranks")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    truncated = args.top_k is not None or args.top_p is not None  # the KL then needs its own untruncated scoring
    ckpt = Path(args.ckpt) if args.ckpt else checkpoint_dir("sft")
    out = Path(args.out) if args.out else checkpoint_dir("ppo")

    # Models: the policy, the frozen reference and reward models, the critic (the policy's trunk with a zero head, or
    # a trainable copy of the reward model; on resume its weights come from the checkpoint's extra state).
    resume = resume_or_finish(out, args.resume, "ppo")
    if resume is FINISHED:
        return
    model, tokenizer, meta = load_model(resume or ckpt, device)
    ref_model = None
    if args.kl_coef > 0:
        ref_model, _, _ = load_model(ckpt, device)
        ref_model.requires_grad_(False)
    reward_model = load_reward_model(args, tokenizer, device)
    if reward_model is not None:
        critic = load_model(args.rm_ckpt, device)[0].train()
    else:
        critic = ScalarHeadModel(load_model(out if resume else ckpt, device)[0]).to(device).train()
    engine = Engine(model, tokenizer)
    pad_id = tokenizer.token_id("<|assistant_end|>")  # any id: padded positions have target -1
    print0(f"model: {model.num_params():,} parameters from {out if resume else ckpt} on {device}, {world_size} rank(s)")

    train_task, test_task, eval_indices, decontaminated = prepare_prompts(args, world_size, reward_judge(args))
    optimizers = model.setup_optimizers(matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
                                        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    f = args.critic_lr_frac
    critic_optimizers = critic.setup_optimizers(matrix_lr=MATRIX_LR * f, embedding_lr=EMBEDDING_LR * f,
                                                unembedding_lr=UNEMBEDDING_LR * f,
                                                head_lr_mult=args.critic_head_lr_mult)
    longest_prompt = max(len(tokenizer.render_for_completion(train_task[i])) for i in range(min(64, len(train_task))))
    print0(f"plan: {args.num_steps} steps of {args.prompts_per_step} x {args.group_size} completions of <= "
           f"{args.max_tokens} tokens, {args.epochs} epoch(s) x {args.minibatches} minibatch(es); loss {args.loss} "
           f"({args.loss_agg}), GAE gamma {args.gamma} lambda {args.lam}, value clip {args.value_clip}, KL "
           f"{args.kl_coef} ({args.kl_placement}), mismatch {args.mismatch}; reward {args.reward}")
    held = kv_cache_bytes(model.config, math.ceil(args.prompts_per_step // world_size * args.oversample)
                          * args.group_size, longest_prompt + args.max_tokens)
    held += 4 * model.num_params() if ref_model is not None else 0
    args.device_batch_tokens = batch_tokens_for_device("rl", None if args.fit_batch else args.device_batch_tokens,
                                                       device, model.config, args.device_batch_tokens,
                                                       longest_prompt + args.max_tokens, LOGITS_CHUNK_TOKENS, held)
    if args.dry_run:
        print0("dry run: model, critic, optimizers and data are built; stopping before the first rollout")
        compute_cleanup()
        return
    train_task = difficulty_prompts(args, engine, train_task, ckpt, resume, sampling)
    start_step, history, source_totals, extra = 0, [], Counter(), {}
    if resume:
        _, _, extra = load_checkpoint(resume, device=device)
        load_optimizers(optimizers, extra["optimizers"])
        critic.load_state_dict(extra["critic"])
        load_optimizers(critic_optimizers, extra["critic_optimizers"])
        start_step, history = extra["step"], extra["history"]
        source_totals.update(extra["source_totals"])
        print0(f"resuming at step {start_step}")
    logger = Logger(args.run, vars(args), series=extra.get("curves"))  # on --resume, the curves so far
    if start_step == 0:
        history.append(evaluate_held_out(engine, test_task, eval_indices, args, 0, reward_model))
        logger.log({f"eval/{k}": v for k, v in history[-1].items() if k != "step"}, step=0)
    rollouts = Rollouts(args, engine, train_task, out if resume else ckpt, start_step, reward_model,
                        state=extra)

    def save(step, finished):
        if finished:
            check_ranks_agree(model, f"ppo step {step}")
            check_ranks_agree(critic, f"ppo critic step {step}")
        if rank != 0:
            return
        state = {"optimizers": [o.state_dict() for o in optimizers], "step": step, "history": history,
                 "source_totals": dict(source_totals), "critic": critic.state_dict(),
                 "critic_optimizers": [o.state_dict() for o in critic_optimizers], "curves": logger.series}
        state.update(rollouts.state_dict())  # PTGS counts, the --async worker's pending weights
        save_checkpoint(out, step, model, {"stage": "ppo", "source": str(ckpt), "args": vars(args),
                                           "finished": finished, "eval": history[-1] if history else None},
                        tokenizer=tokenizer, extra=state)

    t_start, explained_by_step = time.time(), {}  # the critic's explained variance, reported first vs. last
    for step in range(start_step, args.num_steps):
        synchronize(device)
        t0 = time.time()
        groups, rollout_tally, info = rollouts.next_groups(step)
        synchronize(device)
        t1 = time.time()
        rewards, _ = group_rewards(groups)  # rows carry their raw rewards
        minibatches, positions = learner_batches(groups, rewards.tolist(), args, pad_id, device)

        # Score the batch with the weights that sampled it (old log-probs, reference log-probs, the critic's
        # values), then per-token rewards -> GAE; advantages whitened over the whole batch of every rank, as PPO does.
        tally = learner_tally(rollout_tally, groups, positions)
        with torch.no_grad():
            for micro in (micro for mb in minibatches for micro in mb):
                score_old(micro, *token_logprobs(model, micro["inputs"], micro["targets"],
                                                 row_sampling(sampling, micro)), tally, args)
                if ref_model is not None:
                    micro["ref_logp"], _ = token_logprobs(ref_model, micro["inputs"], micro["targets"],
                                                          reference_sampling(row_sampling(sampling, micro)))
                mask = micro["mask"]
                with autocast_ctx(device):
                    micro["old_values"] = critic(micro["inputs"])  # (B, T): V(s_t) before target t
                kl = torch.zeros_like(mask)
                if ref_model is not None and args.kl_placement == "reward":
                    kl_logp = micro["old_logp"] if not truncated else token_logprobs(
                        model, micro["inputs"], micro["targets"], reference_sampling(row_sampling(sampling, micro)))[0]
                    kl = kl_penalty(kl_logp, micro["ref_logp"], "k1")
                    tally["kl_sum"] += float((kl * mask).sum())
                rewards = token_rewards(micro["advantages"], kl, mask, args.kl_coef)
                micro["advantages"], micro["returns"] = gae(rewards, micro["old_values"], mask, args.gamma, args.lam)
        micros = [micro for mb in minibatches for micro in mb]  # none on a rank that kept no group
        explained = explained_variance(((m["old_values"], m["returns"], m["mask"]) for m in micros), device)
        explained_by_step[step + 1] = explained
        moments = global_moments(((m["advantages"], m["mask"]) for m in micros), device)
        for m in micros:
            m["advantages"] = whiten(m["advantages"], m["mask"], moments)
        account_sources(tally, micros)  # the loss share of each source, from the advantages trained on
        counts, value_counts = batch_counts(minibatches, args.loss_agg, device)

        # The update: --epochs passes, one policy and one critic optimizer step per minibatch (the critic's only
        # during --critic-warmup-steps).
        nets = [(critic, critic_optimizers)] if step < args.critic_warmup_steps else [(model, optimizers),
                                                                                      (critic, critic_optimizers)]
        lr_multiplier = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
        set_lr(optimizers, lr_multiplier)
        optimizer_steps, grad_norms = 0, []
        for epoch in range(args.epochs):
            for minibatch, count, value_count in zip(minibatches, counts, value_counts):
                if count == 0:  # nothing to learn from on any rank (every group filtered or masked)
                    continue
                for micro in minibatch:
                    num_tokens = float(micro["mask"].sum())
                    with autocast_ctx(device):
                        values = critic(micro["inputs"])  # (B, T)
                    v_loss, v_clip = value_loss(values, micro["old_values"], micro["returns"], micro["mask"],
                                                args.value_clip, count=value_count)
                    v_loss.backward()
                    tally["value_loss_sum"] += v_loss.item()
                    tally["value_clip_sum"] += v_clip * num_tokens
                    if len(nets) == 1:  # critic warm-up
                        continue
                    logp, _ = token_logprobs(model, micro["inputs"], micro["targets"], row_sampling(sampling, micro))
                    loss, stats = policy_loss(logp, micro["old_logp"], micro["advantages"], micro["mask"],
                                              kind=args.loss, eps_low=args.eps_low, eps_high=args.eps_high,
                                              agg=args.loss_agg, dual_clip=args.dual_clip, weights=micro["weights"],
                                              max_len=args.max_tokens, count=count)
                    if ref_model is not None and args.kl_placement == "loss":
                        kl_logp = logp if not truncated else token_logprobs(
                            model, micro["inputs"], micro["targets"],
                            reference_sampling(row_sampling(sampling, micro)))[0]
                        kl = kl_penalty(kl_logp, micro["ref_logp"], args.kl_kind)  # (B, T)
                        loss = loss + args.kl_coef * aggregate(kl, micro["mask"], args.loss_agg,
                                                               max_len=args.max_tokens, count=count)
                        tally["kl_sum"] += float((kl.detach() * micro["mask"]).sum())
                    loss.backward()
                    add_loss_stats(tally, loss, stats, num_tokens)
                for net, opts in nets:
                    if ddp:
                        all_reduce_gradients(net)
                    if args.max_grad_norm > 0:
                        norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm))
                        grad_norms += [norm] if net is model else []
                    for optimizer in opts:
                        optimizer.step()
                    net.zero_grad(set_to_none=True)
                optimizer_steps += 1
        synchronize(device)
        t2 = time.time()
        rollouts.after_update(step)

        tally = reduce_tally(tally, device)
        metrics = step_metrics(tally, optimizer_steps, grad_norms, (t1 - t0, t2 - t1), info, train_task.tasks,
                               source_totals)
        loss_tokens = tally["loss_tokens"] or math.nan  # NaN: no token trained (rollout.step_metrics)
        if ref_model is not None:
            per = loss_tokens if args.kl_placement == "loss" else tally["trained_tokens"] or math.nan
            metrics["policy/kl"] = tally["kl_sum"] / per
        extra_line = ""
        if reward_model is not None:
            metrics["reward/rm_score"] = tally["rm_score_sum"] / max(tally["completions"], 1)  # before normalising
            extra_line = f"| rm score {metrics['reward/rm_score']:+.3f} verifier acc {metrics['reward/accuracy']:.3f} "
        metrics.update({"critic/value_loss": tally["value_loss_sum"] / max(optimizer_steps, 1),
                        "critic/clip_frac": tally["value_clip_sum"] / loss_tokens,
                        "critic/explained_variance": explained})
        extra_line += (f"| value loss {metrics['critic/value_loss']:.4f} "
                       f"expl var {'n/a' if math.isnan(explained) else f'{explained:+.2f}'} ")
        logger.log(metrics, step=step + 1)
        eta = (time.time() - t_start) / (step + 1 - start_step) * (args.num_steps - step - 1)
        print_step(step, args.num_steps, metrics, extra_line, (t1 - t0, t2 - t1), eta)

        last = step + 1 == args.num_steps
        if (args.eval_every and (step + 1) % args.eval_every == 0) or last:
            history.append(evaluate_held_out(engine, test_task, eval_indices, args, step + 1, reward_model))
            logger.log({f"eval/{k}": v for k, v in history[-1].items() if k != "step"}, step=step + 1)
        if preempted(device):  # SIGTERM/SIGINT: keep this step's work, see common.py
            save(step + 1, finished=False)
            exit_preempted(out)
        if not last and args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1, finished=False)

    rollouts.close()
    print0("critic explained variance by step (before each update; n/a: constant returns): "
           + " ".join(f"{k}:{v:+.2f}" for k, v in explained_by_step.items()))
    save(args.num_steps, finished=True)
    # PPO from a reward model is the RLHF recipe: its row is rlhf's, as rl.py --reward rm's is.
    append_report(report_record("rlhf" if reward_model is not None else "ppo", args, history, len(eval_indices),
                                time.time() - t_start, source_totals, decontaminated, len(train_task)), logger)
    logger.finish()
    compute_cleanup()


if __name__ == "__main__":
    run_cli(main, preemptible=True)
