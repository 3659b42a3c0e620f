"""
What only a GPU can show (skipped without CUDA): bf16 autocast numerics of the engine and the learner, the KV cache
dtype, and resuming pretraining with the CUDA RNG state. On CPU the same paths run in fp32 and the other tests
check them exactly; here the tolerances are bf16's, stated where they are used.

    python -m pytest -q tests/test_gpu.py          # on a machine with a CUDA GPU
"""

import pytest
import torch

import common
import pretrain
import rollout
from conftest import grpo_advantages, make_model, make_tokenizer
from engine import Engine, KVCache
from tasks import SyntheticTask
from test_pretrain import SMALL, home, parquet_docs, tokenizer_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 keeps 8 bits of mantissa: a relative rounding error of 2^-9 ~ 0.2% per op. Logits are soft-capped at 15, so
# one rounding moves a logit by up to ~0.03; over 2 layers of attention and MLP a few roundings add up. 0.15 on a
# logit (and so ~0.15 on a log-prob) is ~5 roundings' worth: loose enough for kernel differences, tight enough to
# catch a wrong position, a stale cache slot or fp32/bf16 mixing that changes what the model computes.
BF16_ATOL = 0.15


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(tokenizer).cuda().eval()


def test_bf16_prefill_plus_decode_equals_full_forward(model):
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), device="cuda")
    with torch.no_grad(), common.autocast_ctx("cuda"):
        full = model(ids)[0]  # (40, V) float32 logits of a bf16 forward
        cache = KVCache(1, 40, model.config.n_layer, "cuda")
        prefill = model(ids[:, :24], kv_cache=cache)[0]  # (24, V)
        decode = [model(ids[:, t:t + 1], kv_cache=cache)[0, -1] for t in range(24, 40)]  # 16 x (V,)
    cached = torch.cat([prefill, torch.stack(decode)])  # (40, V)
    assert (cached - full).abs().max() < BF16_ATOL
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95
    # In fp32 the two agree to float rounding: the tolerance above is bf16's, not the cache's.
    with torch.no_grad():
        cache = KVCache(1, 40, model.config.n_layer, "cuda")
        cached32 = torch.cat([model(ids[:, :24], kv_cache=cache)[0]] +
                             [model(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(24, 40)])
        torch.testing.assert_close(cached32, model(ids)[0], rtol=1e-4, atol=1e-4)


def test_kv_cache_holds_the_dtype_the_model_computes_in(model):
    ids = torch.arange(8, device="cuda")[None]
    with torch.no_grad():
        with common.autocast_ctx("cuda"):
            cache = KVCache(1, 8, model.config.n_layer, "cuda")
            model(ids, kv_cache=cache)
        assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in zip(cache.keys, cache.values))
        cache = KVCache(1, 8, model.config.n_layer, "cuda")
        model(ids, kv_cache=cache)
        assert all(k.dtype == v.dtype == torch.float32 for k, v in zip(cache.keys, cache.values))


def test_bf16_engine_learner_logprob_gap_is_bounded(model, tokenizer):
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    task = SyntheticTask("train", size=4)
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(4)]
    with common.autocast_ctx("cuda"):
        results = Engine(model, tokenizer).generate(prompts, num_samples=4, max_tokens=24, seed=0, **sampling)
    groups = [{"prompt": p, "completions": c, "rewards": [0.0, 1.0, 0.0, 1.0]} for p, c in zip(prompts, results)]
    batch = rollout.collate_rollouts(rollout.learner_rows(groups, grpo_advantages(groups, 4), mask_truncated=False), 0, "cuda")
    with torch.no_grad():
        logp, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"], sampling)  # bf16 autocast inside
    gap = (logp - batch["behavior"]).abs() * batch["mask"]
    assert batch["mask"].sum() > 0
    assert gap.max() < BF16_ATOL  # what truncated importance sampling (--mismatch tis) corrects
    assert gap.sum() / batch["mask"].sum() < BF16_ATOL / 5  # and on average far less


@pytest.mark.slow
def test_pretrain_resume_restores_the_cuda_rng_state(home, parquet_docs, monkeypatch):  # noqa: F811
    argv = SMALL + ["--device", "cuda", "--data-files", str(parquet_docs), "--num-iterations", "6",
                    "--eval-every", "6", "--save-every", "3"]
    real_lr_multiplier = pretrain.lr_multiplier

    def dies_at_step_4(step, *args):
        if step == 4:
            raise KeyboardInterrupt
        return real_lr_multiplier(step, *args)

    monkeypatch.setattr(pretrain, "lr_multiplier", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        pretrain.main(argv + ["--out", str(home / "b")])
    monkeypatch.setattr(pretrain, "lr_multiplier", real_lr_multiplier)
    _, meta, extra = common.load_checkpoint(home / "b")
    assert meta["step"] == 3 and extra["rng_cuda"].dtype == torch.uint8

    restored = []
    real_set_rng_state = torch.cuda.set_rng_state
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append(state.clone()) or real_set_rng_state(state, device))
    pretrain.main(argv + ["--out", str(home / "b"), "--resume"])
    assert len(restored) == 1 and torch.equal(restored[0], extra["rng_cuda"].cpu())

    pretrain.main(argv + ["--out", str(home / "a")])  # uninterrupted
    a, b = common.read_report()[-1], common.read_report()[-2]
    # bf16 and atomics in CUDA backward kernels are not bit-reproducible run to run: close, not equal.
    assert b["val_bpb"] == pytest.approx(a["val_bpb"], rel=1e-2)
