"""
The reward model: the SFT model's trunk with a scalar head, trained on preference pairs with the Bradley–Terry loss.
It scores answers no verifier can check; rl.py --reward rm optimises a policy against it.

    python rm.py --preset tiny                        # CPU, minutes: SFT answers to synthetic problems, verifier-labelled
    torchrun --nproc_per_node=8 rm.py --preset full   # UltraFeedback-binarized preference pairs

The score r(x, y) is the head w . h + b read at the answer's last token, <|assistant_end|>: the one position whose
hidden state has seen the prompt and the whole answer (model.ScalarHeadModel, the same head as PPO's critic).
Bradley–Terry (1952) models a preference as P(y_w > y_l | x) = sigma(r(x, y_w) - r(x, y_l)); its negative
log-likelihood is the loss (InstructGPT, Ouyang et al. 2022, eq. 1), plus TRL's centring term (reward_model_loss).

Data. tiny: the SFT model samples --samples answers to each synthetic problem, the task's verifier labels them, and
one correct answer is paired with one incorrect answer of the same prompt (rollout.self_generated_pairs, as dpo.py's
on-policy pairs): the reward model learns to tell right from wrong on the very answers RL will ask it to score.
full: UltraFeedback-binarized (chosen = highest-rated answer, rejected = a lower-rated one). --pairs synthetic uses
the static synthetic pairs (reference answer vs. one scripted mistake) instead.

Logged on held-out pairs: pair accuracy (r_w > r_l, a tie counted half), mean margin r_w - r_l, mean score
(r_w + r_l) / 2 (the centring term keeps it near 0). The checkpoint's meta has reward_model: true, so
engine.load_model rebuilds a ScalarHeadModel.
"""

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import common
from common import autocast_ctx, compute_cleanup, compute_init, format_eta, print0
from engine import Engine, load_model
from judge import JudgedTask, add_judge_flags, judge_from_args
from model import EMBEDDING_LR, MATRIX_LR, UNEMBEDDING_LR, ScalarHeadModel
from rollout import preference_pairs
from tasks import decontamination_index, pad_sequences, registered_tasks, task_by_name

PRESETS = {
    # tiny: 512 synthetic problems x 4 SFT samples -> a few hundred verifier-labelled pairs; 3 epochs of 32-pair steps.
    "tiny": dict(pairs="self-generated", task="synthetic", train_pairs=512, eval_pairs=192, samples=4,
                 max_new_tokens=48, lr_frac=0.1, head_lr_mult=10.0, batch_size=32, device_batch_size=32, epochs=3,
                 eval_every=20, decontaminate=False),
    # full: one epoch of UltraFeedback-binarized train_prefs (61k pairs).
    "full": dict(pairs="ultrafeedback", task="gsm8k", train_pairs=None, eval_pairs=1000, samples=8,
                 max_new_tokens=512, lr_frac=0.02, head_lr_mult=10.0, batch_size=128, device_batch_size=8, epochs=1,
                 eval_every=100, decontaminate=True),
}


def reward_model_loss(chosen, rejected, center_coef=1e-2):
    """
    Per-pair reward-model losses (B,) from the scores of the chosen and rejected answers, (B,) each:

        l = -log sigma(r_chosen - r_rejected) + center_coef * (r_chosen + r_rejected)^2

    The first term is the Bradley–Terry negative log-likelihood; it depends on the difference only, so the scores
    are free to drift as a whole and a score means nothing across batches. The second term (TRL's
    center_rewards_coefficient, from Eisenstein et al. 2023, "Helping or herding?") pins their sum near 0.
    Swapping a pair raises its loss by exactly its margin: softplus(m) - softplus(-m) = m.
    """
    return -F.logsigmoid(chosen - rejected) + center_coef * (chosen + rejected).square()


def pair_scores(model, pairs, pad_id, device):
    """
    (chosen, rejected) scores, (B,) each, of B pairs ((chosen_ids, mask), (rejected_ids, mask)): the head read at
    each side's last token. `model` is a ScalarHeadModel, or its DDP wrapper (whose forward runs the gradient hooks).
    """
    ids, lengths = pad_sequences([chosen for (chosen, _), _ in pairs] + [rejected for _, (rejected, _) in pairs],
                                 pad_id)
    with autocast_ctx(device):
        scores = model(ids.to(device))  # (2B, T)
    scores = scores.gather(1, (lengths.to(device) - 1)[:, None]).squeeze(1)  # (2B,)
    return scores[:len(pairs)], scores[len(pairs):]


def pair_accuracy_sum(chosen, rejected):
    """Pairs ranked right, a tie counted as half (a coin flip would break it): the zero head scores 50%, not 0%."""
    return (chosen > rejected).sum() + 0.5 * (chosen == rejected).sum()


@torch.no_grad()
def evaluate_pairs(model, pairs, batch_size, center_coef, pad_id, device):
    """Held-out loss, pair accuracy (ties half), mean margin and mean score over every rank's pairs."""
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, correct, margin, score, pairs
    for i in range(0, len(pairs), batch_size):
        chosen, rejected = pair_scores(model, pairs[i:i + batch_size], pad_id, device)
        sums += torch.stack([reward_model_loss(chosen, rejected, center_coef).sum(),
                             pair_accuracy_sum(chosen, rejected), (chosen - rejected).sum(),
                             ((chosen + rejected) / 2).sum(), torch.tensor(float(len(chosen)), device=device)]).double()
    if dist.is_initialized():
        dist.all_reduce(sums)
    n = max(float(sums[4]), 1.0)
    return {"loss": float(sums[0]) / n, "accuracy": float(sums[1]) / n, "margin": float(sums[2]) / n,
            "score": float(sums[3]) / n}


def build_pairs(args, model, tokenizer, split, max_seq_len, judge=None):
    """
    This rank's pairs of `split` (rollout.preference_pairs; training pairs decontaminated with --decontaminate, the
    rule of every stage: tasks.decontamination_index), counts over all ranks, and the fewest pairs of a rank.
    Self-generated held-out pairs are sampled with seed + 1, so they are not the training pairs' samples;
    with a judge (judge.JudgeVerifier) they are labelled by it instead of --task's verifier.
    """
    size = args.train_pairs if split == "train" else args.eval_pairs
    index = decontamination_index(args.preset) if args.decontaminate and split == "train" else None
    task = engine = None
    if args.pairs == "self-generated":
        task = task_by_name(args.task, split, size, args.seed)
        engine = Engine(model.gpt, tokenizer)
        task = JudgedTask(task, judge) if judge else task
    pairs, counts, shares = preference_pairs(args.pairs, split, size, tokenizer, max_seq_len, engine=engine, task=task,
                                             samples=args.samples, max_new_tokens=args.max_new_tokens,
                                             temperature=1.0, seed=args.seed + (task is not None and split == "test"),
                                             index=index)
    return pairs, counts, min(n for n, _ in shares)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a Bradley-Terry reward model on the SFT model's trunk.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add = parser.add_argument
    common.add_stage_flags(parser, PRESETS, preset="defaults for the flags below; explicit flags win",
                           seed="data order and sampling seed",
                           ckpt="SFT checkpoint whose trunk starts the reward model (default: checkpoints/sft)",
                           out="output folder (default: $NANOPOST_HOME/checkpoints/rm)",
                           resume="continue from the latest checkpoint in --out (exit at once if it is finished)")
    add("--pairs", choices=["self-generated", "synthetic", "ultrafeedback"],
        help="self-generated: SFT samples labelled by --task's verifier; synthetic: reference vs. scripted mistake; "
             "ultrafeedback: UltraFeedback-binarized")
    add("--task", choices=registered_tasks("generative"), help="verifiable task of --pairs self-generated")
    add("--train-pairs", type=int, help="problems (self-generated) or pairs (static sources) to train on")
    add("--eval-pairs", type=int, help="held-out problems or pairs")
    add("--samples", type=int, help="answers sampled per problem for self-generated pairs")
    add("--max-new-tokens", type=int, help="longest sampled answer (self-generated pairs)")
    add("--max-seq-len", type=int, default=None, help="longest pair side in tokens (default: the model's context)")
    add("--center-coef", type=float, default=1e-2,
        help="weight c of the centring term c (r_chosen + r_rejected)^2 (TRL's default 1e-2; 0 turns it off)")
    add("--lr-frac", type=float, help="trunk learning rates as a fraction of pretraining's (Muon + AdamW)")
    add("--head-lr-mult", type=float,
        help="the scalar head's learning rate as a multiple of the (scaled) lm_head rate: it starts at zero and "
             "has to travel further than the trunk")
    add("--batch-size", type=int, help="pairs per optimizer step, all ranks")
    add("--device-batch-size", type=int, help="pairs per forward/backward on each rank")
    add("--epochs", type=int, help="passes over the training pairs")
    add("--eval-every", type=int, help="held-out evaluation every N steps (and before and after)")
    add("--decontaminate", action=argparse.BooleanOptionalAction, default=None,
        help="drop training pairs that overlap an evaluation set in use (tasks.NgramIndex, the rule of every stage); "
             "default on for full, off for tiny (the synthetic family is split by question hash)")
    add_judge_flags(parser)
    add("--dry-run", action="store_true", help="build model, pairs and optimizers, print the plan and stop")
    args = parser.parse_args(argv)
    common.fill_preset(args, PRESETS[args.preset])
    common.check_numbers(args, positive=["train_pairs", "eval_pairs", "samples", "max_new_tokens", "max_seq_len",
                                         "batch_size", "device_batch_size", "epochs", "eval_every"],
                         nonnegative=["center_coef", "lr_frac", "head_lr_mult"])
    judge = judge_from_args(args, args.pairs == "self-generated", "use it with --pairs self-generated")

    stage_start = time.time()
    ddp, rank, local_rank, world_size, device = compute_init(args.device, args.seed)
    out_dir = args.out or common.checkpoint_dir("rm")
    resume = common.resume_or_finish(out_dir, args.resume, "rm")  # the step folder to continue from, or None
    if resume is common.FINISHED:
        return
    gpt, tokenizer, sft_meta = load_model(args.ckpt or common.checkpoint_dir("sft"), device)
    model = ScalarHeadModel(gpt).to(device)
    max_seq_len = args.max_seq_len or gpt.config.sequence_len
    pad_id = tokenizer.bos_id  # any id: padding comes after each row's last token, which causal attention never sees
    print0(f"reward model: {model.num_params():,} parameters (SFT trunk + scalar head); pairs: {args.pairs}; "
           f"centring coefficient {args.center_coef}")

    t0 = time.time()
    train_pairs, train_counts, min_pairs = build_pairs(args, model, tokenizer, "train", max_seq_len, judge)
    eval_pairs, eval_counts, _ = build_pairs(args, model, tokenizer, "test", max_seq_len, judge)
    print0(f"pairs ({time.time() - t0:.0f}s): train {dict(train_counts)} | held-out {dict(eval_counts)}")
    if args.batch_size % (args.device_batch_size * world_size):
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of --device-batch-size "
                         f"{args.device_batch_size} x {world_size} ranks")
    pairs_per_rank = args.batch_size // world_size
    num_steps = args.epochs * min_pairs // pairs_per_rank  # every rank takes the same number of steps
    if num_steps < 1:
        raise ValueError(f"{min_pairs} training pairs per rank are fewer than one step's {pairs_per_rank}; "
                         "use more data (--train-pairs, --samples) or a smaller --batch-size")

    optimizers = model.setup_optimizers(matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
                                        unembedding_lr=UNEMBEDDING_LR * args.lr_frac, head_lr_mult=args.head_lr_mult)
    head_group = optimizers[0].param_groups[-1]  # ScalarHeadModel.setup_optimizers appends the head last
    print0(f"plan: {num_steps} steps of {args.batch_size} pairs over {min_pairs * world_size} pairs "
           f"({args.epochs} epoch(s)), lr-frac {args.lr_frac}, head lr {head_group['lr']:.2e}, linear decay to 0")
    if args.dry_run:
        print0("dry run: model, pairs and optimizers are built; stopping before training")
        compute_cleanup()
        return

    evaluate = partial(evaluate_pairs, model, eval_pairs, args.device_batch_size, args.center_coef, pad_id, device)
    start_step, logger = 0, common.Logger(args.run, vars(args))
    if resume:  # the pairs above are rebuilt as before (seeded); the weights, optimizers and curves come back
        state, _, extra = common.load_checkpoint(resume, device=device)
        model.load_state_dict(state)
        common.load_optimizers(optimizers, extra["optimizers"])
        start_step, history = extra["step"], extra["history"]
        logger.series.update(extra["curves"])
        print0(f"resuming from step {start_step}")
    else:
        history = [{"step": 0, **evaluate()}]
        print0(f"step 0: held-out accuracy {history[0]['accuracy']:.1%} (the zero head ties every pair: 50%)")
        logger.log({f"val/{k}": v for k, v in history[0].items() if k != "step"}, 0)
    learner = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None) if ddp \
        else model
    micro_steps = pairs_per_rank // args.device_batch_size
    order = torch.randperm(len(train_pairs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    t0 = time.time()
    for step in range(start_step, num_steps):
        common.set_lr(optimizers, 1.0 - step / num_steps)
        stats = torch.zeros(2, device=device)  # loss, correct
        for m in range(micro_steps):
            start = step * pairs_per_rank + m * args.device_batch_size
            pairs = [train_pairs[order[(start + i) % len(order)]] for i in range(args.device_batch_size)]
            # DDP all-reduces on the micro-batch that calls backward outside no_sync: the step's last.
            sync = learner.no_sync() if ddp and m < micro_steps - 1 else torch.enable_grad()
            with sync:
                chosen, rejected = pair_scores(learner, pairs, pad_id, device)
                losses = reward_model_loss(chosen, rejected, args.center_coef)
                (losses.mean() / micro_steps).backward()
            stats += torch.stack([losses.detach().sum(), pair_accuracy_sum(chosen, rejected).float()])
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if ddp:
            dist.all_reduce(stats)
        log = {"train/loss": float(stats[0]) / args.batch_size, "train/accuracy": float(stats[1]) / args.batch_size}
        line = f"step {step + 1:4d}/{num_steps} | loss {log['train/loss']:.4f} | acc {log['train/accuracy']:.0%}"
        if (step + 1) % args.eval_every == 0 or step + 1 == num_steps:
            history.append({"step": step + 1, **evaluate()})
            log.update({f"val/{k}": v for k, v in history[-1].items() if k != "step"})
            line += (f" | val loss {log['val/loss']:.4f} acc {log['val/accuracy']:.1%} "
                     f"margin {log['val/margin']:+.3f} score {log['val/score']:+.3f}")
        print0(line + f" | eta {format_eta((time.time() - t0) / (step + 1 - start_step) * (num_steps - step - 1))}")
        logger.log(log, step + 1)
        if common.preempted(device) and step + 1 < num_steps:  # SIGTERM/SIGINT: keep this step's work, see common.py
            if rank == 0:
                common.save_checkpoint(out_dir, step + 1, model, {"stage": "rm", "finished": False},
                                       tokenizer=tokenizer, extra={"step": step + 1, "history": history,
                                                                   "optimizers": [o.state_dict() for o in optimizers],
                                                                   "curves": logger.series})
            common.exit_preempted(out_dir)

    before, after = history[0], history[-1]
    print0(f"held-out pair accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%}, margin "
           f"{after['margin']:+.3f}, mean score {after['score']:+.3f} ({eval_counts['paired']} held-out pairs)")
    logger.finish()
    common.check_ranks_agree(model, "rm")
    if rank == 0:
        meta = {"stage": "rm", "reward_model": True, "finished": True, "preset": args.preset, "args": vars(args),
                "metrics": after, "sft_step": sft_meta.get("step")}
        print0(f"saved {common.save_checkpoint(out_dir, num_steps, model, meta, tokenizer=tokenizer)}")
    common.append_report({"stage": "rm", "preset": args.preset, "pairs": args.pairs, "steps": num_steps,
                          "train_pairs": min_pairs * world_size, "eval_pairs": eval_counts["paired"],
                          "center_coef": args.center_coef, "pair_accuracy": after["accuracy"],
                          "margin": after["margin"], "mean_score": after["score"], "loss": after["loss"],
                          "seconds": time.time() - stage_start}, logger)
    compute_cleanup()


if __name__ == "__main__":
    common.run_cli(main, preemptible=True)
