"""maj@k: the vote on hand-made answer lists, and evaluate_generative's maj@k with a scripted model and the real engine."""

import eval as ev
from conftest import make_tokenizer, scripted_model
from engine import Engine
from tasks import SyntheticTask


def test_majority_vote_on_hand_made_lists():
    assert ev.majority_vote(["3", None, "5", "5", None]) == "5"
    assert ev.majority_vote([None, None, None, "2"]) == "2"  # no-answer completions do not vote, even three of them
    assert ev.majority_vote([None, None]) is None and ev.majority_vote([]) is None
    assert ev.majority_vote(["7", "4", "4", "7"]) == "7"  # tie: the answer sampled first wins
    assert ev.majority_vote(["4", "7", "7", "4"]) == "4"
    assert ev.majority_vote([None, "9", "1", "1", "9", "9"]) == "9"


def test_maj_at_k_with_the_real_engine():
    # A scripted model always answers "#### 24": its majority answer is 24, right on exactly the problems whose
    # answer is 24 (as pass@k); a model with no "####" line never votes, so maj@k is 0.
    tokenizer = make_tokenizer()
    t = tokenizer.token_id
    script = [t("<|assistant_start|>"), *tokenizer.encode("#### 24"), t("<|assistant_end|>")]
    engine = Engine(scripted_model(tokenizer, dict(zip(script[:-1], script[1:]))), tokenizer)
    task = SyntheticTask("test", size=40)
    result = ev.evaluate_generative(engine, task, list(range(40)), num_samples=3, ks=(1, 3), max_tokens=8,
                                    temperature=0.0)
    right = sum(p["answer"] == 24 for p in task.problems) / 40
    assert right > 0 and result["maj@3"] == result["pass@3"] == right
    assert "maj@1" not in result
    silent = Engine(scripted_model(tokenizer, {t("<|assistant_start|>"): t("<|assistant_end|>")}), tokenizer)
    assert ev.evaluate_generative(silent, task, list(range(8)), num_samples=2, ks=(1, 2), max_tokens=4)["maj@2"] == 0
