"""
On-policy distillation: the student samples, the teacher scores the same tokens, the student minimises the per-token
reverse KL to the teacher on its own samples (GKD, Agarwal et al. 2024, on-policy with the reverse KL, the form
Qwen3 and others use after RL to move a teacher's behaviour into a student).

    python distill.py --preset tiny --ckpt CK/sft --teacher CK/rl            # CPU, synthetic arithmetic
    python distill.py --preset tiny --ckpt CK/sft --teacher CK/rl --full-vocab
    torchrun --standalone --nproc_per_node=2 distill.py --preset tiny --ckpt CK/sft --teacher CK/rl

Each step, on every rank (ranks hold different prompts):
    1. sample   the student samples --group-size completions of each of its prompts with the engine
                (rollout.sample_groups: token ids, masks with 0 on forced tool output, behaviour log-probs); the
                verifier's rewards are only logged, nothing is filtered.
    2. score    the teacher scores the same token ids (never re-tokenized text); teacher and student may differ in
                depth and width, not in tokenizer (refused at start).
    3. update   one optimizer step on reverse_kl_loss (each sampled token's student-minus-teacher log-prob is its
                negative advantage in the policy-gradient estimator) or, with --full-vocab, on full_reverse_kl (the
                exact KL of the two next-token distributions at every sampled position). Forced tool-output tokens
                and the prompt are not trained. One update per batch: the samples are exactly on-policy.
    4. every --eval-every steps: the student's held-out pass@1 / pass@k; the teacher's is measured once at the start.
Logged: the per-token KL, the engine/learner log-prob gap, tokens sampled (the budget GRPO is compared at), reward.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import (FINISHED, Logger, add_stage_flags, append_report, autocast_ctx, checkpoint_dir, compute_cleanup,
                    compute_init, exit_preempted, fill_preset, format_eta, load_checkpoint, load_optimizers, preempted,
                    print0, resume_or_finish, run_cli, save_checkpoint)
from engine import Engine, load_model
from eval import evaluate_generative
from model import (EMBEDDING_LR, MATRIX_LR, UNEMBEDDING_LR, add_lora_flags, attach_lora,
                   check_lora_flags, lora_checkpoint)
from rollout import (all_reduce_gradients, collate_rollouts, group_rewards, learner_rows, mix_seed, prepare_prompts,
                     reduce_tally, sample_groups, token_logprobs)
from tasks import token_budget_batches

PRESETS = {  # the RL prompts and budgets of rollout.PRESETS' tiny / full, one step = one batch of samples
    "tiny": dict(task="synthetic", train_size=5000, num_steps=50, prompts_per_step=16, group_size=4, max_tokens=48,
                 device_batch_tokens=8192, lr_frac=0.15, eval_every=25, eval_problems=128, eval_samples=8,
                 save_every=25),
    "full": dict(task="gsm8k", train_size=None, num_steps=200, prompts_per_step=64, group_size=4, max_tokens=512,
                 device_batch_tokens=16384, lr_frac=0.05, eval_every=50, eval_problems=400, eval_samples=8,
                 save_every=50),
}


def reverse_kl_loss(student_logp, teacher_logp, mask, count=None):
    """
    The reverse KL KL(p_s || p_t) of the student p_s to the teacher p_t on tokens y sampled from the student, per
    token (GKD, Agarwal et al. 2024, on-policy, with the reverse KL as divergence). With d_t = log p_s(y_t | y_<t)
    - log p_t(y_t | y_<t), an unbiased estimate of the KL of position t's next-token distributions, the per-token
    negative advantage A_t = -d_t (held fixed) enters the policy-gradient estimator:

        l_t = -sg(A_t) exp(log p_s(y_t) - sg(log p_s(y_t)))      value d_t, gradient d_t grad log p_s(y_t)
        loss = sum_{b,t} m_t l_t / count                          (token-mean; count defaults to sum m)

    In expectation over y_t ~ p_s(. | y_<t) the gradient is that of KL(p_s(. | y_<t) || p_t(. | y_<t)) at the fixed
    prefix (each token's own KL, no credit to earlier tokens: the discount-0 form). A token the student likes more
    than the teacher (d_t > 0) is pushed down, one it likes less is pushed up.
    student_logp (B, T) with gradient, teacher_logp (B, T), mask (B, T). Returns (loss, d) with d (B, T) detached.
    """
    d = (student_logp - teacher_logp).detach()
    mask = mask.float()
    token_loss = d * (student_logp - student_logp.detach()).exp()
    return (token_loss * mask).sum() / max(float(mask.sum()) if count is None else count, 1.0), d


def full_reverse_kl(student_logits, teacher_logits, temperature=1.0):
    """
    The exact reverse KL of the next-token distributions at each position (GKD's full-distribution form):

        KL_t = sum_v p_s(v) (log p_s(v) - log p_t(v)),   p = softmax(logits / temperature)

    student_logits (N, V) with gradient, teacher_logits (N, V). Returns (N,); its gradient is the exact one at each
    fixed prefix, with no sampling noise over the next token.
    """
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float().detach() / temperature, dim=-1)
    return (student.exp() * (student - teacher)).sum(-1)


def same_tokenizer(a, b):
    """True when the two tokenizers map every text and special token to the same ids."""
    return a.mergeable_ranks == b.mergeable_ranks and a.pattern == b.pattern and a.special_tokens == b.special_tokens


def distill_loss(model, teacher, micro, temperature, full_vocab, count):
    """
    A micro-batch's share of the step's loss (token-mean over `count` trained tokens of the whole step) and, both
    (B, T) and detached, its per-token KL and the student's log-probs of its sampled tokens: reverse_kl_loss of the
    two models' log-probs of the sampled tokens, or with full_vocab full_reverse_kl at every position (chunked: the
    (B, T, V) logits of either model never exist whole).
    """
    inputs, targets, mask = micro["inputs"], micro["targets"], micro["mask"]
    sampling = dict(temperature=temperature, top_k=None, top_p=None)
    if not full_vocab:
        with torch.no_grad():
            teacher_logp, _ = token_logprobs(teacher, inputs, targets, sampling)
        student_logp, _ = token_logprobs(model, inputs, targets, sampling)
        loss, kl = reverse_kl_loss(student_logp, teacher_logp, mask, count)
        return loss, kl, student_logp.detach()

    def kl_and_logp(logits, target, teacher_h):  # (N, V), (N,), (N, C_teacher)
        with torch.no_grad():
            teacher_logits = teacher.head(teacher_h)
        logp = F.log_softmax(logits.detach() / temperature, dim=-1).gather(-1, target.clamp(min=0)[:, None])
        return full_reverse_kl(logits, teacher_logits, temperature), logp.squeeze(-1)

    with autocast_ctx(inputs.device):
        with torch.no_grad():
            teacher_h = teacher.hidden(inputs)
        kl, student_logp = model.chunked_logits(model.hidden(inputs), kl_and_logp, targets, teacher_h)
    return (kl * mask).sum() / max(count, 1.0), kl.detach(), student_logp


def held_out(engine, test_task, eval_indices, args, step):
    """Held-out pass@1 / pass@k (eval.evaluate_generative) of the model behind `engine`."""
    result = evaluate_generative(engine, test_task, eval_indices, num_samples=args.eval_samples,
                                 ks=(1, args.eval_samples), max_tokens=args.max_tokens,
                                 temperature=args.eval_temperature, seed=mix_seed(args.seed, "eval"))
    k = f"pass@{args.eval_samples}"
    return {"step": step, "pass@1": result["pass@1"], k: result[k], "truncated": result["truncated"],
            "errors": result["errors"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stage_flags(parser, PRESETS, preset="fills the defaults below; explicit flags win",
                    seed="seeds prompt draws and sampling", run="wandb run name ('dummy': no wandb)",
                    ckpt="the student's start checkpoint (default: $NANOPOST_HOME/checkpoints/sft)",
                    out="output checkpoint folder (default: $NANOPOST_HOME/checkpoints/distill)",
                    resume="continue from the latest checkpoint in --out; exit if it is finished")
    add = parser.add_argument
    add("--teacher", default=None, help="the teacher checkpoint (default: $NANOPOST_HOME/checkpoints/rl); any depth, "
                                        "the student's tokenizer")
    add("--task", help="training prompts and verifier (synthetic, gsm8k, or a mixture 'a:1,b:1'); its held-out split "
                       "is evaluated")
    add("--decontaminate", action=argparse.BooleanOptionalAction, default=False,
        help="drop training prompts that share a 13-gram with the held-out problems (tasks.decontamination_index)")
    add("--train-size", type=int, help="training prompts drawn from (default: tiny 5000, full all)")
    add("--num-steps", type=int, help="optimizer steps, one batch of fresh student samples each")
    add("--prompts-per-step", type=int, help="prompts per step over all ranks (divisible by the world size)")
    add("--group-size", type=int, help="completions the student samples per prompt")
    add("--max-tokens", type=int, help="generation budget per completion, forced tool output included")
    add("--temperature", type=float, default=1.0,
        help="sampling temperature; both models are scored at it (softmax(logits / T)) so the KL is of what is sampled")
    add("--full-vocab", action="store_true",
        help="train on the exact reverse KL over the whole vocabulary at each sampled position (full_reverse_kl) "
             "instead of the sampled-token estimate (reverse_kl_loss)")
    add("--device-batch-tokens", type=int, help="padded positions per forward/backward (sequences x longest)")
    add("--lr-frac", type=float, help="learning rates as a fraction of pretraining's (Muon + AdamW)")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    add("--eval-every", type=int, help="held-out evaluation every N steps (and at the start and the end)")
    add("--eval-problems", type=int, help="held-out problems evaluated")
    add("--eval-samples", type=int, help="samples per held-out problem: pass@1 and pass@N")
    add("--eval-temperature", type=float, default=1.0, help="held-out sampling temperature")
    add("--save-every", type=int, help="checkpoint every N steps, for --resume")
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    check_lora_flags(parser, args)
    fill_preset(args, PRESETS[args.preset])
    return args


def main(argv=None):
    args = parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device, seed=args.seed)
    if args.prompts_per_step % world_size:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world_size} ranks")
    ckpt = Path(args.ckpt) if args.ckpt else checkpoint_dir("sft")
    teacher_ckpt = Path(args.teacher) if args.teacher else checkpoint_dir("rl")
    out = Path(args.out) if args.out else checkpoint_dir("distill")

    # Models: the student (its start checkpoint, or ours to resume from) and the frozen teacher.
    resume = resume_or_finish(out, args.resume, "distill")
    if resume is FINISHED:
        return
    model, tokenizer, _ = load_model(resume if resume and not args.lora_rank else ckpt, device)
    teacher, teacher_tokenizer, _ = load_model(teacher_ckpt, device)
    if not same_tokenizer(tokenizer, teacher_tokenizer):
        raise ValueError(f"the teacher {teacher_ckpt} and the student {ckpt} have different tokenizers; "
                         "distillation scores the student's token ids with the teacher, so they must share one")
    teacher.requires_grad_(False)
    lora = attach_lora(model, args)  # None without --lora-rank
    engine = Engine(model, tokenizer)
    pad_id = tokenizer.token_id("<|assistant_end|>")  # any id: padded positions have target -1
    print0(f"student: {model.num_params():,} parameters ({model.config.n_layer} layers) from "
           f"{resume or ckpt}; teacher: {teacher.num_params():,} parameters ({teacher.config.n_layer} layers) from "
           f"{teacher_ckpt}; {world_size} rank(s) on {device}")
    print0(f"plan: {args.num_steps} steps of {args.prompts_per_step} prompts x {args.group_size} samples of <= "
           f"{args.max_tokens} tokens; loss {'full-vocabulary' if args.full_vocab else 'sampled-token'} reverse KL at "
           f"temperature {args.temperature}" + (f"; {lora}" if lora else ""))

    train_task, test_task, eval_indices, _ = prepare_prompts(args, world_size)
    optimizers = lora.optimizers(args.lora_lr) if lora else model.setup_optimizers(
        matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    start_step, history, tokens_sampled, extra = 0, [], 0, {}
    if resume:
        _, _, extra = load_checkpoint(resume, device=device)
        load_optimizers(optimizers, extra["optimizers"])
        if lora:
            lora.load_state_dict(extra["lora"])
        start_step, history, tokens_sampled, teacher_eval = (extra["step"], extra["history"], extra["tokens_sampled"],
                                                             extra["teacher_eval"])
        print0(f"resuming at step {start_step}")
    else:
        teacher_eval = held_out(Engine(teacher, tokenizer), test_task, eval_indices, args, 0)
        print0(f"teacher held-out pass@1 {teacher_eval['pass@1']:.4f}")
    logger = Logger(args.run, vars(args), series=extra.get("curves"))  # on --resume, the curves so far
    if start_step == 0:
        history.append(held_out(engine, test_task, eval_indices, args, 0))
        print0(f"student held-out pass@1 {history[-1]['pass@1']:.4f}")
        logger.log({"eval/teacher_pass@1": teacher_eval["pass@1"], "eval/pass@1": history[-1]["pass@1"]}, step=0)

    def save(step, finished):
        if rank != 0:
            return
        state = {"optimizers": [o.state_dict() for o in optimizers], "step": step, "history": history,
                 "tokens_sampled": tokens_sampled, "teacher_eval": teacher_eval, "curves": logger.series}
        meta = {"stage": "distill", "source": str(ckpt), "teacher": str(teacher_ckpt), "args": vars(args),
                "finished": finished, "eval": history[-1] if history else None}
        save_checkpoint(out, step, tokenizer=tokenizer, **lora_checkpoint(model, lora, meta, state))

    sampling = dict(temperature=args.temperature, top_k=None, top_p=None)
    t_start = time.time()
    for step in range(start_step, args.num_steps):
        # 1. The student samples; 2. the teacher scores the same ids (inside distill_loss).
        t0 = time.time()
        with autocast_ctx(device):
            groups, rollout = sample_groups(engine, train_task, args.prompts_per_step // world_size, args.group_size,
                                            args.max_tokens, sampling, seed=mix_seed(args.seed, step),
                                            filter_zero_contrast=False, max_rounds=1, rank=rank,
                                            world_size=world_size)
        # The reverse KL never reads the verifier: an answer it failed on (group["errors"]) is trained like any other.
        rows = learner_rows([{**g, "errors": [False] * len(g["rewards"])} for g in groups],
                            group_rewards(groups)[0].tolist(), mask_truncated=False)
        batches, _ = token_budget_batches([[len(row[0]) - 1] for row in rows], args.device_batch_tokens)
        micros = [collate_rollouts([rows[i] for i in batch], pad_id, device) for batch in batches]
        count = torch.tensor(sum(float(m["mask"].sum()) for m in micros), dtype=torch.float64, device=device)
        if ddp:
            dist.all_reduce(count)
        t1 = time.time()

        # 3. One update on the whole batch: token-mean over every trained token of every rank.
        tally = {**rollout, "kl_sum": 0.0, "gap_sum": 0.0, "trained_tokens": 0}
        for micro in micros:
            loss, kl, student_logp = distill_loss(model, teacher, micro, args.temperature, args.full_vocab,
                                                  float(count))
            loss.backward()
            tally["kl_sum"] += float((kl * micro["mask"]).sum())
            tally["gap_sum"] += float(((student_logp.detach() - micro["behavior"]).abs() * micro["mask"]).sum())
            tally["trained_tokens"] += int(micro["mask"].sum())
        if ddp:
            all_reduce_gradients(model)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)) \
            if args.max_grad_norm > 0 else None
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        t2 = time.time()

        tally = reduce_tally(tally, device)
        tokens_sampled += int(tally["length_sum"])
        trained = max(tally["trained_tokens"], 1)
        metrics = {"distill/kl": tally["kl_sum"] / trained, "distill/tokens_sampled": tokens_sampled,
                   "distill/logp_gap_mean": tally["gap_sum"] / trained,
                   "reward/accuracy": tally["correct"] / max(tally["completions"], 1),
                   "length/mean": tally["length_sum"] / max(tally["completions"], 1),
                   "time/rollout_s": t1 - t0, "time/learner_s": t2 - t1}
        if grad_norm is not None:
            metrics["optim/grad_norm"] = grad_norm
        logger.log(metrics, step=step + 1)
        eta = (time.time() - t_start) / (step + 1 - start_step) * (args.num_steps - step - 1)
        print0(f"step {step + 1}/{args.num_steps} | kl {metrics['distill/kl']:.4f} | accuracy "
               f"{metrics['reward/accuracy']:.3f} | len {metrics['length/mean']:.1f} | tokens {tokens_sampled:,} "
               f"| gap {metrics['distill/logp_gap_mean']:.1e} | rollout {t1 - t0:.1f}s learn {t2 - t1:.1f}s "
               f"| ETA {format_eta(eta)}")

        # 4. Held-out evaluation and periodic checkpoints.
        last = step + 1 == args.num_steps
        if (step + 1) % args.eval_every == 0 or last:
            history.append({**held_out(engine, test_task, eval_indices, args, step + 1),
                            "tokens_sampled": tokens_sampled, "kl": metrics["distill/kl"]})
            print0(f"eval step {step + 1}: student pass@1 {history[-1]['pass@1']:.4f} "
                   f"(teacher {teacher_eval['pass@1']:.4f})")
            logger.log({"eval/pass@1": history[-1]["pass@1"]}, step=step + 1)
        if preempted(device):
            save(step + 1, finished=False)
            exit_preempted(out)
        if not last and args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1, finished=False)

    save(args.num_steps, finished=True)
    before, after, k = history[0], history[-1], f"pass@{args.eval_samples}"
    print0(f"held-out pass@1 {before['pass@1']:.4f} -> {after['pass@1']:.4f} (teacher {teacher_eval['pass@1']:.4f}), "
           f"{k} {before[k]:.4f} -> {after[k]:.4f}; {tokens_sampled:,} tokens sampled")
    append_report({"stage": "distill", "preset": args.preset, "task": args.task, "steps": args.num_steps,
                   "seed": args.seed, "full_vocab": args.full_vocab, "teacher": str(teacher_ckpt),
                   "pass@1_before": before["pass@1"], "pass@1": after["pass@1"], f"{k}_before": before[k],
                   k: after[k], "teacher_pass@1": teacher_eval["pass@1"], f"teacher_{k}": teacher_eval[k],
                   "tokens_sampled": tokens_sampled, "eval_problems": len(eval_indices),
                   "eval_samples": args.eval_samples, "history": history, "lora": lora.meta() if lora else None,
                   "seconds": time.time() - t_start}, logger)
    logger.finish()
    compute_cleanup()


if __name__ == "__main__":
    run_cli(main, preemptible=True)
