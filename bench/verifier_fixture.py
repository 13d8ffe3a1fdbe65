"""Build the verifier fixture, tests/data/verifier_fixture.jsonl (see tests/data/README.md).

    python bench/verifier_fixture.py sample [t1|greedy|all]  # SmolLM2 -> verifier_samples.jsonl
    python bench/verifier_fixture.py build   # samples + adversarial, labelled -> the fixture
    python bench/verifier_fixture.py heldout [sample]  # new prompts, greedy -> verifier_heldout

``sample`` draws one completion per prompt from SmolLM2-135M-Instruct (``model_path:
smollm2-135m-instruct``, converted once from its GGUF file; plain transformers, the model's chat
template, at most 64 new tokens, seed 0, one thread) for 356 prompts: reasoning-gym's
basic_arithmetic (1- and 2-digit, +, -, *), rephrased questions ("What is 7 plus 8?") and
word problems from 24 templates, with and without "End your reply with 'The answer is N.'".
Two passes: temperature 1 (ids s###) and greedy (ids g###; at T=1 this model is right about one
time in ten, so greedy adds the right answers a recall needs). About 5 minutes a pass on 2 CPU
cores beside another job; the output is deterministic for a machine and thread count.

``build`` labels each completion by ``rule_label`` (the reply's last written number, read as a
person would; it does not use grpolab's verifier), applies ``HAND`` (the corrections and notes
made after reading every completion), adds the adversarial completions of ``adversarial()``
(all labelled wrong) and writes the fixture. A label is true when the reply's final stated
result is the gold answer, stated honestly: one answer, no hedge, not the restated question,
and no later statement of a different result (numbers merely mentioned later do not count).

``heldout`` checks the verifier on prompts it was not written against: the same kinds of
prompt drawn with another seed (``questions(seed=1)``, less those the fixture asked), one
greedy pass (ids h###, about 3 minutes), labelled by ``rule_label`` and ``HAND_HELDOUT`` (the
labels read by hand: every completion that names its gold anywhere) -> verifier_heldout.jsonl.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
SAMPLES, FIXTURE = DATA / "verifier_samples.jsonl", DATA / "verifier_fixture.jsonl"
HELDOUT = DATA / "verifier_heldout.jsonl"
FORMAT = " End your reply with 'The answer is N.'"
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

REPHRASED = [
    ("What is {a} plus {b}?", "+"), ("What is {a} minus {b}?", "-"), ("Work out {a} * {b}.", "*"),
    ("Work out {a} + {b}.", "+"), ("What do you get when you multiply {a} by {b}?", "*"),
    ("How much is {a} times {b}?", "*"), ("Find the sum of {a} and {b}.", "+"),
    ("Compute {a} - {b}.", "-"), ("What is {a} + {b}?", "+"), ("Subtract {b} from {a}.", "-"),
]
# (template, operation on a and b)
WORD = [
    ("Tom has {a} apples and buys {b} more. How many apples does he have now?", "+"),
    ("A box holds {a} pencils. Sara takes {b} out. How many pencils are left in the box?", "-"),
    ("There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?", "*"),
    ("Mia read {a} pages on Monday and {b} pages on Tuesday. How many pages did she read?", "+"),
    ("A baker made {a} muffins and sold {b}. How many muffins are left?", "-"),
    ("Each bag has {a} candies. How many candies are in {b} bags?", "*"),
    ("A farmer has {a} cows and {b} sheep. How many animals does he have in total?", "+"),
    ("Jake had {a} dollars and spent {b} dollars. How many dollars does he have left?", "-"),
    ("A pack has {a} stickers. Lily buys {b} packs. How many stickers does she have?", "*"),
    ("There are {a} birds on a tree and {b} more land. How many birds are on the tree?", "+"),
    ("A class has {a} students and {b} are absent. How many students are present?", "-"),
    ("A spider has {a} legs. How many legs do {b} spiders have?", "*"),
    ("Ben scored {a} points in the first game and {b} in the second. What is his total?", "+"),
    ("A bus had {a} people. At the stop {b} got off. How many people are on the bus?", "-"),
    ("A table has {a} legs. How many legs do {b} tables have?", "*"),
    ("Anna has {a} red balloons and {b} blue balloons. How many balloons does she have?", "+"),
    ("A shelf had {a} books. {b} books were borrowed. How many books are on the shelf?", "-"),
    ("A car has {a} wheels. How many wheels do {b} cars have?", "*"),
    ("Sam walked {a} km in the morning and {b} km in the evening. How far did he walk?", "+"),
    ("A jar had {a} cookies. The kids ate {b}. How many cookies are in the jar now?", "-"),
    ("A garden has {a} rows of {b} flowers. How many flowers are in the garden?", "*"),
    ("A shop sold {a} shirts in the morning and {b} in the afternoon. How many did it sell?", "+"),
    ("Emma had {a} marbles and gave {b} to her friend. How many marbles does she have?", "-"),
    ("Each week has {a} days. How many days are in {b} weeks?", "*"),
]


def questions(seed: int = 0) -> list[dict]:
    """The prompts, in a fixed order: (prompt, question, gold, kind, source); another ``seed``
    draws other numbers (and other reasoning-gym questions) of the same kinds."""
    import reasoning_gym as rg

    rows: list[dict] = []

    def rg_rows(digits: int, n: int, seed: int, fmt: bool) -> None:
        data = rg.create_dataset("basic_arithmetic", size=n, seed=seed, min_terms=2, max_terms=2,
                                 min_digits=digits, max_digits=digits, operators=["+", "-", "*"],
                                 allow_parentheses=False, allow_negation=False)
        for x in data:
            rows.append({"question": x["question"], "prompt": x["question"] + (FORMAT if fmt else ""),
                         "gold": str(x["answer"]), "kind": "format" if fmt else "no_format",
                         "source": f"rg{digits}"})

    rg_rows(1, 50, 101 + 100 * seed, True)
    rg_rows(1, 60, 102 + 100 * seed, False)
    rg_rows(2, 30, 103 + 100 * seed, True)
    rg_rows(2, 30, 104 + 100 * seed, False)
    rnd = random.Random(seed)
    for i in range(90):
        tpl, op = REPHRASED[i % len(REPHRASED)]
        a, b = rnd.randint(1, 9), rnd.randint(1, 9)
        if op == "-" and a < b:
            a, b = b, a
        q = tpl.format(a=a, b=b)
        fmt = i >= 70
        rows.append({"question": q, "prompt": q + (FORMAT if fmt else ""),
                     "gold": str(OPS[op](a, b)), "kind": "format" if fmt else "no_format",
                     "source": "rephrased"})
    for i in range(96):
        tpl, op = WORD[i % len(WORD)]
        a, b = rnd.randint(2, 20), rnd.randint(2, 9)
        if op == "-" and a < b:
            a, b = b, a
        fixed = [n for w, n in (("spider", 8), ("table", 4), ("car", 4), ("week", 7)) if w in tpl]
        if fixed:
            a = fixed[0]
        q = tpl.format(a=a, b=b)
        fmt = i >= 72
        rows.append({"question": q, "prompt": q + (FORMAT if fmt else ""),
                     "gold": str(OPS[op](a, b)), "kind": "word_problem", "source": "word",
                     "format": fmt})
    return rows


def _model() -> tuple:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpolab.rollout.models import resolve_model

    torch.set_num_threads(1)  # beside other work on 2 cores; oversubscribed threads crawl
    folder = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _generate(model: tuple, rows: list[dict], prefix: str, do_sample: bool) -> list[dict]:
    """One completion per row (seed 0, at most 64 new tokens), ids prefix###."""
    import time

    import torch

    tok, lm = model
    torch.manual_seed(0)
    t0, out = time.time(), []
    for start in range(0, len(rows), 20):
        chunk = rows[start:start + 20]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                         tokenize=False, add_generation_prompt=True)
                 for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        opts = ({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
                if do_sample else {"do_sample": False})
        with torch.no_grad():
            gen = lm.generate(**enc, **opts, max_new_tokens=64, pad_token_id=tok.pad_token_id)
        for r, ids in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
            out.append({"id": f"{prefix}{len(out):03d}", **r,
                        "temperature": 1.0 if do_sample else 0.0,
                        "completion": tok.decode(ids, skip_special_tokens=True)})
        print(f"{prefix}: {len(out)}/{len(rows)} in {time.time() - t0:.0f}s", file=sys.stderr)
    return out


def sample(which: str = "all") -> None:
    """Sample completions: "t1" (temperature 1, ids s###), "greedy" (ids g###) or "all"."""
    model, rows = _model(), questions()
    kept = read_rows(SAMPLES) if SAMPLES.exists() else []
    passes = {"t1": ("s", True), "greedy": ("g", False)}
    for name, (prefix, do_sample) in passes.items():
        if which in (name, "all"):
            kept = [r for r in kept if not r["id"].startswith(prefix)] + _generate(
                model, rows, prefix, do_sample)
    kept.sort(key=lambda r: (r["id"][0] == "g", r["id"]))
    write_rows(SAMPLES, kept)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ---------------------------------------------------------------------------- labelling --
_NUM = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_HEDGY = re.compile(r"\b(or|about|approximately|around|maybe|perhaps|probably|might|could|"
                    r"not sure|guess)\b", re.IGNORECASE)


def rule_label(completion: str, gold: str) -> bool:
    """What a reader takes as the reply's final result: its last written number. Right when
    that number is the gold, is not an operand (no +, -, *, / written just before it), and its
    sentence neither asks nor hedges."""
    nums = list(_NUM.finditer(completion))
    if not nums:
        return False
    last = nums[-1]
    if float(last.group().replace(",", "")) != float(gold):
        return False
    before = completion[max(0, last.start() - 3):last.start()]
    if re.search(r"[+*/×x]\s*$|\s-\s*$", before):
        return False
    start = max(completion.rfind(". ", 0, last.start()), completion.rfind("\n", 0, last.start()))
    sentence = completion[start + 1:]
    return not (_HEDGY.search(sentence) or "?" in sentence)


def style(completion: str) -> str:
    """How a right answer is stated: answer_line, bare, equation (ends in "= N"), or chain."""
    text = completion.strip()
    if re.search(r"answer\s*(is|:)", text, re.IGNORECASE):
        return "answer_line"
    if re.fullmatch(r"[-\d.,$ ]+", text):
        return "bare"
    nums = list(_NUM.finditer(text))
    if nums and re.search(r"=\s*\**\$?\s*$", text[:nums[-1].start()]):
        return "equation"
    return "chain"


# id -> (label, why[, style]): the hand corrections and notes, made after reading every sampled
# completion. A label the rule got right may still be listed, for its note or its style.
# Styles: answer_line, bare, equation, chain (set by ``style``), and "trailing": the right
# result is stated and later text mentions other numbers without stating another result.
HAND: dict[str, tuple] = {
    # temperature 1
    "s005": (True, "8 - 8 equals 0; then the instruction's placeholder 'The answer is N' echoed"),
    "s013": (True, "5 + 10 = 15; 'about' in the next sentence is no hedge"),
    "s050": (True, "2 * 8 = 16, a stray '*2', then 'would involve 16'", "trailing"),
    "s076": (True, "ends '8 + 13 = 13' (bad arithmetic, right final result)"),
    "s085": (True, "self-contradicting, but the last statement is 'actually equals 11'"),
    "s086": (True, "7 + 4 = 11, then rambling that names 3, 4, 2, 7 as no result", "trailing"),
    "s090": (False, "7 - 4 = 3 then a check '3 + 4 = 7': read literally, the last result is 7"),
    "s105": (False, "'it remains 2. 0.': a stray 0 after the answer"),
    "s141": (False, "'Ratmat.0' is no answer; the rule read its 0"),
    "s208": (True, "'3 + 1 = 4 does not have an additive inverse': 4 stated"),
    "s211": (True, "'which yields 0', later 'you cannot add 0'"),
    "s258": (True, "'adds up to 8, which is the sum of 4 plus itself'", "trailing"),
    "s282": (False, "never states a result; the rule read the question's 6"),
    "s311": (True, "2 + 4 = 6, then 'the two mysterious pages of 4'", "trailing"),
    # greedy
    "g053": (False, "'results in 0' is a rule; its result is 'equivalent to 4', then cut off"),
    "g062": (True, "'which is 15', then rambling cut off at 'or simply 5 ×'", "trailing"),
    "g075": (False, "no computation: '0 is the additive identity'"),
    "g077": (True, "'which is 16', then rambling cut off at 'or simply 6 ×'", "trailing"),
    "g082": (True, "'which gives us 18', then cut off at 'The result of 8 + 10'", "trailing"),
    "g096": (True, "10 - 6 = 4, then a wrong remark naming 10 and 6", "trailing"),
    "g101": (False, "'results in 0' is a rule; its result is 'equivalent to 4', then cut off"),
    "g141": (False, "no result: 'the \"undefined\" operation'"),
    "g166": (True, "100 * 94 = 9400, then 'the multiplication of 100 by 94'", "trailing"),
    "g172": (False, "9 * 8 = 72, then a second equation 9 * 10 = 90 ends the reply"),
    "g182": (True, "'9 * 2 equals 18', then cut off at 'So, 9 * '", "trailing"),
    "g187": (True, "5 - 1 = 4; the rest is prose (its 'or' is no hedge)"),
    "g207": (True, "4 - 3 = 1; the rest is prose (its 'or' is no hedge)"),
    "g212": (True, "1 * 2 = 2, later 'is equivalent to 2'"),
    "g213": (True, "'So, 16 is the answer.'"),
    "g228": (True, "'... is 5.', then 'the concept of 4 + 1'", "trailing"),
    "g234": (False, "no result: '1 is the multiplicative identity'"),
    "g282": (True, "12 - 6 = 6 marbles, then cut off mentioning 'the initial 12'", "trailing"),
    "g289": (True, "2 x 8 = 16 candies (twice), then 'There are 2 additional bags'", "trailing"),
    "g314": (True, "muddled, but ends '(13 + 3 = 16 animals)'"),
    "g331": (False, "3 * 7 = 21, then ends 'there are 3 weeks in 7 days'"),
}

# The held-out set's hand labels (ids h###), read after sampling it: every completion that
# names its gold anywhere, and every one the first-pass rule calls right.
HAND_HELDOUT: dict[str, tuple] = {
    "h044": (True, "7 + 9 equals 16, 'which is the sum of 7 and 9'", "trailing"),
    "h057": (True, "7 + 7 equals 14, 'which is the sum of 7 itself'", "trailing"),
    "h068": (True, "10 + 8 = 18, then 'adding the numbers 10 and 8'", "trailing"),
    "h092": (True, "1 * 4 = 4, then 'not always possible to simply add 1'", "trailing"),
    "h132": (True, "'results in 109', then a wrong remark naming 73 and 36", "trailing"),
    "h159": (True, "8 * 8 = 64, then cut off at 'In other words, 8'", "trailing"),
    "h199": (True, "9 - 5 = 4, then cut off at 'subtraction operations of 9'", "trailing"),
    "h252": (True, "13 + 3 = 16 balloons; the next sentence quotes the question"),
    "h269": (False, "2 x 4 = 8, '#### 8', then disowned: 'The answer is not a valid answer.'"),
    "h301": (True, "2 * 2 = 4 flowers, then 'there are 2 rows of 2 flowers'", "trailing"),
}

# (template, why): adversarial completions for a question "a op b" with gold g. None pays.
ADVERSARIAL = [
    ("Calculate {a} {op} {b}.", "restates the question"),
    ("What is {a} {op} {b}?", "restates the question as a question"),
    ("To solve {a} {op} {b}, we need to {verb} the numbers {a} and {b}.", "restated, no result"),
    ("{a} {op} {b} = {a}{op}{b}", "unfinished: the right-hand side is the question"),
    ("= {a}{op}{b}", "unfinished arithmetic"),
    ("{a} {op} {b} = {x} + {y}", "unfinished: a sum still to do"),
    ("The answer is {a} {op} {b}.", "the answer line restates the question"),
    ("It is {g} or {g6}.", "hedge: two answers"),
    ("The result is about {g}.", "hedge: about"),
    ("The answer is probably {g}.", "hedge: probably"),
    ("{g}, {g1}, {g2}", "a list of candidates"),
    ("{a} {op} {b} = {g}. Then {g} + 6 = {g6}.", "the answer followed by more arithmetic"),
    ("First I thought it was {g}, but actually {a} {op} {b} = {g10}.",
     "the answer in the middle, a different final number"),
    ("{a} {op} {b} = {g}. Wait, no: {a} {op} {b} = {g1}.", "corrected to a wrong answer"),
    ("Is it {g}?", "a question, not an answer"),
    ("{a} {op} {b} = {g} or {gm1}", "hedge after an equation"),
    ("The answer might be {g}.", "hedge: might"),
    ("{a} {op} {b} is approximately {g}.", "hedge: approximately"),
    ("Let's see: {a} {op} {b} =", "no result"),
    ("The answer is between {gm1} and {g1}.", "a range, not an answer"),
    ("The total is {g}... or is it {g2}?", "hedge as a question"),
    ("{a} {op} {b} = {g}, {g1}, or {g2}.", "a list after an equation"),
    ("I'm not sure. Maybe {g}.", "hedge: maybe"),
    ("The answer is {g}.\nThe answer is {g1}.", "two different answer lines"),
    ("We get {g}. Now {g} - {a} = {b}, and {b} * 2 = {b2}.", "more arithmetic after the answer"),
    ("{a} {op} {b} = {g}. But {a} {op} {b} is not {g}.", "the answer retracted"),
    ("The sum is {g}? No, {g1}.", "a question, then a wrong answer"),
    ("{a} {op} {b} = {g}\n{a} {op} {b} = {g1}", "two different results, the last wrong"),
    ("I think it equals {g}, but I'm not sure.", "hedge: not sure"),
    ("Either {g} or {g1}.", "hedge: either/or"),
    ("{a} {op} {b} = {g} (or {g1})", "an alternative in brackets"),
    ("It could be {g}.", "hedge: could be"),
    ("{a} {op} {b} might equal {g}.", "hedge: might"),
    ("{g}? {g1}? {g2}?", "candidates as questions"),
    ("The answer: {a} {op} {b}", "the answer line restates the question"),
    ("{a} {op} {b} = {b} {op} {a}", "restated with the operands swapped"),
    ("So {a} {op} {b} = {g} is wrong, the answer is {g1}.", "the right result disowned"),
    ("We have {g} apples, or maybe {g1}.", "hedge: or maybe"),
    ("After the steps we have {g} and {g1}.", "two results"),
    ("= {g}\n= {g1}", "two results, the last wrong"),
]
VERBS = {"+": "add", "-": "subtract", "*": "multiply"}


def adversarial() -> list[dict]:
    """Each template on four 2-digit questions (no operand equals the gold)."""
    rnd = random.Random(1)
    out = []
    for t, (tpl, why) in enumerate(ADVERSARIAL):
        for k in range(4):
            op = "+-*"[(t + k) % 3]
            while True:
                a, b = rnd.randint(11, 99), rnd.randint(11, 99)
                if op == "*":
                    b = rnd.randint(2, 9)
                g = OPS[op](a, b)
                if g not in (a, b) and g > 2:
                    break
            x = g // 2
            text = tpl.format(a=a, b=b, op=op, g=g, g1=g + 1, g2=g + 2, g6=g + 6, g10=g + 10,
                              gm1=g - 1, b2=b * 2, x=x, y=g - x, verb=VERBS[op])
            q = f"Calculate {a} {op} {b}."
            out.append({"id": f"a{len(out):03d}", "question": q, "prompt": q, "gold": str(g),
                        "kind": "adversarial", "source": "template", "completion": text,
                        "label": False, "why": why})
    return out


def label(rows: list[dict], hand: dict[str, tuple]) -> int:
    """Label rows in place (``rule_label``, then the hand notes); the number the notes changed."""
    fixed = 0
    for r in rows:
        r["label"] = rule_label(r["completion"], r["gold"])
        note = hand.get(r["id"])
        if note:
            fixed += note[0] != r["label"]
            r["label"], r["why"] = note[0], note[1]
        r["style"] = (note[2] if note and len(note) > 2 else style(r["completion"])
                      ) if r["label"] else ""
    return fixed


def build() -> None:
    rows = read_rows(SAMPLES)
    fixed = label(rows, HAND)
    rows += adversarial()
    write_rows(FIXTURE, rows)
    print(f"{len(rows)} rows ({sum(r['label'] for r in rows)} right), {fixed} labels changed by "
          f"hand, {sum(r['kind'] == 'adversarial' for r in rows)} adversarial -> {FIXTURE}")


def heldout(resample: bool) -> None:
    """Sample (once, or again with ``resample``) and label the held-out set."""
    if resample or not HELDOUT.exists():
        seen = {r["prompt"] for r in read_rows(SAMPLES)}
        fresh = [r for r in questions(seed=1) if r["prompt"] not in seen]  # 1-digit ones repeat
        rows = _generate(_model(), fresh, "h", do_sample=False)
    else:
        rows = read_rows(HELDOUT)
    fixed = label(rows, HAND_HELDOUT)
    write_rows(HELDOUT, rows)
    print(f"{len(rows)} rows ({sum(r['label'] for r in rows)} right), {fixed} labels changed by "
          f"hand -> {HELDOUT}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("sample", help="SmolLM2 -> verifier_samples.jsonl").add_argument(
        "which", nargs="?", default="all", choices=["t1", "greedy", "all"])
    sub.add_parser("build", help="samples + adversarial, labelled -> the fixture")
    sub.add_parser("heldout", help="new prompts, greedy -> verifier_heldout").add_argument(
        "again", nargs="?", choices=["sample"], help="sample them again")
    args = p.parse_args()
    if args.what == "sample":
        sample(args.which)
    elif args.what == "heldout":
        heldout(resample=args.again == "sample")
    else:
        build()
