"""Rule-based rewards on hand examples: gsm8k strict/flexible, arithmetic, MATH (verl's math_reward), math_dapo,
math-verify, dispatch by data_source as in verl (and rl.reward.math_scorer), custom."""

from __future__ import annotations

import pydantic
import pytest

from infra.rl_config import RewardConfig
from stages.rewards import (
    MATH_SOURCES,
    SCORERS,
    arithmetic,
    default_compute_score,
    gsm8k,
    math_dapo,
    math_reward,
    math_verify,
    register_scorer,
)
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
        # two answers: the work was checked before the first and the answer taken after the last (both scored 1)
        ("23 + 45 = 68\n68 - 7 = 61\n#### 5\n#### 61", "61", 0.0),
        ("23 + 45 = 68\n68 - 7 = 61\n#### 5\n99 * 99 = 1\n#### 61", "61", 0.0),
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
# MATH, verl's math_reward (the last \boxed{}, MATH's string normalisation): 1 / 0


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("so $\\boxed{\\frac12}$.", "\\frac{1}{2}", 1.0),  # \frac12 -> \frac{1}{2}
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),  # dfrac -> frac
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # "0.5" alone -> \frac{1}{2}
        ("\\boxed{.5}", "\\frac{1}{2}", 1.0),  # ".5" -> "0.5" -> \frac{1}{2}
        ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),  # two plain integers a/b -> \frac{a}{b}
        ("\\boxed{x = 5}", "5", 1.0),  # left side of at most 2 characters dropped
        ("\\boxed{10 \\text{ cm}}", "10", 1.0),  # units: everything from "\text{ " on
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),  # \left, \right and spaces dropped
        ("so \\boxed 5$.", "5", 1.0),  # "\boxed " form: up to the next $
        ("\\boxed{4}, no: \\boxed{5}", "5", 1.0),  # the last box counts
        ("\\boxed{1,000}", "1000", 0.0),  # MATH's normalisation keeps commas
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),  # strings, not values
        ("\\boxed{6}", "5", 0.0),  # wrong
        ("The answer is 5", "5", 0.0),  # no box
        ("\\boxed{5", "5", 0.0),  # never closed
        ("\\fbox{5}", "5", 0.0),  # verl finds \fbox but cannot unwrap it
        ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # normalisation fails on a trailing \sqrt: compared verbatim
    ],
)
def test_math_reward_hand_examples(solution, truth, expected):
    assert math_reward.compute_score(solution, truth) == expected


def test_math_reward_normalize():
    assert math_reward.normalize("\\frac1{72}") == "\\frac{1}{72}"
    assert math_reward.normalize("\\sqrt3") == "\\sqrt{3}"
    assert math_reward.normalize("k = 7") == "7" and math_reward.normalize("abc = 7") == "abc=7"  # lhs > 2 chars
    assert math_reward.normalize("07/2") == "07/2"  # not a plain integer: no \frac
    assert math_reward.normalize("1 \\text{ m} and 2 \\text{ m}") is None  # two unit cuts: compared verbatim


# --------------------------------------------------------------------------------------------------
# math_dapo (the last "Answer:" line, Minerva normalisation): verl's dict, +1 / -1


@pytest.mark.parametrize(
    "solution, truth, pred, acc",
    [
        ("3 + 2 = 5\nAnswer: 5", "5", "5", True),
        ("Answer: 6", "5", "6", False),  # wrong
        ("The answer is 5", "5", "[INVALID]", False),  # no "Answer:" line: -1, as a wrong answer
        ("\\boxed{5}", "5", "[INVALID]", False),  # a box alone is not read
        ("answer :\n7", "7", "7", True),  # case, spaces and a line break around the colon
        ("Answer: 3\nwait\nAnswer: 4", "4", "4", True),  # the last one counts
        ("Answer: 1,000", "1000", "1000", True),  # digits and commas -> digits
        ("Answer: \\frac12", "\\frac{1}{2}", "\\frac{1}{2}", True),  # \frac12 -> \frac{1}{2}
        ("Answer: x = 5", "5", "5", True),  # what follows the last "="
        ("Answer: 5 cm", "5", "5", True),  # unit words dropped
        ("Answer: 10 dollars", "\\$10", "10", True),  # both sides normalised
        ("Answer: 90^\\circ", "90", "90", True),
        ("Answer: $\\boxed{42}$", "42", "42", True),  # $...$ and \boxed{} unwrapped
        ("Answer: 0.5", "\\frac{1}{2}", "0.5", False),  # no numeric equivalence
        ("Answer: 5 ft", "5", "5ft", False),  # the paper drops "ft", verl does not
        ("Answer: 5\n" + "x" * 300, "5", "[INVALID]", False),  # only the last 300 characters are read
    ],
)
def test_math_dapo_hand_examples(solution, truth, pred, acc):
    assert math_dapo.compute_score(solution, truth) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_math_dapo_strict_box():
    assert math_dapo.compute_score("so \\boxed{5}", "5", strict_box=True) == {"score": 1.0, "acc": True, "pred": "5"}
    assert math_dapo.compute_score("\\boxed{ 5}", "5", strict_box=True)["score"] == -1.0  # no normalisation
    assert math_dapo.compute_score("Answer: 5", "5", strict_box=True) == {"score": -1.0, "acc": False, "pred": None}
    # the box must lie in the last 100 characters: 9 + 91 = 100 characters in, 9 + 95 = 104 out
    assert math_dapo.compute_score("\\boxed{5}" + "x" * 91, "5", strict_box=True)["score"] == 1.0
    assert math_dapo.compute_score("\\boxed{5}" + "x" * 95, "5", strict_box=True)["score"] == -1.0


# --------------------------------------------------------------------------------------------------
# math-verify (rl.reward.math_scorer=math_verify)


def test_math_verify():
    assert math_verify.compute_score("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}") == 1.0
    assert math_verify.compute_score("The answer is 0.5", "\\frac{1}{2}") == 1.0
    assert math_verify.compute_score("x = \\boxed{\\frac{1}{2}}", "\\boxed{0.5}") == 1.0  # already boxed
    assert math_verify.compute_score("So the answer is $\\boxed{0.25}$.", "\\frac{1}{2}") == 0.0
    assert math_verify.compute_score("I do not know", "\\frac{1}{2}") == 0.0
    assert math_verify.compute_score("\\boxed{\\frac{1}{2", "\\frac{1}{2}") == 0.0  # unparseable


# --------------------------------------------------------------------------------------------------
# dispatch: each data_source as in verl's default_compute_score


def test_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 7", "7") == 1.0
    assert default_compute_score("openai/gsm8k", "The answer is 7", "7") == 0.0  # strict by default
    assert default_compute_score("openai/gsm8k", "#### 1000", "1,000") == 0.0  # the ground truth is not normalised
    assert default_compute_score("synthetic/arithmetic", "3 + 4 = 7\n#### 007", "7") == 1.0
    assert default_compute_score("synthetic/calculator", "#### 7", "7") == 1.0
    for source in MATH_SOURCES:
        assert default_compute_score(source, "\\boxed{0.5}", "\\frac{1}{2}", {"index": 0}) == 1.0
        assert default_compute_score(source, "\\boxed{0.25}", "\\frac{1}{2}") == 0.0  # 0, not -1
    for source in ("math", "math_dapo", "math_dapo_reasoning", "aime2024", "aime_2025"):
        assert default_compute_score(source, "Answer: 12", "12") == {"score": 1.0, "acc": True, "pred": "12"}
        assert default_compute_score(source, "\\boxed{12}", "12")["score"] == -1.0


def test_math_scorer_switches_only_the_math_datasets():
    # 2/4 and a bare 0.5 equal 1/2 in value (math-verify) but not as MATH-normalised strings (verl)
    for solution in ("\\boxed{\\frac{2}{4}}", "The answer is 0.5"):
        assert default_compute_score("lighteval/MATH", solution, "\\frac{1}{2}") == 0.0
        assert default_compute_score("lighteval/MATH", solution, "\\frac{1}{2}", math_scorer="verl") == 0.0
        assert default_compute_score("lighteval/MATH", solution, "\\frac{1}{2}", math_scorer="math_verify") == 1.0
    # `math` stays verl's math_dapo
    assert default_compute_score("math", "Answer: 2/4", "\\frac{1}{2}", math_scorer="math_verify")["score"] == -1.0
    with pytest.raises(ValueError, match=r"math_scorer='sympy': use one of \['math_verify', 'verl'\]"):
        default_compute_score("lighteval/MATH", "\\boxed{1}", "1", math_scorer="sympy")
    assert RewardConfig().math_scorer == "verl"
    with pytest.raises(pydantic.ValidationError):
        RewardConfig(math_scorer="sympy")


def test_unknown_data_source():
    with pytest.raises(ValueError) as info:
        default_compute_score("my/task", "#### 1", "1")
    message = str(info.value)
    assert "'my/task'" in message and "'openai/gsm8k'" in message and "'synthetic/arithmetic'" in message
    assert "starting with 'aime'" in message
    assert "rl.reward.custom_path=" in message and "rl.reward.custom_function=" in message


@pytest.mark.parametrize("source, verl_scorer", [("hiyouga/geometry3k", "geo3k"), ("numina_olympiads", "prime_math"),
                                                 ("codeforces", "sandbox_fusion"),
                                                 ("searchR1_nq", "search_r1_like_qa_em")])
def test_verl_sources_we_do_not_score(source, verl_scorer):
    with pytest.raises(ValueError) as info:
        default_compute_score(source, "#### 1", "1")
    message = str(info.value)
    assert f"data_source {source!r}: verl scores it with its {verl_scorer}" in message
    assert "rl.reward.custom_path=" in message and "rl.reward.custom_function=" in message


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
        "def keyword_only(*, data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
        "def with_kwargs(data_source, solution_str, ground_truth, **kwargs):\n"
        "    return 1.0\n"
    )
    fn = load_reward_fn(str(path), "score")
    assert fn("x", "42", "42", None) == {"score": 1.0, "len": 2}
    assert fn(data_source="x", solution_str="41", ground_truth="42", extra_info={})["score"] == 0.0
    with pytest.raises(ValueError, match=r"no function 'scroe'; its functions: \['bad', 'keyword_only', 'score', "
                                         r"'with_kwargs'\]"):
        load_reward_fn(str(path), "scroe")
    with pytest.raises(ValueError, match=r"cannot be called as f\(data_source=..., solution_str=..., ground_truth"):
        load_reward_fn(str(path), "bad")
    for name in ("keyword_only", "with_kwargs"):  # verl calls by keyword: both forms work there
        assert load_reward_fn(str(path), name)(data_source="x", solution_str="1", ground_truth="1", extra_info=None)
    with pytest.raises(ValueError, match="not found"):
        load_reward_fn(str(tmp_path / "missing.py"), "score")
