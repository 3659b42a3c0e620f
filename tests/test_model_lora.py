"""
LoRA (model.LoRA): exactly the base at initialisation and when switched off, merged weights equal to the adapted
model, gradients only in the adapters, flags refused without --lora-rank, and an SFT run with adapters that saves a
loadable merged checkpoint and resumes bit-exactly; DPO and RL with LoRA take their reference from the same model with
the adapters off; the plan counts the adapters' gradients and optimizer state only.
"""

import pytest
import torch

import common
import dpo
import rl
import rollout
import sft
from conftest import make_model, make_tokenizer
from engine import load_model
from model import LORA_TARGETS, LoRA, lora_params, training_memory


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def ids(tokenizer):
    return torch.tensor([tokenizer.encode("Tom has 3 apples and buys 4 more.")])


def trained_lora(model, rank=4, targets=LORA_TARGETS):
    """Adapters with random (nonzero) B, as after some training."""
    lora = LoRA(model, rank, alpha=2 * rank, targets=targets)
    with torch.no_grad():
        for b in lora.b:
            b.normal_(std=0.05)
    return lora


def test_lora_at_init_leaves_outputs_exactly_unchanged(tokenizer):
    model = make_model(tokenizer).eval()
    x = ids(tokenizer)
    before = model(x)
    LoRA(model, rank=4)
    assert torch.equal(model(x), before)


def test_adapters_off_is_the_base_exactly_and_merged_weights_match(tokenizer):
    model = make_model(tokenizer).eval()
    x = ids(tokenizer)
    base = model(x)
    lora = trained_lora(model)
    adapted = model(x)
    assert (adapted - base).abs().max() > 1e-3  # the adapters change the function
    with lora.disabled():
        assert torch.equal(model(x), base)
    assert torch.equal(model(x), adapted)  # and back on after the context
    merged = lora.merged(model)
    assert not any(k.startswith("lora.") for k in merged.state_dict())
    torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=0)


def test_only_adapters_receive_gradients(tokenizer):
    model = make_model(tokenizer)
    lora = trained_lora(model, rank=2, targets=("attn.c_q", "mlp.c_fc"))
    x = ids(tokenizer)
    model(x[:, :-1], targets=x[:, 1:]).backward()
    adapters = {id(p) for p in lora.parameters()}
    assert len(adapters) == 2 * 2 * len(model.blocks)  # A and B of 2 targets in each block
    for name, p in model.named_parameters():
        if id(p) in adapters:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_lora_flags_need_a_rank():
    with pytest.raises(SystemExit):
        sft.main(["--lora-alpha", "8"])
    with pytest.raises(SystemExit):
        sft.main(["--lora-rank", "4", "--lr-frac", "0.1"])
    with pytest.raises(SystemExit):
        sft.main(["--lora-rank", "4", "--lora-targets", "attn.c_q,lm_head"])


SFT_ARGS = ["--preset", "tiny", "--device", "cpu", "--train-rows", "48", "--batch-size", "16",
            "--device-batch-tokens", "1024", "--eval-rows", "16", "--check-problems", "4", "--check-samples", "2",
            "--max-new-tokens", "16", "--eval-every", "2", "--save-every", "1", "--lora-rank", "2", "--lora-lr", "1e-2"]


def test_sft_with_lora_saves_a_merged_checkpoint_and_resumes_bit_exactly(tokenizer, tmp_path, monkeypatch, capsys):
    from test_resume import assert_same_run, run_killed_and_resumed
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    base = tmp_path / "base"
    start = make_model(tokenizer)
    common.save_checkpoint(base, 1, start, {"stage": "base"}, tokenizer=tokenizer)
    argv = SFT_ARGS + ["--ckpt", str(base)]
    sft.main(argv + ["--out", str(tmp_path / "a")])
    run_killed_and_resumed(sft.main, argv + ["--out", str(tmp_path / "b")], tmp_path / "b", 2, monkeypatch, common)
    assert "resuming from step 1" in capsys.readouterr().out
    assert_same_run(tmp_path / "a", tmp_path / "b")
    # The merged export loads as a plain GPT; every weight the adapters touch moved, the embeddings did not.
    merged, _, meta = load_model(tmp_path / "a", "cpu")
    assert meta["lora"]["rank"] == 2
    moved = {k for k, v in merged.state_dict().items() if not torch.equal(v, start.state_dict()[k])}
    assert moved == {f"blocks.{i}.{t}.weight" for i in range(len(merged.blocks)) for t in LORA_TARGETS}
    _, _, extra = common.load_checkpoint(tmp_path / "a")
    assert set(extra["lora"]) == {f"{ab}.{i}" for ab in "ab" for i in range(len(LORA_TARGETS) * len(merged.blocks))}


def test_dpo_with_lora_reference_is_the_base_model(tokenizer, tmp_path, monkeypatch):
    # Every reference log-prob dpo.py uses with --lora-rank (each training micro-batch, the held-out ones) equals the
    # SFT model's own, also after the adapters have moved; no reference copy, no pass over the training pairs.
    from test_resume import DPO_ARGS
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    sft_model = make_model(tokenizer).eval()
    common.save_checkpoint(tmp_path / "sft", 1, sft_model, {"stage": "sft"}, tokenizer=tokenizer)
    calls, real = [], dpo.preference_losses

    def recording(policy, pairs, ref, *rest):
        calls.append((pairs, ref.clone()))
        return real(policy, pairs, ref, *rest)

    monkeypatch.setattr(dpo, "preference_losses", recording)
    precomputed, real_reference_logps = [], dpo.reference_logps
    monkeypatch.setattr(dpo, "reference_logps", lambda model, pairs, *a: precomputed.append(len(pairs))
                        or real_reference_logps(model, pairs, *a))
    argv = [a for a in DPO_ARGS if a not in ("--lr-frac", "0.3")]  # --lr-frac is full fine-tuning's
    dpo.main(argv + ["--ckpt", str(tmp_path / "sft"), "--out", str(tmp_path / "dpo"), "--lora-rank", "2",
                     "--lora-lr", "1e-2", "--save-every", "0"])
    # The held-out pairs once, then each step's 16 pairs live (4 steps); never one pass over the 32 training pairs.
    assert precomputed == [16] * 5
    assert len(calls) >= 4
    for pairs, ref in calls:
        expected = torch.stack(dpo.pair_logps(sft_model, pairs, tokenizer.bos_id, "cpu")[:2], dim=1).float()
        torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    _, meta, extra = common.load_checkpoint(tmp_path / "dpo")
    assert meta["lora"]["rank"] == 2 and any(b.abs().sum() > 0 for k, b in extra["lora"].items() if k[0] == "b")


def test_rl_with_lora_reference_is_the_base_model(tokenizer, tmp_path, monkeypatch):
    # --kl-coef with --lora-rank: every reference log-prob is the start model's own, also after the adapters moved.
    from test_resume import RL_ARGS
    from test_rl import LengthParity
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=64))
    start = make_model(tokenizer).eval()
    common.save_checkpoint(tmp_path / "sft", 1, start, {"stage": "sft"}, tokenizer=tokenizer)
    pairs, real = [], rl.token_logprobs

    def recording(model, inputs, targets, sampling):
        out = real(model, inputs, targets, sampling)
        if not torch.is_grad_enabled():  # at one epoch of one minibatch the only no-grad pass is the reference's
            pairs.append((out[0], real(start, inputs, targets, sampling)[0], model.lora.b[0].abs().sum().item()))
        return out

    monkeypatch.setattr(rl, "token_logprobs", recording)
    rl.main(RL_ARGS + ["--ckpt", str(tmp_path / "sft"), "--out", str(tmp_path / "rl"), "--lora-rank", "2",
                       "--lora-lr", "1e-2", "--kl-coef", "0.1", "--save-every", "0", "--epochs", "1",
                       "--minibatches", "1"])
    assert len(pairs) >= 3 and pairs[-1][2] > 0  # the last steps' references were scored with moved adapters
    for reference, base, _ in pairs:
        torch.testing.assert_close(reference, base, atol=1e-5, rtol=0)
    merged, _, meta = load_model(tmp_path / "rl", "cpu")
    assert meta["lora"]["rank"] == 2
    assert torch.equal(merged.wte.weight, start.wte.weight)  # frozen outside the adapters


def test_plan_counts_the_adapters_gradients_and_optimizer_state(tokenizer):
    model = make_model(tokenizer)
    config = model.config
    for rank, targets in ((1, LORA_TARGETS), (8, ("attn.c_q", "attn.c_v"))):
        assert lora_params(config, rank, targets) == LoRA(make_model(tokenizer), rank, targets=targets).num_trainable()
    full, adapters = training_memory(config, 1024), training_memory(config, 1024, trainable=lora_params(config, 8))
    trainable = lora_params(config, 8)
    assert adapters["grads"] == 2 * 4 * trainable and adapters["optimizer"] == 8 * trainable
    assert adapters["weights"] == full["weights"] + 4 * trainable
    assert adapters["activations"] == full["activations"] and adapters["total"] < full["total"]


def test_an_adapter_adds_exactly_alpha_over_r_times_bax(tokenizer):
    model = make_model(tokenizer)
    lora = LoRA(model, rank=4, alpha=12)  # scale 3: a scale of 1, r / alpha or alpha alone would each show
    with torch.no_grad():
        for b in lora.b:
            b.normal_()
    for i, name in enumerate(lora.names[:2]):
        linear = model.get_submodule(name)
        x = torch.randn(5, linear.in_features)
        base = x @ linear.weight.T
        torch.testing.assert_close(linear(x), base + 3.0 * (x @ lora.a[i].T) @ lora.b[i].T)
        with lora.disabled():
            torch.testing.assert_close(linear(x), base)
