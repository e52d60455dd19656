"""Rule-based rewards routed by a row's ``data_source`` (as verl's default reward manager routes them),
the answer extraction and normaliser they share, and user reward functions given as a Python path.

Built-in scorers (1.0 for a correct answer, 0.0 otherwise):

- GSM8K (``openai/gsm8k``, any source containing ``gsm8k``): the number after the *last* ``####`` of the
  response, compared with the ground truth as numbers (GSM8K's own answer format, Cobbe et al. 2021,
  https://arxiv.org/abs/2110.14168);
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``): the
  contents of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``) of the response, braces balanced, compared
  with the ground truth (itself unwrapped from ``\\boxed{}`` if it is boxed) after ``normalize_answer``;
- DAPO (``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``): the answer after the last
  ``Answer:``, +1 when right and −1 when wrong (``rl.math_dapo``, verl's routing of these sources);
- any other source containing ``math`` is refused by ``check_sources`` rather than scored by a guessed
  rule (verl raises for an unknown source too): give ``run.reward_function``;
- the built-in tasks (``nereus/reverse``, ``nereus/repeat``): exact match of the whole response, ended with EOS.

``normalize_answer`` (documented in README "Bring a verl dataset and an HF model"): drop ``$`` signs
and a trailing period; unwrap ``\\text{...}``; remove ``\\left``/``\\right``, LaTeX spacing
(``\\!``, ``\\,``, ``\\;``, ``\\:``), degree marks and percent signs; ``\\dfrac``/``\\tfrac`` become
``\\frac``; remove all whitespace; remove thousands separators in numbers (``1,234`` → ``1234``). Two
answers are equal when their normalised strings are, or when both are numbers (integers, decimals,
``a/b`` or ``\\frac{a}{b}``) of equal value.

User functions use verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None)`` and
return a number or, as verl's scorers may, a dict whose ``score`` is the reward (its other keys, such as
``acc`` or ``pred``, are not used), so a verl user's function works unchanged; the job names it
``run.reward_function: "package.module:function"`` or ``"path/to/file.py:function"``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import math
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType, ModuleType

from nereus.rl import math_dapo
from nereus.rl.longtail import TASK_SOURCE as REPEAT_SOURCE
from nereus.rl.task import TASK_SOURCE, digit_match, exact_match
from nereus.spec.errors import SpecError, brief, cut
from nereus.spec.user_code import check_target, split_target

# (response text, ground truth, finished with EOS, extra_info) -> score
Scorer = Callable[[str, str, bool, dict], float]


# ----- answer extraction and normalisation ---------------------------------------------------------------
_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text`` (commas and ``$`` allowed), or None."""
    found = _GSM8K_ANSWER.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (nested braces balanced);
    None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _unwrap_text(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    """The canonical form two answers are compared in (see the module docstring)."""
    s = _unwrap_text(answer.replace("$", ""))
    for pattern in (r"\\left", r"\\right", r"\\[!,;:]", r"\^\{?\\circ\}?", r"\\%", r"%", r"\\ "):
        s = re.sub(pattern, "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    """The value of a normalised integer, decimal, ``a/b`` or ``\\frac{a}{b}``; None otherwise."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d*\.?\d+", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_equal(a: str, b: str) -> bool:
    na, nb = normalize_answer(a), normalize_answer(b)
    if na == nb:
        return True
    va, vb = _as_number(na), _as_number(nb)
    return va is not None and va == vb


# ----- scorers --------------------------------------------------------------------------------------------
def gsm8k_score(response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    """1 when the response's last ``#### N`` equals the ground truth (which may itself be ``... #### N``)."""
    got = gsm8k_answer(response)
    want = gsm8k_answer(ground_truth) or ground_truth
    return 1.0 if got is not None and answers_equal(got, want) else 0.0


def boxed_score(response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    """1 when the response's last ``\\boxed{}`` equals the ground truth after ``normalize_answer``."""
    got = last_boxed(response)
    want = last_boxed(ground_truth) or ground_truth
    return 1.0 if got is not None and answers_equal(got, want) else 0.0


def _exact(response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    return exact_match(response, ground_truth, finished)


def _digits(response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    return digit_match(response, ground_truth, finished)


# data_source -> scorer. Sources not listed fall back by substring; any other rule comes in as the user's
# function (``run.reward_function``, verl's custom_reward_function).
SOURCES: Mapping[str, Scorer] = MappingProxyType({
    TASK_SOURCE: _exact, REPEAT_SOURCE: _exact, "openai/gsm8k": gsm8k_score, "gsm8k": gsm8k_score,
    "lighteval/MATH": boxed_score, "DigitalLearningGmbH/MATH-lighteval": boxed_score,
    "HuggingFaceH4/MATH-500": boxed_score, **dict.fromkeys(math_dapo.SOURCES, math_dapo.dapo_score),
})
_FALLBACKS: tuple[tuple[str, Scorer], ...] = (("gsm8k", gsm8k_score),)
NAMED: Mapping[str, Scorer] = MappingProxyType({"exact_match": _exact, "digit_match": _digits})


def scorer_for_source(data_source: str) -> Scorer | None:
    if data_source in SOURCES:
        return SOURCES[data_source]
    if math_dapo.is_source(data_source):  # aime24, aime_2025...
        return math_dapo.dapo_score
    lower = data_source.lower()
    return next((s for key, s in _FALLBACKS if key in lower), None)


# ----- user functions -------------------------------------------------------------------------------------
# Importing a reward module should define functions and little else; past this the import is refused (it
# would otherwise hold the driver with no word). Only bounded where a signal can interrupt it (the main thread).
IMPORT_TIMEOUT_S = 60.0


class _ImportTooSlow(BaseException):
    """Raised by the timer into a user module's import that runs past ``IMPORT_TIMEOUT_S``."""


@contextlib.contextmanager
def _import_deadline(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_signum: int, _frame: object) -> None:
        raise _ImportTooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def import_user_module(module: str, where: str, prefix: str = "nereus_user_reward") -> ModuleType:
    """Import (run) the user's module or file (a file as the module ``<prefix>_<stem>``); anything it
    raises, ``sys.exit`` included, is one SpecError naming it (``spec.user_code`` has checked what can be
    checked without running it)."""
    what = module if module.endswith(".py") else f"module {module!r}"
    try:
        with _import_deadline(IMPORT_TIMEOUT_S):
            if not module.endswith(".py"):
                return importlib.import_module(module)
            path = Path(module)
            spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise SpecError(where, f"{module} cannot be imported as a Python file")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    except SpecError:
        raise
    except KeyboardInterrupt:
        raise
    except _ImportTooSlow:
        raise SpecError(where, f"importing {what} took more than {IMPORT_TIMEOUT_S:.0f} s; a reward module "
                               "should only define functions (move work into the function)") from None
    except SystemExit as err:
        raise SpecError(where, f"importing {what} called sys.exit({brief(err.code)}); a reward module should only "
                               "define functions") from None
    except SyntaxError as err:
        raise SpecError(where, f"{err.filename or what}:{err.lineno}: syntax error ({err.msg})") from None
    except ImportError as err:
        raise SpecError(where, f"cannot import {what} ({type(err).__name__}: {cut(str(err), 200)}); is it installed "
                               "or on PYTHONPATH?") from None
    except BaseException as err:  # noqa: BLE001 - user code may raise anything at import
        raise SpecError(where, f"importing {what} raised {type(err).__name__}: {cut(str(err), 200) or 'no message'}; "
                               "fix the module") from None


def _python_function(fn: object) -> Callable[..., float] | None:
    """``fn`` if it is a function written in Python (a bound method of one, or a ``functools.partial`` of
    one), else None: a builtin such as ``max`` or a class would be called with the wrong meaning."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    inner = inner.__func__ if inspect.ismethod(inner) else inner
    return fn if inspect.isfunction(inner) else None  # type: ignore[return-value]


def load_user_function(target: str, where: str = "run.reward_function") -> Callable[..., float]:
    """``"package.module:function"`` or ``"path/file.py:function"`` (a relative file resolved by the job),
    imported now, checked to be a Python function that accepts verl's ``compute_score(data_source,
    solution_str, ground_truth, extra_info=None)``, by position and by keyword as verl calls it."""
    check_target(target, where)  # what can be known without running it: file, syntax, the name defined
    module, name = split_target(target, where)
    fn = getattr(import_user_module(module, where), name, None)
    if not callable(fn):
        raise SpecError(where, f"{module!r} has no function {name!r}" + (f" (it is {brief(fn, 40)})" if fn is not
                                                                           None else ""))
    if _python_function(fn) is None:
        raise SpecError(where, f"{target} is {brief(fn, 40)}, not a Python function; give a function defined with "
                               "def and verl's signature (data_source, solution_str, ground_truth, extra_info=None)")
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.iscoroutinefunction(inner) or inspect.isgeneratorfunction(inner) or inspect.isasyncgenfunction(inner):
        raise SpecError(where, f"{target} is an async or generator function; a reward function returns its score")
    try:
        sig = inspect.signature(fn)
        sig.bind("source", "response", "truth", extra_info={})
        sig.bind(data_source="source", solution_str="response", ground_truth="truth", extra_info={})
    except (TypeError, ValueError) as err:
        raise SpecError(where, f"{target} must accept (data_source, solution_str, ground_truth, extra_info=None), "
                               f"by position and by name as verl calls it: {cut(str(err), 200)}") from None
    return fn


class RewardRouter:
    """The rule reward of one job: a user function (``run.reward_function``), a named rule for every row
    (``exact_match``, ``digit_match``), or ``auto``: the row's ``data_source`` picks the scorer."""

    def __init__(self, rule: str, function: str | None = None) -> None:
        self.rule = rule
        self.user = load_user_function(function) if function else None

    def check_sources(self, sources: set[str], where: str) -> None:
        """Under ``auto``, every data_source of the data must have a scorer; the error lists them."""
        if self.user is not None or self.rule != "auto":
            return
        missing = sorted(s for s in sources if scorer_for_source(s) is None)
        if missing:
            guess = " (a math source whose answer format Nereus does not know: no rule is guessed)" \
                if "math" in missing[0].lower() else ""
            raise SpecError(where, f"no rule reward for data_source {missing[0]!r}{guess}; built-in sources: "
                                   f"{sorted(SOURCES)} (and any starting with 'aime' or containing 'gsm8k'); give "
                                   "run.reward_function: 'module:function' or run.rule_reward: exact_match")

    def score(self, data_source: str, response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
        if self.user is not None:
            return user_score(self.user(data_source, response, ground_truth, extra_info=extra_info))
        if self.rule == "auto":
            return correct(data_source, response, ground_truth, finished, extra_info)
        return NAMED[self.rule](response, ground_truth, finished, extra_info)


def user_score(result: object) -> float:
    """The reward of a user function's ``result``: a number (bool included), or verl's dict with the reward
    under ``score``; anything else is a ``TypeError`` that says what came back."""
    value = result.get("score") if isinstance(result, dict) else result
    if isinstance(result, dict) and "score" not in result:
        raise TypeError(f"run.reward_function returned a dict without 'score' (keys {sorted(result)[:6]}); "
                        "return a number or {'score': number, ...} as verl's reward functions do")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"run.reward_function returned {type(value).__name__} {str(value)[:40]!r}; return a "
                        "finite number or {'score': number, ...}")
    return float(value)


def correct(data_source: str, response: str, ground_truth: str, finished: bool, extra_info: dict) -> float:
    """The data_source's correctness rule (the one held-out accuracy counts); exact match when unknown."""
    return (scorer_for_source(data_source) or _exact)(response, ground_truth, finished, extra_info)
