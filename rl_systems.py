"""
The opt-in systems of the RL stages (a library beside rollout.py), each off by default and each one flag:

    --ptgs               TemperatureController: per-task exploration temperature from a success posterior (PTGS)
    --async              RolloutWorker: overlapped rollouts in a second process, one step off policy (AReaL);
                         fresh_groups drops the groups older than --max-policy-age
    --difficulty-filter  difficulty_prompts: keep the prompts the start checkpoint neither always nor never solves

Rollouts wires them to rollout.sample_groups: next_groups(step) is a step's scored groups, synchronous or from the
worker, with PTGS temperatures, the reward model's normalised scores (--reward rm) and the per-source accounting.
Measurements: docs/results.md, "RL systems flags".
"""

import hashlib
import json
import queue
import random
import time
from collections import Counter

import torch
import torch.distributed as dist

from common import autocast_ctx, get_dist_info, print0, resolve_checkpoint
from engine import Engine, load_model
from eval import evaluate_generative
from objectives import normalize_scores
from rollout import global_moments, mix_seed, reward_model_scores, sample_groups, source_tally

# -----------------------------------------------------------------------------
# --async: the rollout worker process


def _rollout_worker(ckpt, device, num_threads, task, sample_kwargs, jobs, results):
    """The rollout process: its own copy of the model; one job = one step's groups with the weights it was sent."""
    torch.set_num_threads(num_threads)
    model, tokenizer, _ = load_model(ckpt, device)
    engine = Engine(model, tokenizer)
    while (job := jobs.get()) is not None:
        step, version, state, seed = job
        model.load_state_dict(state)
        records = []  # (source, kept) of every scored group: the learner's per-source accounting
        t0 = time.time()
        with autocast_ctx(device):
            groups, stats = sample_groups(engine, task, seed=seed, **sample_kwargs,
                                          on_group=lambda c, rewards, errors, kept: records.append((c["source"], kept)))
        for group in groups:
            group["version"] = version
        results.put((step, version, groups, stats, records, time.time() - t0))


class RolloutWorker:
    """
    Overlapped rollouts (--async; AReaL, Fu et al. 2025; verl's one-step off-policy mode): a separate process with
    its own copy of the model generates the groups of a step while the learner updates on the previous ones.
    submit(step, version, weights, seed) sends a state dict of the policy (version: the number of updates behind
    it) and asks for step's groups; `pending` keeps the last job's {"version", "weights"}, what a checkpoint stores
    so that a resumed run asks for its first step with the same weights as the uninterrupted run; result() waits
    for the next batch. Every group records the version that sampled it (all its completions share it) and its
    completions the behavior log-probs of that version, so the learner's mismatch correction (mismatch_weights:
    pi_learner / pi_behavior, truncated) covers the staleness as it covers the engine/trainer gap. With delay 1 the
    loop submits step k + 1 with the weights of step k before it updates on step k; with delay 0 after the update:
    the same batches as the synchronous loop, only in another process.
    """

    def __init__(self, ckpt, device, task, sample_kwargs):
        context = torch.multiprocessing.get_context("spawn")
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_rollout_worker, daemon=True,
                                       args=(str(ckpt), str(device), torch.get_num_threads(), task, sample_kwargs,
                                             self.jobs, self.results))
        self.process.start()

    def submit(self, step, version, weights, seed):
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        self.pending = {"version": version, "weights": state}
        self.jobs.put((step, version, state, seed))

    def result(self):
        while True:
            try:
                return self.results.get(timeout=10)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the rollout worker died (exit code {self.process.exitcode})") from None

    def close(self):
        self.jobs.put(None)
        self.process.join(timeout=30)


def fresh_groups(groups, sources, step, max_age):
    """
    The staleness bound of overlapped rollouts (AReaL, Fu et al. 2025: at most eta versions between sampler and
    learner): (the groups sampled at most max_age updates before `step`, their entries of `sources`, how many were
    dropped). A group's age is step - group["version"]; the truncated importance weight (mismatch_weights) corrects
    a small sampler/learner gap, not an arbitrarily old policy.
    """
    fresh = [step - group["version"] <= max_age for group in groups]
    return ([g for g, keep in zip(groups, fresh) if keep], [s for s, keep in zip(sources, fresh) if keep],
            fresh.count(False))


# -----------------------------------------------------------------------------
# --difficulty-filter and --ptgs


def difficulty_keep(successes, n, low, high):
    """
    The difficulty filter's rule: keep a prompt whose success rate c / n over n samples lies strictly inside
    (low, high). A prompt the start model always or never solves gives every group zero contrast, so no gradient.
    successes: counts per prompt. Returns a list of bools.
    """
    if not 0 <= low < high <= 1:
        raise ValueError(f"--difficulty-filter needs 0 <= LOW < HIGH <= 1, got {low} {high}")
    return [low < c / n < high for c in successes]


def difficulty_filter(engine, mixture, n, low, high, max_tokens, sampling, seed, cache):
    """
    Sample n answers to every prompt of the mixture with the starting checkpoint and keep those with
    difficulty_keep. Prints the histogram of success counts and the kept count. The counts are cached in `cache`
    (a json file in the checkpoint, named by difficulty_cache_key) and reused when it exists.
    Returns (the kept mixture, the success counts).
    """
    if cache.exists():
        successes = json.loads(cache.read_text())["successes"]
        print0(f"difficulty filter: success counts of {len(successes)} prompts from {cache}")
    else:
        result = evaluate_generative(engine, mixture, list(range(len(mixture))), num_samples=n, ks=(1,),
                                     max_tokens=max_tokens, seed=seed, label="difficulty filter", **sampling)
        successes = result["correct"].tolist()
        if get_dist_info()[1] == 0:
            cache.write_text(json.dumps({"successes": successes}))
    if len(successes) != len(mixture):
        raise ValueError(f"{cache} holds {len(successes)} counts for {len(mixture)} prompts; delete it")
    keep = difficulty_keep(successes, n, low, high)
    histogram = Counter(successes)
    print0("difficulty filter: successes out of {n}: ".format(n=n)
           + " ".join(f"{c}:{histogram[c]}" for c in range(n + 1)))
    print0(f"difficulty filter: kept {sum(keep)} of {len(mixture)} prompts with success rate in ({low}, {high})")
    return mixture.keep([k for k, kept in enumerate(keep) if kept]), successes


class TemperatureController:
    """
    PTGS, per-task exploration temperature. For each recurring task id it keeps discounted success and failure
    counts, updated from a group's outcomes as  s <- gamma s + successes,  f <- gamma f + failures  (gamma = 1: plain
    counts; 0: only the last group). Before a group is generated it draws p ~ Beta(a + s, b + f), with the prior
    a = k q, b = k (1 - q) centred on the target success rate q (k = prior_strength), and maps the draw to

        T = T_ref * tau ** ((q - p) / q)          if p <= q   (a hard task: up to T_ref * tau, explore more)
        T = T_ref * tau ** ((q - p) / (1 - q))    if p > q    (an easy task: down to T_ref / tau, sharpen)

    so T = T_ref at p = q. With q = 0.5, tau = 1.5, T_ref = 1 the draws 0.1, 0.5, 0.9 give 1.5^0.8 = 1.383,
    1.000 and 1.5^-0.8 = 0.723. The state (counts and the RNG) goes into the checkpoint. Under several ranks
    (Rollouts) every rank applies every rank's outcomes of a step, so the counts are the same on all of them, and
    each rank reseeds the RNG per step from (seed, step, rank): rank 0's saved counts restore every rank.
    """

    def __init__(self, target=0.5, tau=1.5, t_ref=1.0, gamma=0.9, prior_strength=2.0, seed=0):
        if not 0 < target < 1 or not tau >= 1 or not t_ref > 0 or not 0 <= gamma <= 1 or not prior_strength > 0:
            raise ValueError(f"PTGS needs 0 < q < 1, tau >= 1, T_ref > 0, 0 <= gamma <= 1, prior > 0; got q {target}, "
                             f"tau {tau}, T_ref {t_ref}, gamma {gamma}, prior {prior_strength}")
        self.target, self.tau, self.t_ref, self.gamma, self.prior_strength = target, tau, t_ref, gamma, prior_strength
        self.counts = {}  # task id -> [s, f]
        self.rng = random.Random(seed)

    def temperature(self, p):
        q = self.target
        return self.t_ref * self.tau ** ((q - p) / (q if p <= q else 1 - q))

    def draw(self, task_id):
        s, f = self.counts.get(task_id, (0.0, 0.0))
        a, b = self.prior_strength * self.target, self.prior_strength * (1 - self.target)
        return self.temperature(self.rng.betavariate(a + s, b + f))

    def update(self, task_id, successes, failures):
        s, f = self.counts.get(task_id, (0.0, 0.0))
        self.counts[task_id] = [self.gamma * s + successes, self.gamma * f + failures]

    def state_dict(self):
        """The counts only: the RNG is reseeded every step from (seed, step, rank), so a resume redraws the same."""
        return {"counts": self.counts}

    def load_state_dict(self, state):
        self.counts = {k: list(v) for k, v in state["counts"].items()}


def difficulty_cache_key(args, mixture, sampling):
    """
    The key of the difficulty filter's cached success counts: everything they depend on. The prompts themselves
    (every row's messages, in order: whatever --task, --train-size, --decontaminate, --eval-problems or the preset
    made of them), the samples per prompt, the token budget, the sampling, the seed, and what scores the answers
    (the task's verifier, or the judge of --reward judge).
    """
    digest = hashlib.sha256()
    for k in range(len(mixture)):
        digest.update(json.dumps(mixture[k]["messages"], sort_keys=True).encode())
    scorer = (args.judge_url, args.judge_model, args.judge_rubric) if args.reward == "judge" else "verifier"
    return mix_seed(digest.hexdigest(), args.difficulty_samples, args.max_tokens, sorted(sampling.items()), args.seed,
                    scorer)


def difficulty_prompts(args, engine, train_task, ckpt, resume, sampling):
    """--difficulty-filter: the training prompts the start checkpoint neither always nor never solves (cached)."""
    if not args.difficulty_filter:
        return train_task
    cache = resolve_checkpoint(ckpt) / f"difficulty_{difficulty_cache_key(args, train_task, sampling):016x}.json"
    if resume and not cache.exists():
        raise ValueError(f"--difficulty-filter on resume needs the start checkpoint's counts {cache}; rerun from "
                         "the start checkpoint without --resume")
    with autocast_ctx(next(engine.model.parameters()).device):
        kept, _ = difficulty_filter(engine, train_task, args.difficulty_samples, *args.difficulty_filter,
                                    args.max_tokens, sampling, mix_seed(args.seed, "difficulty"), cache)
    if len(train_task.tasks) > 1:  # the filter keeps more of a source of the right difficulty: the shares move
        print0(f"mixture after the difficulty filter: training prompts per source {kept.counts()}")
    if len(kept) < args.prompts_per_step:
        raise ValueError(f"the difficulty filter kept {len(kept)} prompts, fewer than --prompts-per-step "
                         f"{args.prompts_per_step}; widen (LOW, HIGH) or add prompts")
    return kept


class Rollouts:
    """
    Each step's scored groups (next_groups), synchronous or from the overlapped RolloutWorker (--async), with
    PTGS temperatures (--ptgs), the reward model's scores (--reward rm) and the per-source accounting.
    worker_ckpt: the checkpoint the worker process builds its tokenizer and model from: the start checkpoint, or
    --out on resume (its weights are replaced by each job's).
    state: what state_dict() saved in the checkpoint resumed from (the PTGS counts; under --async the weights the
    worker was asked to sample the next step with: one update older than the checkpoint's with --async-delay 1).
    """

    def __init__(self, args, engine, task, worker_ckpt, start_step, reward_model=None, state=None):
        state = state or {}
        _, rank, _, world_size = get_dist_info()
        self.args, self.engine, self.task, self.reward_model = args, engine, task, reward_model
        self.device = next(engine.model.parameters()).device
        self.pad_id = engine.tokenizer.token_id("<|assistant_end|>")  # any id: padded positions have target -1
        self.rank, self.ptgs = rank, None
        if args.ptgs:  # one controller, the same on every rank: each step's outcomes are gathered from all ranks
            self.ptgs = TemperatureController(args.ptgs_target, args.ptgs_tau, args.temperature, args.ptgs_gamma,
                                              args.ptgs_prior)
            if "ptgs" in state:
                self.ptgs.load_state_dict(state["ptgs"])
        self.sample_kwargs = dict(
            num_groups=args.prompts_per_step // world_size, group_size=args.group_size, max_tokens=args.max_tokens,
            sampling=dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
            filter_zero_contrast=args.filter_zero_contrast and reward_model is None,
            max_rounds=args.max_sampling_rounds, overlong_buffer=args.overlong_buffer, rank=rank,
            world_size=world_size, oversample=args.oversample)
        self.worker = None
        if args.async_rollouts:
            self.worker = RolloutWorker(worker_ckpt, self.device, task, self.sample_kwargs)
            sampler = state.get("sampler", {"version": start_step, "weights": engine.model.state_dict()})
            self.worker.submit(start_step, sampler["version"], sampler["weights"], mix_seed(args.seed, start_step))

    def state_dict(self):
        """What a checkpoint keeps so that a resumed run continues exactly: the PTGS counts (the same on every rank:
        each step's outcomes are gathered from all) and the worker's pending job's version and weights."""
        state = {}
        if self.ptgs is not None:
            state["ptgs"] = self.ptgs.state_dict()
        if self.worker is not None:
            state["sampler"] = self.worker.pending
        return state

    def next_groups(self, step):
        """
        (groups, tally, info) of this rank for `step`: the kept groups (sample_groups' layout; under --reward rm their
        rewards are the reward model's normalised scores), the rollout's counts to reduce over ranks (sample_groups'
        stats, per-source counters, rm_score_sum) and, under --async, {"rollout_s", "ages"}; under --async the groups
        older than --max-policy-age are dropped (fresh_groups) and counted in the tally's "stale_groups".
        """
        args = self.args
        by_source, kept_sources, outcomes = source_tally(self.task.tasks), [], []

        def on_group(conversation, rewards, errors, kept):
            name = conversation["source"]
            by_source[f"source/{name}/groups_dispatched"] += 1
            by_source[f"source/{name}/groups_kept"] += kept
            if kept:
                kept_sources.append(name)
            if self.ptgs is not None:  # every scored group, before zero-contrast groups are dropped
                valid = [r for r, error in zip(rewards, errors) if not error]
                outcomes.append((conversation["task_id"], sum(r > 0 for r in valid), sum(r <= 0 for r in valid)))

        info = {}
        if self.worker is None:
            temperature_of = None
            if self.ptgs is not None:  # this rank's draws: a stream of its own per step, so a resume redraws them
                self.ptgs.rng.seed(mix_seed(args.seed, "ptgs", step, self.rank))
                temperature_of = lambda c: round(self.ptgs.draw(c["task_id"]), 2)  # noqa: E731
            with autocast_ctx(self.device):
                groups, rollout = sample_groups(self.engine, self.task, seed=mix_seed(args.seed, step),
                                                **self.sample_kwargs, on_group=on_group, temperature_of=temperature_of)
            if self.ptgs is not None:  # every rank's outcomes, in rank order: the posteriors see all the evidence
                everyone = [outcomes]
                if dist.is_initialized():
                    everyone = [None] * dist.get_world_size()
                    dist.all_gather_object(everyone, outcomes)
                for task_id, successes, failures in (o for rank_outcomes in everyone for o in rank_outcomes):
                    self.ptgs.update(task_id, successes, failures)
        else:  # the batch the worker sampled with older weights; then, with delay 1, ask for the next one at once
            _, version, groups, rollout, records, info["rollout_s"] = self.worker.result()
            for source, kept in records:
                on_group({"source": source}, [], [], kept)
            info["ages"] = [step - group["version"] for group in groups] or [step - version]
            groups, kept_sources, rollout["stale_groups"] = fresh_groups(groups, kept_sources, step,
                                                                         args.max_policy_age)
            if args.async_delay == 1 and step + 1 < args.num_steps:
                self.worker.submit(step + 1, step, self.engine.model.state_dict(), mix_seed(args.seed, step + 1))
        rm_score_sum = 0.0
        if self.reward_model is not None:  # --reward rm: the reward model's normalised scores replace the verifier's
            raw = reward_model_scores(self.reward_model, groups, self.pad_id, self.device,
                                      args.device_batch_tokens)  # (N,)
            rm_score_sum = float(raw.sum())
            normalized = normalize_scores(raw, global_moments([(raw, torch.ones_like(raw))], self.device)).tolist()
            for g, group in enumerate(groups):
                group["rewards"] = normalized[g * args.group_size:(g + 1) * args.group_size]
        for group, name in zip(groups, kept_sources):  # the learner counts each source's tokens (account_sources)
            group["source"] = name
        return groups, {**rollout, **by_source, "rm_score_sum": rm_score_sum}, info

    def after_update(self, step):
        """--async --async-delay 0: ask for step + 1's groups with the weights this step's update produced."""
        if self.worker is not None and self.args.async_delay == 0 and step + 1 < self.args.num_steps:
            self.worker.submit(step + 1, step + 1, self.engine.model.state_dict(), mix_seed(self.args.seed, step + 1))

    def close(self):
        if self.worker is not None:
            self.worker.close()
