"""The DAPO math rule: the answer after the last ``Answer:`` of a response, normalised and compared with the
ground truth; +1 when equal, −1 otherwise (never 0).

This is the rule verl applies to rows whose ``data_source`` is ``math_dapo``, ``math``,
``math_dapo_reasoning`` or starts with ``aime`` (``verl/utils/reward_score/math_dapo.py``, used by the DAPO
recipe: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
https://arxiv.org/abs/2503.14476). Its normalisation is Minerva's (Lewkowycz et al. 2022, "Solving
Quantitative Reasoning Problems with Language Models", https://arxiv.org/abs/2206.14858, appendix D.1:
``normalize_final_answer``), as the EleutherAI evaluation harness also implements it. Written here from
that description:

1. only the last 300 characters of the response count (the longest MATH-500 answer has 159);
2. the answer is the rest of the line after the last ``Answer:`` (case-insensitive, spaces allowed
   around the colon); without one the response is wrong;
3. both answers are normalised: keep what follows the last ``=``; apply the substitutions
   (``_SUBSTITUTIONS``) and delete the unit words and TeX decorations (``_REMOVED``) in that order; keep
   the inside of the first ``$...$``; unwrap ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and
   ``\\boxed{}``; expand shorthand ``\\frac12`` → ``\\frac{1}{2}`` and ``\\sqrt2`` → ``\\sqrt{2}``;
   drop ``$``; drop the commas of a plain integer (``1,000`` → ``1000``); strip spaces at the ends;
4. equal normalised strings score +1, anything else −1.
"""

from __future__ import annotations

import re

SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every source starting with "aime"
TAIL_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation tables (Lewkowycz et al. 2022, appendix D.1): (text, replacement) applied in order,
# then the expressions deleted in order.
_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
_UNWRAP = (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}")


def is_source(data_source: str) -> bool:
    """Whether verl scores ``data_source`` with this rule."""
    return data_source in SOURCES or data_source.startswith("aime")


def normalize_final_answer(answer: str) -> str:
    """Minerva's canonical form of a final answer (steps in the module docstring)."""
    s = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        s = s.replace(old, new)
    for gone in _REMOVED:
        s = s.replace(gone, "")
    inline = re.search(r"\$(.*?)\$", s)  # only the first inline formula's inside is kept
    if inline:
        s = f"${inline.group(1)}$"
    for pattern in _UNWRAP:
        s = re.sub(pattern, r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)  # greedy: the box's own closing brace is the last one
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in the response's last ``TAIL_CHARS`` characters, or None."""
    found = _ANSWER.findall(response[-TAIL_CHARS:])
    return found[-1] if found else None


def dapo_score(response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    """+1 when the response's ``Answer:`` equals the ground truth after ``normalize_final_answer``, else −1
    (a truncated response is scored on its text, as verl does)."""
    got = extract_answer(response)
    ok = got is not None and normalize_final_answer(got) == normalize_final_answer(ground_truth)
    return 1.0 if ok else -1.0
