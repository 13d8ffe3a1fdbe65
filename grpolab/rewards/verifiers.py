"""Verifiers that judge a completion's final answer, and nothing else.

A verifier that finds "an answer" anywhere in the text can be gamed: math-verify's own
extraction parsed "To solve 62 + 82, we ..." as 62 + 82 and paid it for the gold 144. GRPO's
group normalisation turns any such edge into a full unit of advantage, so the policy learns to
restate the question. The rule here:

1. **Where the final answer is.** Candidates come from, in this order of preference: every
   ``\\boxed{...}`` (or ``\\fbox``), every ``<answer>...</answer>``, every final-answer line
   ("The answer is X", "Final answer: X", "Answer: X", "#### X"); only when none of those
   exist, the whole completion if it is a bare short answer ("144", "$144$"), else its last
   stated result ("4 * 4 = 16.", "so the total is 144."): the number after the last "=" or
   stating verb (is, equals, gives, makes, get, has, ...), provided no other number follows it
   anywhere (the question's own numbers aside: "... = 16. That is 2 times 8" still answers
   "2 * 8"), no arithmetic continues or follows it ("= 100 + 44", "= 144. Then 144 + 6"; the
   question's own expression may be named after it if nothing is stated about it), and its
   sentence is neither a question nor hedged ("about", "maybe", "or", "I think", ...); a
   later sentence that only restates the question's data ("There are 2 bags.") is looked past.
   The first kind present decides; ``sources`` chooses which kinds count at all. A unit the
   question names is dropped from the answer found ("16 animals" -> "16").
2. **One answer.** All candidates of that kind must agree, and a candidate may not list
   alternatives ("150 or 144", "144, 150", "\\pm"), unless the gold answer itself has that
   shape. A hedge scores 0.
3. **Its final form.** Apart from a plain fraction, the answer may use no arithmetic operator that the gold answer does not
   use (+, binary -, *, /, ^, !, \\times, \\cdot, \\div, \\frac): "62+82" is not an answer to
   "what is 62 + 82", however math-verify would evaluate it.
4. **Equivalence.** Plain numbers (integers, decimals, thousands separators, a/b in lowest
   terms) are compared exactly as fractions; anything else goes to math-verify's ``verify`` (LaTeX, sets,
   intervals, units), never its answer extraction.
5. **Bounded time.** Completions are scanned in linear time; an answer longer than
   ``MAX_ANSWER_CHARS``, nested deeper than ``MAX_DEPTH`` braces, or with an exponent tower or an
   exponent above ``MAX_EXPONENT`` scores 0 before any parser sees it.
"""

from __future__ import annotations

import bisect
import collections
import functools
import re
import threading
from fractions import Fraction
from typing import Any

SOURCES = ("boxed", "answer_tag", "answer_line", "bare", "last_statement")
_FALLBACKS = ("bare", "last_statement")  # used only when no boxed/tag/answer line exists
MAX_ANSWER_CHARS = 200
MAX_DEPTH = 8
MAX_EXPONENT = 1000
_LINE_CHARS = 1000  # an answer line longer than this is prose, not an answer

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The answer is X", "Answer: X", "The answer to this problem is X" (a short clause naming what
# it answers, then "is": no sentence end, comma, colon or "=" in the clause)
_ANSWER_LINE = re.compile(
    r"(?:\b(?:the\s+)?(?:final\s+)?answer(?:\s+(?:to|for|of)\b[^.!?\n,:=]{0,80}?\s*\bis\s*:?"
    r"|\s*(?:is\s*:?|:|=))|^\s*####)\s*(.*)", re.IGNORECASE)
_HEDGE = re.compile(r"\bor\b|\band\b|;|\\pm|±|\\text\{\s*or\s*\}", re.IGNORECASE)
_LIST_COMMA = re.compile(r",(?!\d{3}(?!\d))")  # a comma that is not a thousands separator
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_TEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")

# A stated result: "= 16", "is 144", "equals 10", "we get 12", "Tom has 12 apples now".
_STATED = re.compile(
    r"(?:(?<![<>!=])=|\b(?:is|are|was|were|equals?|equal\s+to|gives?|makes?|gets?|got|be|"
    r"has|have|had|leaves?|left\s+with|total\s+of|totals?|yields?|results?\s+in|"
    r"adds?\s+up\s+to|comes?\s+to)\b:?)"
    r"(?:[ \t]*+(?:simply|just|exactly|actually|indeed|now|still|equal\s+to|equivalent\s+to|"
    r"a\s+total\s+of|us|you)\b)*+"
    r"[ \t]*+(?:\$|\\\(|\*\*)?[ \t]*+"
    r"(-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?)(?![\d.]\d)",
    re.IGNORECASE)
# ... or named before its verb: "So, 16 is the answer."
_NAMED = re.compile(r"(?<![\d.,])(-?\d+(?:\.\d+)?)[ \t]+(?:is|was)[ \t]+the[ \t]+(?:final[ \t]+)?"
                    r"(?:answer|result|total|sum|product|difference)\b", re.IGNORECASE)
_MORE_ARITHMETIC = re.compile(r"[ \t]*+(?:[-+*/×÷^x]|\\times|\\cdot|\\div)[ \t]*[\d(]")
# Arithmetic written after the answer ("Then 144 + 6", "8 * 0 is undefined"), and a statement
# about it.
_EXPRESSION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[ \t]*+(?:[-+*/×÷x]|\\times|\\cdot)[ \t]*+\d+")
_STATING = re.compile(r"[ \t]*+(?:=|(?:is|are|was|were|equals?|gives?|makes?|yields?|results?|"
                      r"comes?|adds?|be)\b)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?!\d)|\n")
_HEDGE_WORDS = re.compile(
    r"\b(?:or|about|approximately|approx|around|roughly|nearly|almost|maybe|perhaps|probably|"
    r"might|could|guess|close\s+to|likely|i\s+think|i\s+believe|not\s+sure|unsure|uncertain)\b"
    r"|≈|~", re.IGNORECASE)
_DOUBT = re.compile(r"\b(?:not|isn't|aren't|no)\b", re.IGNORECASE)  # "I do not think it is 16"
# A later sentence restating a quantity the question gives, of something other than what it
# asks ("There are 2 additional bags." after "2 x 8 = 16 candies" for "How many candies are in
# 2 bags?"), states no new result, unless it concludes or corrects ("So", "Actually", ...).
_GIVEN = re.compile(r"(?<![\d.,])(\d+)[ \t]+([A-Za-z]+)")
_ASKED = re.compile(r"\bhow[ \t]+(?:many|much)[ \t]+([A-Za-z]+)", re.IGNORECASE)
_CONCLUDES = re.compile(
    r"\b(?:so|thus|therefore|hence|then|total|altogether|in[ \t]+all|answer|result|actually|"
    r"wait|instead|rather|correct\w*|mistake|wrong|sorry|oops|no|not)\b", re.IGNORECASE)
_WORDS = re.compile(r"(?:[ \t]+[A-Za-z]+){1,3}")
# "16 animals" for "How many animals ...?": a unit the question names (after one of its numbers
# or "how many") is dropped, as math-verify would read "animals" as a product of variables.
# Words that change the value are no unit.
_WITH_UNIT = re.compile(r"(-?\d+(?:\.\d+)?)((?:[ \t]+[A-Za-z]+){1,3})")
_SCALE = re.compile(r"\b(?:times|percent|per|hundred|thousand|million|billion|dozen|score|"
                    r"squared|cubed|halves|half|thirds?|quarters?|fifths?|tenths?|plus|minus|"
                    r"over|divided|multiplied|by|more|less|fewer)\b", re.IGNORECASE)
_RESTATEMENTS = 3  # at most this many trailing restatements are looked past
# math-verify's default timeouts use signal.alarm, which only works in the main thread.
MATH_TIMEOUT_SECONDS = 5


def math_timeout() -> int | None:
    """math-verify's timeout: signal-based ones only work in the main thread (elsewhere none)."""
    return MATH_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _balanced(text: str, open_at: int) -> int | None:
    """Index of the brace closing the one at ``open_at`` (linear scan), or None."""
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _boxed(text: str) -> list[str]:
    out, pos = [], 0
    while (m := _BOX.search(text, pos)) is not None:
        close = _balanced(text, m.end() - 1)
        if close is None:  # an unclosed box is no answer; nothing after it can close either
            break
        out.append(text[m.end() : close])
        pos = close + 1
    return out


def _tagged(text: str) -> list[str]:
    out, pos = [], 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        out.append(text[start + 8 : end])
        pos = end + 9
    return out


def _answer_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        if len(line) > _LINE_CHARS:
            continue
        m = _ANSWER_LINE.search(line)
        if not m:
            continue
        answer = m.group(1)
        # "The answer is 16. I hope this helps!": a trailing remark without numbers or hedges
        # is not part of the answer (one with them is kept, and then fails rule 2 or 4)
        end = _SENTENCE_END.search(answer)
        if end and not re.search(r"\d", answer[end.end():]) and not _HEDGE_WORDS.search(
                answer[end.end():]):
            answer = answer[:end.start()]
        answer = answer.rpartition("=")[2]  # "The answer is 18 + 9 = 27 km": its result
        if clean(answer) not in ("", "N"):  # "The answer is N.": the instruction echoed
            out.append(answer)
    return out


def _bare(text: str) -> list[str]:
    s = text.strip()
    if len(s) > 40 or not s or "=" in s or re.search(r"[A-Za-z]", s.replace("\\frac", "")):
        return []  # an equation is judged by its result (last_statement)
    return [s]


def _noun(word: str) -> str:
    return word.lower().removesuffix("s")


@functools.lru_cache(maxsize=1024)
def _quantities(question: str) -> tuple[dict[str, frozenset[str]], frozenset[str]]:
    """The question's nouns: those after each of its numbers ("2 bags": {"2": {"bag"}}), and
    those it asks about ("how many candies": {"candie"}). Cached: a group repeats its prompt."""
    given: dict[str, set[str]] = {}
    for n, w in _GIVEN.findall(question):
        given.setdefault(n, set()).add(_noun(w))
    return ({n: frozenset(ws) for n, ws in given.items()},
            frozenset(_noun(w) for w in _ASKED.findall(question)))


def _restates(text: str, stated: re.Match, sentence: tuple[int, int], question: str) -> bool:
    """Whether ``stated`` only restates a quantity the question gives (see ``_GIVEN``)."""
    by_number, asked = _quantities(question)
    given = by_number.get(stated.group(1), frozenset()) - asked
    words = _WORDS.match(text, stated.end(), sentence[1])  # the words right after the number
    return (bool(given) and words is not None and any(_noun(w) in given for w in words[0].split())
            and not _CONCLUDES.search(text, sentence[0], sentence[1]))


def _last_statement(text: str, question: str = "") -> list[str]:
    """The number stated by the completion's last result statement ("... = 16.", "so the total
    is 144."), when nothing after it names another number (the question's own numbers aside),
    it continues no arithmetic, and its sentence is neither a question nor a hedge. A statement
    that only restates the question's data does not count as the last (``_restates``)."""
    tail = collections.deque(_STATED.finditer(text), maxlen=_RESTATEMENTS + 1)
    tail.extend(collections.deque(_NAMED.finditer(text), maxlen=_RESTATEMENTS + 1))
    if not tail:
        return []
    statements = sorted(tail, key=lambda m: m.start())[-(_RESTATEMENTS + 1):]
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]

    def sentence(m: re.Match) -> tuple[int, int]:  # from the end before m to the one after it
        before, after = bisect.bisect_right(ends, m.start()), bisect.bisect_left(ends, m.end())
        return (ends[before - 1] if before else 0), (ends[after] if after < len(ends) else len(text))

    last = statements.pop()
    while statements and _restates(text, last, sentence(last), question):
        last = statements.pop()
    value, rest = last.group(1), text[last.end():]
    if len(value) > MAX_ANSWER_CHARS or _MORE_ARITHMETIC.match(rest):  # "= 100 + 44": unfinished
        return []
    allowed = {value} | {n.group() for n in _NUMBER.finditer(question)
                         if len(n.group()) <= MAX_ANSWER_CHARS}
    known = {as_number(t) for t in allowed}
    for later in _NUMBER.finditer(rest):  # another number after the answer: a conflict, a
        t = later.group()  # list of candidates, or more arithmetic (texts seen once are
        if t not in allowed:  # parsed once: a long remark repeats the same few numbers)
            if len(t) > MAX_ANSWER_CHARS or as_number(t) not in known:
                return []
            allowed.add(t)
    asked = {re.sub(r"\s+", "", e.group()) for e in _EXPRESSION.finditer(question)}
    for expr in _EXPRESSION.finditer(rest):  # only the question's own, stating nothing
        e = expr.group()
        if e not in asked:
            if re.sub(r"\s+", "", e) not in asked:
                return []
            asked.add(e)  # this spelling of it, checked once
        if _STATING.match(rest, expr.end()):
            return []
    start, end = sentence(last)
    text_of_sentence = text[start:end]
    if (text_of_sentence.rstrip().endswith("?") or _HEDGE_WORDS.search(text_of_sentence)
            or _DOUBT.search(text, start, last.start())):
        return []
    return [value]


_FINDERS = {"boxed": _boxed, "answer_tag": _tagged, "answer_line": _answer_lines, "bare": _bare}


def clean(answer: str) -> str:
    """Strip what surrounds an answer: spaces, $ and \\( \\), markdown bold, a final period."""
    s = answer.strip()
    for _ in range(3):
        before = s
        s = s.strip().strip("*").strip()
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        if s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2]
        s = s.strip("$").strip()
        s = s.rstrip(".").rstrip()
        if s == before:
            break
    return s


def prompt_text(prompt: Any) -> str:
    """A prompt's text: a string as is, chat messages' contents joined."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def _without_unit(answer: str, question: str) -> str:
    m = _WITH_UNIT.fullmatch(answer)
    if m is None or _SCALE.search(m.group(2)):
        return answer
    by_number, asked = _quantities(question)
    units = asked.union(*by_number.values())
    return m.group(1) if all(_noun(w) in units for w in m.group(2).split()) else answer


def final_answer(text: str, sources: tuple[str, ...] | list[str] = SOURCES,
                 question: str = "") -> str | None:
    """The completion's one final answer by the rule above, or None (none, or several).
    ``question`` (the prompt's text) lets a remark after the answer name its numbers."""
    marked = False  # a box, tag or answer line was written, even one that cleans to nothing
    for source in SOURCES:
        if source not in sources:
            continue
        if source in _FALLBACKS and marked:
            break
        raw = (_last_statement(text, question) if source == "last_statement"
               else _FINDERS[source](text))
        marked = marked or (bool(raw) and source not in _FALLBACKS)
        found = [_without_unit(c, question) for c in map(clean, raw) if c]
        if found:
            return found[-1] if len(set(found)) == 1 else None
    return None


def _ops(s: str) -> set[str]:
    """The arithmetic operators written in ``s`` (unary signs and separators excluded)."""
    t = re.sub(r"\s+", "", s)
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", t)  # thousands separators
    ops = set()
    if re.search(r"\\[dt]?frac|/|\\div|÷", t):
        ops.add("/")
    if re.search(r"\*|\\times|\\cdot|×", t):
        ops.add("*")
    if "^" in t or "**" in t:
        ops.add("^")
    if "!" in t:
        ops.add("!")
    # binary + and -: after an operand (a digit, a letter, a closing bracket), not a sign
    if re.search(r"[\w)}\]]\+", t):
        ops.add("+")
    if re.search(r"[\w)}\]]-", t):
        ops.add("-")
    return ops


def _too_hard(s: str) -> bool:
    """Inputs no parser should see: too long, too deep, exponent towers or huge exponents."""
    if len(s) > MAX_ANSWER_CHARS:
        return True
    depth = peak = 0
    for ch in s:
        depth += ch == "{"
        depth -= ch == "}"
        peak = max(peak, depth)
    if peak > MAX_DEPTH:
        return True
    for m in re.finditer(r"(\^|\*\*)\s*(\{[^{}]*\}|\(?[-+]?\d+\)?|\w)", s):
        exp = m.group(2).strip("{}() ")
        if "^" in s[m.end():m.end() + 3] or "^" in exp:  # x^{y^z}, x^y^z
            return True
        if re.fullmatch(r"[-+]?\d+", exp) and abs(int(exp)) > MAX_EXPONENT:
            return True
    return bool(re.search(r"\^\s*\{[^}]*\^", s))


def as_number(s: str) -> Fraction | None:
    """A plain number (1,234 / -3.5 / 7/2 / \\frac{7}{2}) as an exact fraction, else None."""
    t = s.replace(" ", "")
    m = _TEX_FRAC.fullmatch(t) or _FRACTION.fullmatch(t)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    if _NUMBER.fullmatch(t):
        return Fraction(t.replace(",", ""))
    return None


@functools.lru_cache(maxsize=4096)
def parse_math(text: str, timeout: int | None) -> tuple[Any, ...]:
    """math-verify's parse of one answer (LaTeX-wrapped first, then as is), cached: in GRPO
    every group repeats the same gold answer G times."""
    from math_verify import parse

    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    return tuple(parse(wrapped, parsing_timeout=timeout) or parse(text, parsing_timeout=timeout))


def _math_verify(candidate: str, gold: str, timeout: int | None) -> bool:
    from math_verify import verify

    g, p = parse_math(gold, timeout), parse_math(candidate, timeout)
    return bool(g and p and verify(list(g), list(p), timeout_seconds=timeout))


def hedged(candidate: str, gold: str) -> bool:
    """Whether ``candidate`` lists alternatives ("150 or 144", "144, 150", "\\pm 3") that the
    gold answer's own shape does not explain."""
    return any(p.search(candidate) and not p.search(gold) for p in (_HEDGE, _LIST_COMMA))


def judge(candidate: str | None, gold: str, timeout: int | None = None) -> bool:
    """Whether the extracted ``candidate`` is an acceptable final answer equal to ``gold``."""
    if candidate is None:
        return False
    gold = clean(str(gold))
    if candidate == gold:
        return True
    if _too_hard(candidate) or not gold:
        return False
    if hedged(candidate, gold):
        return False
    a, b = as_number(candidate), as_number(gold)
    if a is not None and b is not None:
        # a fraction is a final form only in lowest terms: "62/2" is an unfinished division
        m = _TEX_FRAC.fullmatch(candidate.replace(" ", "")) or _FRACTION.fullmatch(
            candidate.replace(" ", ""))
        if m and Fraction(int(m.group(1)), int(m.group(2))).denominator != int(m.group(2)):
            return False
        return a == b
    if not _ops(candidate) <= _ops(gold):
        return False
    return _math_verify(candidate, gold, timeout)
