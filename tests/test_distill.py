"""
On-policy distillation (distill.py): the reverse-KL losses against hand computations, a teacher of another tokenizer
refused, a student identical to its teacher has zero loss and zero gradient, forced tool output is not trained, a
shallower teacher runs, and two torchrun ranks end with identical weights. Resume: tests/test_resume.py.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distill
import tasks
from common import save_checkpoint
from conftest import make_model, make_tokenizer
from engine import load_model
from model import GPT, GPTConfig
from rollout import collate_rollouts, group_rewards, learner_rows
from tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--preset", "tiny", "--device", "cpu", "--train-size", "64", "--num-steps", "2", "--prompts-per-step", "4",
         "--group-size", "2", "--max-tokens", "8", "--eval-problems", "4", "--eval-samples", "2",
         "--device-batch-tokens", "512", "--eval-every", "1"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def checkpoints(tokenizer, tmp_path, monkeypatch):
    """A student (seed 0) and a different teacher (seed 1, one layer) of one tokenizer, in a fresh NANOPOST_HOME."""
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    save_checkpoint(tmp_path / "student", 0, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    torch.manual_seed(1)
    teacher = GPT(GPTConfig(sequence_len=128, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=4, n_kv_head=2,
                            n_embd=64))
    save_checkpoint(tmp_path / "teacher", 0, teacher, {"stage": "rl"}, tokenizer=tokenizer)
    return tmp_path / "student", tmp_path / "teacher"


def test_reverse_kl_loss_matches_hand_computation():
    # Two sampled tokens: the student gives them 0.5 and 0.2, the teacher 0.25 and 0.4. Per-token d = log ps - log pt
    # = ln 2 and -ln 2; the value is their mean, 0; the gradient w.r.t. log ps is d / 2: the first token (student
    # too sure) is pushed down, the second (student not sure enough) up. A padded third position carries nothing.
    student = torch.tensor([[math.log(0.5), math.log(0.2), -3.0]], requires_grad=True)
    teacher = torch.tensor([[math.log(0.25), math.log(0.4), -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, d = distill.reverse_kl_loss(student, teacher, mask)
    loss.backward()
    torch.testing.assert_close(d[0, :2], torch.tensor([math.log(2), -math.log(2)]))
    assert abs(loss.item()) < 1e-7
    torch.testing.assert_close(student.grad, torch.tensor([[math.log(2) / 2, -math.log(2) / 2, 0.0]]))
    # A count from the whole step (other micro-batches, other ranks) divides instead of this batch's 2 tokens.
    loss, _ = distill.reverse_kl_loss(student, teacher, torch.tensor([[1.0, 0.0, 0.0]]), count=4)
    assert loss.item() == pytest.approx(math.log(2) / 4)


def test_full_reverse_kl_matches_hand_computation():
    # Two-token vocabulary: student (0.5, 0.5), teacher (0.8, 0.2): KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2).
    student = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.8, 0.2]]))
    kl = distill.full_reverse_kl(student, teacher)
    assert kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2))
    kl.sum().backward()
    assert student.grad[0, 0] < 0 < student.grad[0, 1]  # mass moves towards the teacher's likelier token
    assert distill.full_reverse_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-7)


def test_teacher_of_another_tokenizer_is_refused(checkpoints, tmp_path):
    student, _ = checkpoints
    other = Tokenizer.train(tasks.synthetic_documents(200, seed=1), vocab_size=400)
    save_checkpoint(tmp_path / "alien", 0, make_model(other), {"stage": "rl"}, tokenizer=other)
    with pytest.raises(ValueError, match="different tokenizers"):
        distill.main(FLAGS + ["--ckpt", str(student), "--teacher", str(tmp_path / "alien"),
                              "--out", str(tmp_path / "out")])


def micro_batch(model, tokenizer):
    """One learner micro-batch of 4 engine samples of 2 synthetic prompts."""
    from engine import Engine
    from rollout import sample_groups
    task = tasks.SyntheticTask("train", size=8)
    groups, _ = sample_groups(Engine(model, tokenizer), task, 2, 2, 12, dict(temperature=1.0, top_k=None, top_p=None),
                              seed=0, filter_zero_contrast=False, max_rounds=1)
    rows = learner_rows(groups, group_rewards(groups)[0].tolist(), mask_truncated=False)
    return collate_rollouts(rows, tokenizer.token_id("<|assistant_end|>"), "cpu")


@pytest.mark.parametrize("full_vocab", [False, True])
def test_identical_teacher_and_student_give_zero_loss(tokenizer, full_vocab):
    model = make_model(tokenizer).eval()
    teacher = make_model(tokenizer).eval().requires_grad_(False)  # the same weights, another copy
    micro = micro_batch(model, tokenizer)
    loss, kl, _ = distill.distill_loss(model, teacher, micro, 0.7, full_vocab, float(micro["mask"].sum()))
    loss.backward()
    assert micro["mask"].sum() > 0
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and kl.abs().max() < 1e-5
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-6
    # A different teacher gives a positive KL and a gradient.
    other = make_model(tokenizer, seed=1).eval().requires_grad_(False)
    model.zero_grad()
    loss, kl, _ = distill.distill_loss(model, other, micro, 1.0, full_vocab, float(micro["mask"].sum()))
    assert (kl * micro["mask"]).sum() > 0


def test_forced_tool_output_is_not_trained(tokenizer):
    # A completion with a calculator call: the forced <|output_start|>...<|output_end|> tokens have mask 0 in the
    # engine's Completion, and learner_rows / collate keep them untrained (target -1), so no KL term lands there.
    from engine import Completion
    out_start, out_end = tokenizer.token_id("<|output_start|>"), tokenizer.token_id("<|output_end|>")
    tokens = [5, 6, out_start, 7, out_end, 8]
    completion = Completion(tokens=tokens, mask=[1, 1, 0, 0, 0, 1], logprobs=[-1.0, -1.0, 0.0, 0.0, 0.0, -1.0],
                            finish="stop")
    rows = learner_rows([{"prompt": [1, 2], "completions": [completion], "rewards": [0.0]}], [0.0],
                        mask_truncated=False)
    micro = collate_rollouts(rows, 0, "cpu")
    model = make_model(tokenizer).eval()
    teacher = make_model(tokenizer, seed=1).eval().requires_grad_(False)
    _, kl, _ = distill.distill_loss(model, teacher, micro, 1.0, False, float(micro["mask"].sum()))
    # Position t predicts ids[t + 1]: ids = [1, 2, 5, 6, out_start, 7, out_end, 8]; the forced three are 4, 5, 6.
    assert micro["mask"][0].tolist() == [0, 1, 1, 0, 0, 0, 1]
    assert (kl[0] * micro["mask"][0])[3:6].abs().sum() == 0 and kl[0, 1] != 0


def test_distill_runs_with_a_shallower_teacher_and_moves_the_student(checkpoints, tmp_path, capsys):
    student, teacher = checkpoints
    distill.main(FLAGS + ["--ckpt", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert "teacher held-out pass@1" in text and "step 2/2" in text and "(1 layers)" in text
    record = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert record["stage"] == "distill" and record["tokens_sampled"] > 0 and "teacher_pass@1" in record
    assert record["history"][1]["kl"] > 0
    final, _, meta = load_model(tmp_path / "out", "cpu")
    start, _, _ = load_model(student, "cpu")
    assert meta["finished"] and meta["teacher"] == str(teacher)
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), start.state_dict().values()))


def test_student_distilled_from_itself_logs_zero_kl(checkpoints, tmp_path):
    student, _ = checkpoints
    distill.main(FLAGS + ["--ckpt", str(student), "--teacher", str(student), "--out", str(tmp_path / "out"),
                          "--num-steps", "1"])
    record = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert record["history"][-1]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_answers_the_verifier_failed_on_are_still_distilled(checkpoints, tokenizer, tmp_path, monkeypatch):
    import rollout
    from conftest import ends_turn_sometimes

    class BrokenVerifier(tasks.SyntheticTask):
        def reward(self, conversation, completion):
            raise RuntimeError("verifier down")

    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size, *a: BrokenVerifier(split, size=size))
    sampled, trained = [], []  # (model-sampled tokens, verifier error) of each answer; tokens trained on
    real_sample, real_loss = distill.sample_groups, distill.distill_loss

    def sample_groups(*args, **kwargs):
        groups, stats = real_sample(*args, **kwargs)
        sampled.extend((sum(c.mask), error) for g in groups for c, error in zip(g["completions"], g["errors"]))
        return groups, stats

    def distill_loss(model, teacher, micro, *args):
        trained.append(int(micro["mask"].sum()))
        return real_loss(model, teacher, micro, *args)

    monkeypatch.setattr(distill, "sample_groups", sample_groups)
    monkeypatch.setattr(distill, "distill_loss", distill_loss)
    _, teacher = checkpoints
    student = tmp_path / "stops"  # a student whose answers often end within 8 tokens: the verifier is asked
    save_checkpoint(student, 0, ends_turn_sometimes(make_model(tokenizer), tokenizer), {"stage": "sft"},
                    tokenizer=tokenizer)
    distill.main(FLAGS + ["--ckpt", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "out"),
                          "--num-steps", "1"])
    # every stopped answer was a verifier error; all sampled tokens were trained on (the answers' ends included)
    assert sum(n for n, error in sampled if error) > 0
    assert sum(trained) == sum(n for n, _ in sampled)


@pytest.mark.parametrize("full_vocab", [False, True], ids=["sampled", "full-vocab"])
def test_the_teacher_runs_without_autograd(tokenizer, full_vocab):
    student, teacher = make_model(tokenizer), make_model(tokenizer, seed=1)  # the teacher's weights still need grad
    graph = []  # whether each teacher module's output was recorded for autograd
    for module in teacher.modules():
        module.register_forward_hook(lambda m, inputs, output: graph.append(
            torch.is_tensor(output) and output.requires_grad))
    task = tasks.SyntheticTask("train", size=2)
    rendered = [tokenizer.render_conversation(task[i]) for i in range(2)]
    micro = collate_rollouts([(ids, mask, [0.0] * len(ids), 0.0) for ids, mask in rendered], tokenizer.bos_id, "cpu")
    loss, _, _ = distill.distill_loss(student, teacher, micro, 1.0, full_vocab, float(micro["mask"].sum()))
    loss.backward()
    assert graph and not any(graph)
    assert all(p.grad is None for p in teacher.parameters())


DDP_DRIVER = """
import hashlib, os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import distill
from engine import Engine
models = []
distill.Engine = lambda model, tokenizer: models.append(model) or Engine(model, tokenizer)  # the student first
distill.main(sys.argv[1:])
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in models[0].parameters())).hexdigest()
with open(os.path.join({out!r}, "rank" + os.environ["RANK"]), "w") as f:
    f.write(digest)
"""


@pytest.mark.slow
def test_torchrun_two_ranks_end_with_identical_weights(checkpoints, tmp_path):
    student, teacher = checkpoints
    driver = tmp_path / "driver.py"
    driver.write_text(DDP_DRIVER.format(repo=str(REPO), tests=str(REPO / "tests"), out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
               *FLAGS, "--ckpt", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "out")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout and "step 2/2" in result.stdout
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text()
    final, _, _ = load_model(tmp_path / "out", "cpu")
    start, _, _ = load_model(student, "cpu")
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), start.state_dict().values()))
