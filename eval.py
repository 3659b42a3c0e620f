"""
Evaluation: bits-per-byte, generative tasks scored by verifiers (pass@1, pass@k), and the report card.
The functions here are also what the training stages call for their periodic evaluations.
"""

import math

import torch
import torch.distributed as dist

from common import autocast_ctx, get_dist_info
from tasks import safe_reward


def pass_at_k(n, c, k):
    """
    Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k samples drawn without replacement from the n contain at least one correct one.
    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes, device):
    """
    Bits per byte of the targets in `batches` ((x, y) pairs of (B, T) token ids, y = -1 where ignored):

        bpb = sum_t CE_t / (ln 2 * sum_t bytes(y_t))

    the summed cross-entropy in nats converted to bits and divided by the UTF-8 bytes the targets stand for.
    Unlike the loss it does not depend on the tokenizer, so models with different vocabularies compare.
    Special tokens (0 bytes) are left out of both sums. Sums are all-reduced across DDP ranks.
    """
    token_bytes = token_bytes.to(device)
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_ctx(device):
            losses = model(x, y, loss_reduction="none")  # (B, T)
        num_bytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)  # (B, T)
        total_nats += (losses.float() * (num_bytes > 0)).sum().double()
        total_bytes += num_bytes.sum().double()
    if dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if total_bytes.item() == 0:
        raise ValueError("evaluate_bpb got no target bytes: the validation batches are empty")
    return (total_nats / (math.log(2) * total_bytes)).item()


def completion_text(tokenizer, completion):
    """The text a verifier sees: the completion's tokens decoded, without the closing <|assistant_end|>."""
    tokens = completion.tokens
    if completion.finish == "stop":
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def evaluate_generative(engine, task, indices, num_samples=1, ks=(1,), max_tokens=256, temperature=0.0,
                        top_k=None, top_p=None, batch_size=32, seed=0):
    """
    Sample `num_samples` completions for each problem task[i], i in `indices`, score each with the task's
    verifier, and return exact counts and pass@k. Under DDP every rank takes every world_size-th problem and
    the per-problem counts are summed across ranks, so the result is the same as one process would get.

    Returns {"correct": LongTensor (P,), "samples": n, "errors": int, "pass@k": float for each k}.
    """
    _, rank, _, world_size = get_dist_info()
    device = next(engine.model.parameters()).device
    correct = torch.zeros(len(indices), dtype=torch.long, device=device)
    errors = torch.zeros((), dtype=torch.long, device=device)
    mine = list(range(rank, len(indices), world_size))
    for start in range(0, len(mine), batch_size):
        positions = mine[start:start + batch_size]
        conversations = [task[indices[p]] for p in positions]
        prompts = [engine.tokenizer.render_for_completion(c) for c in conversations]
        results = engine.generate(prompts, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed + start + rank * 1_000_003)
        for p, conversation, completions in zip(positions, conversations, results):
            for completion in completions:
                reward, error = safe_reward(task, conversation, completion_text(engine.tokenizer, completion))
                correct[p] += int(reward > 0)
                errors += int(error)
    if dist.is_initialized():
        dist.all_reduce(correct)
        dist.all_reduce(errors)
    correct = correct.cpu()
    result = {"correct": correct, "samples": num_samples, "errors": int(errors)}
    for k in ks:
        result[f"pass@{k}"] = sum(pass_at_k(num_samples, int(c), k) for c in correct) / max(len(indices), 1)
    return result
