"""Writes open_r1_golden.json: open-r1's own math-verify rewards on a fixed corpus, the values
tests/test_open_r1.py holds grpolab.rewards.open_r1 to.

Run with open-r1's src/open_r1/rewards.py at hand (its remote-judge imports stubbed):
    python tests/data/make_open_r1_golden.py path/to/open-r1/src/open_r1/rewards.py
Made from open-r1 commit 1416fa0 (2026-04-02), math-verify 0.9.0, latex2sympy2_extended 1.11.0.
"""

import json
import sys
import tempfile
import types
from pathlib import Path

SOLUTIONS = ["\\frac{1}{3}", "$\\frac{1}{3}$", "42", "The answer is $5$.", "$x^2+1$",
             "no math here", "$\\boxed{7}$", "\\[ 2\\sqrt{2} \\]", "3.5", "$10\\%$",
             "$\\{1, 2\\}$", "$(1,2]$"]
COMPLETIONS = ["<think>\nr\n</think>\n<answer>\n\\boxed{\\frac{1}{3}}\n</answer>",
               "The final answer is $\\frac13$", "\\boxed{42}", "42", "So it is 5.",
               "\\boxed{x^2 + 1}", "$\\boxed{7}$ yes", "\\boxed{2\\sqrt 2}", "\\boxed{\\frac{7}{2}}",
               "\\boxed{10\\%}", "\\boxed{0.1}", "Final answer: $5$", "\\boxed{\\{1,2\\}}",
               "\\boxed{(1,2]}", "", "\\boxed{3.5} and \\boxed{4}"]
COSINE = [[0.0, -0.5, 0.5, 1.0, 1000], [-1.0, -0.5, 0.5, 1.0, 40]]
LENGTH_BATCH = 8  # length's min and max are over one call's answers


def open_r1_rewards(path: str) -> types.ModuleType:
    root = Path(tempfile.mkdtemp()) / "open_r1"
    (root / "utils").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "utils" / "__init__.py").write_text("")
    (root / "utils" / "code_providers.py").write_text("get_provider = None\n")
    (root / "utils" / "competitive_programming.py").write_text(
        "SubtaskResult = add_includes = get_morph_client_from_env = None\n"
        "get_piston_client_from_env = patch_code = score_submission = score_subtask = None\n")
    (root / "rewards.py").write_text(Path(path).read_text())
    sys.path.insert(0, str(root.parent))
    import open_r1.rewards

    return open_r1.rewards


def main(path: str) -> None:
    r = open_r1_rewards(path)
    pairs = [(c, s) for s in SOLUTIONS for c in COMPLETIONS]
    texts, golds = [c for c, _ in pairs], [s for _, s in pairs]
    chat = [[{"role": "assistant", "content": c}] for c in texts]
    out = {"pairs": pairs, "accuracy": r.accuracy_reward(chat, golds),
           "cosine": {json.dumps(p): r.get_cosine_scaled_reward(*p)(chat, golds) for p in COSINE},
           "length": [v for i in range(0, len(pairs), LENGTH_BATCH)
                      for v in r.len_reward(chat[i:i + LENGTH_BATCH], golds[i:i + LENGTH_BATCH])]}
    Path(__file__).with_name("open_r1_golden.json").write_text(json.dumps(out, indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
