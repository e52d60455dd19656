"""Rule rewards routed by data_source (GSM8K's ``####``, math's ``\\boxed{}``, the built-in task), the
answer normaliser, and user reward functions given as a Python path, with errors naming the key."""

from __future__ import annotations

import pytest

from nereus.rl.math_dapo import dapo_score
from nereus.rl.rewards import (
    RewardRouter,
    answers_equal,
    boxed_score,
    correct,
    gsm8k_answer,
    gsm8k_score,
    last_boxed,
    load_user_function,
    normalize_answer,
    scorer_for_source,
    user_score,
)
from nereus.spec.errors import SpecError


def test_gsm8k_takes_the_last_marked_number():
    assert gsm8k_answer("3+4 is 7 #### 7") == "7"
    assert gsm8k_answer("#### 5 no wait #### 1,234") == "1,234"
    assert gsm8k_answer("#### $-12.50") == "-12.50"
    assert gsm8k_answer("the answer is 7") is None  # no marker: no answer (a format the policy must learn)
    assert gsm8k_score("so #### 1,234.", "1234", True, {}) == 1.0
    assert gsm8k_score("#### 7.0", "7", True, {}) == 1.0  # equal as numbers
    assert gsm8k_score("#### 8", "7", True, {}) == 0.0
    assert gsm8k_score("7", "7", True, {}) == 0.0
    assert gsm8k_score("#### 18", "Natalia sold 48/2 = 24 clips... #### 72", True, {}) == 0.0
    assert gsm8k_score("#### 72", "Natalia sold 48/2 = 24 clips... #### 72", True, {}) == 1.0


def test_boxed_extraction_balances_braces():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # never closed
    assert last_boxed("no box") is None


@pytest.mark.parametrize(("a", "b", "equal"), [
    (r"\frac{1}{2}", "0.5", True), (r"\dfrac{1}{2}", r"\frac{1}{2}", True), ("1/2", "0.5", True),
    (r"\left( 1, 2 \right)", "(1,2)", True), (r"10\%", "10", True), (r"90^\circ", "90", True),
    (r"\text{5 apples}", "5apples", True), ("$3$.", "3", True), ("1,000", "1000", True),
    ("-\\frac{3}{4}", "-0.75", True), ("x+1", "1+x", False), ("2", "3", False), (r"\frac{1}{0}", "1", False),
])
def test_normaliser(a, b, equal):
    assert answers_equal(a, b) is equal
    assert answers_equal(b, a) is equal


def test_normalize_answer_is_idempotent():
    for s in (r"\left(\dfrac{1}{2}\right)", " $1,234$. ", r"\text{m}^{2}"):
        assert normalize_answer(normalize_answer(s)) == normalize_answer(s)


def test_boxed_score_and_routing():
    assert boxed_score(r"thus \boxed{\dfrac{1}{2}}", r"\boxed{\frac12}", True, {}) == 0.0  # \frac12: not normalised
    assert boxed_score(r"thus \boxed{\dfrac{1}{2}}", "0.5", True, {}) == 1.0
    assert scorer_for_source("openai/gsm8k") is gsm8k_score
    assert scorer_for_source("my_gsm8k_copy") is gsm8k_score
    assert scorer_for_source("lighteval/MATH") is boxed_score
    assert scorer_for_source("somebody/unknown") is None
    router = RewardRouter("auto")
    assert router.score("openai/gsm8k", "#### 7", "7", False, {}) == 1.0  # verl scores truncated text too
    assert router.score("nereus/reverse", "21", "21", False, {}) == 0.0  # the built-in task: EOS required
    assert router.score("nereus/repeat", "777", "777", True, {}) == 1.0  # the long-tail task: exact match
    assert router.score("nereus/repeat", "77", "777", True, {}) == 0.0
    assert RewardRouter("digit_match").score("openai/gsm8k", "21", "22", True, {}) == 0.5
    with pytest.raises(SpecError, match=r"run\.rule_reward: no rule reward for data_source 'somebody/unknown'"):
        router.check_sources({"openai/gsm8k", "somebody/unknown"}, "run.rule_reward")
    RewardRouter("exact_match").check_sources({"somebody/unknown"}, "run.rule_reward")  # no routing: no check


def test_user_function_from_a_file(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str.strip() == ground_truth) + extra_info.get('bonus', 0)\n"
                    "def two_args(a, b):\n    return 0.0\n")
    router = RewardRouter("auto", f"{file}:score")
    router.check_sources({"anything/at-all"}, "run.rule_reward")  # the user's function scores every source
    assert router.score("anything/at-all", " 7 ", "7", True, {"bonus": 0.5}) == 1.5
    with pytest.raises(SpecError, match=r"run\.reward_function: .*two_args must accept \(data_source, solution_str"):
        load_user_function(f"{file}:two_args")
    with pytest.raises(SpecError, match=r"run\.reward_function: '.*my_reward\.py' has no function 'nope'"):
        load_user_function(f"{file}:nope")


@pytest.mark.parametrize(("target", "message"), [
    ("no_colon", "is not 'package.module:function'"),
    ("no_such_package_xyz.rewards:score", "cannot import module 'no_such_package_xyz.rewards'"),
    ("missing_file.py:score", "file 'missing_file.py' not found"),
    ("nereus.rl.task:TASK_SOURCE", "has no function 'TASK_SOURCE'"),
])
def test_user_function_errors_name_the_key(target, message):
    with pytest.raises(SpecError) as err:
        load_user_function(target)
    assert err.value.path == "run.reward_function" and message in str(err.value)


@pytest.mark.parametrize(("response", "truth", "score"), [
    ("Let me think.\nAnswer: 42", "42", 1.0),
    ("answer :  $\\frac12$", "\\frac{1}{2}", 1.0),  # Minerva's shorthand fraction, $ dropped
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: 5 apples... no.\nAnswer: x = 7", "7", 1.0),  # the last Answer:, after its last '='
    ("Answer: \\boxed{12}", "12", 1.0),
    ("Answer: 10 degrees", "10", 1.0),
    ("Answer: 41", "42", -1.0),
    ("\\boxed{42}", "42", -1.0),  # no Answer: line is wrong (-1, never 0)
    ("x" * 400 + "Answer: 42", "42", 1.0),
    ("Answer: 42" + "x" * 300, "42", -1.0),  # only the last 300 characters count
])
def test_dapo_rule(response, truth, score):
    assert dapo_score(response, truth, True, {}) == score


def test_math_sources_route_as_verl_and_unknown_math_is_refused():
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime24", "aime_2025"):
        assert scorer_for_source(source) is dapo_score, source
    router = RewardRouter("auto")
    assert router.score("math_dapo", "Answer: 42", "42", True, {}) == 1.0
    assert router.score("math_dapo", "\\boxed{42}", "42", True, {}) == -1.0  # not the \boxed{} rule
    assert correct("math_dapo", "Answer: 42", "42", True, {}) == 1.0  # held-out accuracy counts it right
    assert scorer_for_source("my_math_set") is None
    with pytest.raises(SpecError, match=r"no rule reward for data_source 'my_math_set' \(a math source whose answer "
                                        r"format Nereus does not know: no rule is guessed\)"):
        router.check_sources({"my_math_set", "openai/gsm8k"}, "run.rule_reward")


def test_user_functions_may_return_verls_dict(tmp_path):
    file = tmp_path / "dict_reward.py"
    file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': 1.0 if solution_str == ground_truth else -1.0, 'acc': True, 'pred': 'x'}\n"
                    "def flag(data_source, solution_str, ground_truth, extra_info=None):\n    return True\n")
    assert RewardRouter("auto", f"{file}:score").score("s", "7", "7", True, {}) == 1.0
    assert RewardRouter("auto", f"{file}:score").score("s", "8", "7", True, {}) == -1.0
    assert RewardRouter("auto", f"{file}:flag").score("s", "8", "7", True, {}) == 1.0
    assert user_score(3) == 3.0
    with pytest.raises(TypeError, match=r"returned a dict without 'score' \(keys \['acc'\]\)"):
        user_score({"acc": 1})
    with pytest.raises(TypeError, match=r"returned str '0.5'; return a finite number"):
        user_score("0.5")
    with pytest.raises(TypeError, match=r"returned float 'nan'"):
        user_score({"score": float("nan")})
