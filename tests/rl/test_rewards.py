"""Rule rewards routed by data_source (GSM8K's ``####``, math's ``\\boxed{}``, the built-in task), the
answer normaliser, and user reward functions given as a Python path, with errors naming the key."""

from __future__ import annotations

import pytest

from nereus.rl.rewards import (
    RewardRouter,
    answers_equal,
    boxed_score,
    gsm8k_answer,
    gsm8k_score,
    last_boxed,
    load_user_function,
    normalize_answer,
    scorer_for_source,
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
