"""Rule-based rewards on hand examples: gsm8k strict/flexible, arithmetic, math-verify, dispatch, custom."""

from __future__ import annotations

import pytest

from stages.rewards import SCORERS, default_compute_score, register_scorer
from stages.rewards import arithmetic, gsm8k
from stages.rewards import math as math_reward
from stages.rewards.custom import load_reward_fn


# --------------------------------------------------------------------------------------------------
# gsm8k


@pytest.mark.parametrize(
    "solution, truth, method, expected",
    [
        ("3 + 4 = 7\n#### 7", "7", "strict", 1.0),
        ("#### 1,234", "1234", "strict", 1.0),  # commas stripped
        ("#### 5\nno wait\n#### 6", "6", "strict", 1.0),  # the last #### wins
        ("#### 5", "6", "strict", 0.0),  # found but wrong: format_score (0.0)
        ("The answer is 6", "6", "strict", 0.0),  # strict needs '#### '
        ("The answer is 6", "6", "flexible", 1.0),
        ("It costs $1,200.", "1200", "flexible", 1.0),  # $ is not part of the number; comma and period go
        ("12 apples and 30 pears, so 42", "42", "flexible", 1.0),  # the last number
        ("no number here", "1", "flexible", 0.0),
        ("####-3", "-3", "strict", 0.0),  # verl's regex needs the space
        ("#### -3", "-3", "strict", 1.0),
    ],
)
def test_gsm8k_hand_examples(solution, truth, method, expected):
    assert gsm8k.compute_score(solution, truth, method=method) == expected


def test_gsm8k_last_300_chars_only():
    answer = "#### 42\n" + "x" * 300  # the answer starts 308 characters from the end: not searched
    assert gsm8k.extract_solution(answer) is None
    assert gsm8k.compute_score(answer, "42") == 0.0
    assert gsm8k.compute_score("#### 42\n" + "x" * 292, "42") == 1.0  # 300 characters: searched


def test_gsm8k_format_score_and_score():
    # wrong answer in the right format -> format_score; right -> score; no answer -> 0
    assert gsm8k.compute_score("#### 3", "4", format_score=0.1, score=2.0) == 0.1
    assert gsm8k.compute_score("#### 4", "4", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("four", "4", format_score=0.1, score=2.0) == 0.0
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k.compute_score("#### 4", "4", method="loose")


# --------------------------------------------------------------------------------------------------
# arithmetic


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("23 + 45 = 68\n68 - 7 = 61\n#### 61", "61", 1.0),
        ("23 + 45 = 68\n68 - 7 = 61\n#### 061", "61", 1.0),  # integer match
        ("3 - 15 = -12\n#### -12", "-12", 1.0),
        ("23 + 45 = 68\n68 - 7 = 61\n#### 62", "61", 0.0),  # wrong answer
        ("23 + 45 = 68\n68 - 7 = 61\n#### 61.5", "61", 0.0),
        ("23 + 45 = 68\n68 - 7 = 61", "61", 0.0),  # no '####'
        ("#### 61", "61", 0.0),  # no work shown
        ("23 + 45 = 69\n69 - 8 = 61\n#### 61", "61", 0.0),  # right answer, wrong arithmetic (69)
        ("23 + 45 = 68\n60 - 7 = 53\n#### 53", "53", 0.0),  # not chained: 60 is not the previous result 68
        ("500 + 500 = 1000\n#### 1,000", "1000", 1.0),
    ],
)
def test_arithmetic(solution, truth, expected):
    assert arithmetic.compute_score(solution, truth) == expected


def test_arithmetic_work_must_follow_the_question():
    q = {"question": "What is 23 + 45 - 7?"}
    assert arithmetic.compute_score("23 + 45 = 68\n68 - 7 = 61\n#### 61", "61", q) == 1.0
    # correct arithmetic and answer, but 46 - 8 uses operands that are not in the question
    assert arithmetic.compute_score("23 + 46 = 69\n69 - 8 = 61\n#### 61", "61", q) == 0.0
    assert arithmetic.compute_score("23 + 45 = 68\n#### 68", "68", q) == 0.0  # a step is missing
    q2 = {"question": "What is (50 - 20) * 16 - 28?"}
    assert arithmetic.compute_score("50 - 20 = 30\n30 * 16 = 480\n480 - 28 = 452\n#### 452", "452", q2) == 1.0


# --------------------------------------------------------------------------------------------------
# math-verify


def test_math_verify():
    assert math_reward.compute_score("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}") == 1.0
    assert math_reward.compute_score("The answer is 0.5", "\\frac{1}{2}") == 1.0
    assert math_reward.compute_score("x = \\boxed{\\frac{1}{2}}", "\\boxed{0.5}") == 1.0  # already boxed
    assert math_reward.compute_score("So the answer is $\\boxed{0.25}$.", "\\frac{1}{2}") == 0.0
    assert math_reward.compute_score("I do not know", "\\frac{1}{2}") == 0.0
    assert math_reward.compute_score("\\boxed{\\frac{1}{2", "\\frac{1}{2}") == 0.0  # unparseable


# --------------------------------------------------------------------------------------------------
# dispatch


def test_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 7", "7") == 1.0
    assert default_compute_score("openai/gsm8k", "The answer is 7", "7") == 0.0  # strict by default
    assert default_compute_score("synthetic/arithmetic", "3 + 4 = 7\n#### 007", "7") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"):
        assert default_compute_score(source, "\\boxed{0.5}", "\\frac{1}{2}", {"index": 0}) == 1.0


def test_unknown_data_source():
    with pytest.raises(ValueError) as info:
        default_compute_score("my/task", "#### 1", "1")
    message = str(info.value)
    assert "'my/task'" in message and "'openai/gsm8k'" in message and "'synthetic/arithmetic'" in message
    assert "file path" in message and "custom" in message


def test_register_duplicate():
    with pytest.raises(ValueError, match="'openai/gsm8k' already has a scorer"):
        register_scorer(["openai/gsm8k"], arithmetic.compute_score)
    assert SCORERS["openai/gsm8k"]("#### 4", "4", None) == 1.0  # unchanged


# --------------------------------------------------------------------------------------------------
# custom


def test_custom_loader(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'len': len(solution_str)}\n"
        "def bad(solution_str, ground_truth):\n"
        "    return 0.0\n"
    )
    fn = load_reward_fn(str(path), "score")
    assert fn("x", "42", "42", None) == {"score": 1.0, "len": 2}
    assert fn(data_source="x", solution_str="41", ground_truth="42", extra_info={})["score"] == 0.0
    with pytest.raises(ValueError, match=r"has no function 'scroe'; its functions: \['bad', 'score'\]"):
        load_reward_fn(str(path), "scroe")
    with pytest.raises(ValueError, match=r"cannot be called as f\(data_source, solution_str, ground_truth"):
        load_reward_fn(str(path), "bad")
    with pytest.raises(ValueError, match="not found"):
        load_reward_fn(str(tmp_path / "missing.py"), "score")
