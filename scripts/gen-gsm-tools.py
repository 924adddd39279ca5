#!/usr/bin/env python3
"""Writes examples/gsm-tools/tasks.jsonl: two-step word problems with two- and
three-digit numbers (products, sums and differences), in GSM8K's format (`question`,
`answer` ending `#### N`), for the `mcp-tools` agent of examples/gsm-tools.toml.

The arithmetic is what a small model gets wrong in its head and right with `run_code`
(`print(37 * 24 - 129)`), so a policy that learns to call the tool earns more reward.
Deterministic (fixed seed): run it again and the file is byte-identical.
"""
import json
import random
import sys

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Omar", "Zoe", "Ravi", "Nora"]
# (containers, item, verb for taking some away)
GOODS = [("boxes", "pencils", "sells"), ("crates", "apples", "sells"), ("trays", "cookies", "gives away"),
         ("bags", "marbles", "loses"), ("packs", "cards", "gives away"), ("shelves", "books", "lends out"),
         ("jars", "coins", "spends"), ("rolls", "stickers", "uses")]


def problem(rng):
    name = rng.choice(NAMES)
    container, item, verb = rng.choice(GOODS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 60)
        c = rng.randint(10, a * b - 1)
        q = (f"{name} has {a} {container} of {item} with {b} {item} in each. "
             f"{name} {verb} {c} {item}. How many {item} are left?")
        return q, f"{a} * {b} = {a * b}; {a * b} - {c} = {a * b - c}", a * b - c
    if kind == 1:
        a, b, c, d = rng.randint(11, 60), rng.randint(11, 99), rng.randint(11, 60), rng.randint(11, 99)
        q = (f"{name} buys {a} {container} of {item} with {b} in each, and then {c} more "
             f"{container} with {d} in each. How many {item} does {name} have?")
        return q, f"{a} * {b} + {c} * {d} = {a * b + c * d}", a * b + c * d
    a, b, k = rng.randint(101, 999), rng.randint(3, 19), rng.randint(11, 99)
    total = a * b
    q = (f"A warehouse has {total} {item}. They are packed equally into {b} {container}, "
         f"and then {k} more {item} are put in each. How many {item} are in each of the "
         f"{container}?")
    return q, f"{total} / {b} = {a}; {a} + {k} = {a + k}", a + k


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "examples/gsm-tools/tasks.jsonl"
    rng = random.Random(20261205)
    seen = set()
    rows = []
    while len(rows) < 400:
        question, work, value = problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"id": f"gsm-tools-{len(rows):04d}", "question": question,
                     "answer": f"{work}\n#### {value}"})
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
