#!/usr/bin/env python3
"""Writes examples/arithmetic/tasks.jsonl: one-step word problems (addition and
subtraction of numbers up to 20) in GSM8K's format (`question`, `answer` ending `#### N`).

The family `make run` learns on: SmolLM2-135M-Instruct answers about one in five of them
greedily (the one-shot example in each question shows the `#### N` answer line), and GRPO
raises that within a few steps. Deterministic (fixed seed): run it again and the file is
byte-identical.
"""
import json
import random
import sys

NAMES = [("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he"),
         ("Mia", "she"), ("Omar", "he"), ("Zoe", "she"), ("Ravi", "he"), ("Nora", "she")]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "cards", "shells",
         "stamps", "coins"]
# The exemplar every question starts with: it shows the one-line answer and `#### N`.
SHOT = ("Q: Ella has 3 pens. She buys 4 more pens. How many pens does Ella have now?\n"
        "A: Ella has 3 + 4 = 7 pens.\n#### 7\n\nQ: {question}\nA:")


def problem(rng):
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    big, small = max(a, b) + 2, min(a, b)
    kind = rng.randrange(6)
    if kind == 0:
        q = f"{name} has {a} {item}. {he.capitalize()} buys {b} more {item}. How many {item} does {name} have now?"
        return q, f"{name} has {a} + {b} = {a + b} {item}.", a + b
    if kind == 1:
        q = f"There are {a} {item} in a box. {name} puts {b} more {item} in the box. How many {item} are in the box now?"
        return q, f"There are {a} + {b} = {a + b} {item} in the box.", a + b
    if kind == 2:
        q = f"{name} found {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} find in all?"
        return q, f"{name} found {a} + {b} = {a + b} {item}.", a + b
    if kind == 3:
        q = f"{name} has {big} {item}. {he.capitalize()} gives {small} {item} to a friend. How many {item} does {name} have left?"
        return q, f"{name} has {big} - {small} = {big - small} {item} left.", big - small
    if kind == 4:
        q = f"{name} had {big} {item} and lost {small} of them. How many {item} does {name} have now?"
        return q, f"{name} has {big} - {small} = {big - small} {item}.", big - small
    q = f"There were {big} {item} on a table. {name} took {small} of them. How many {item} are on the table now?"
    return q, f"There are {big} - {small} = {big - small} {item} on the table.", big - small


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "examples/arithmetic/tasks.jsonl"
    rng = random.Random(20261201)
    seen = set()
    rows = []
    while len(rows) < 640:
        question, work, value = problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"id": f"arith-{len(rows):04d}", "question": SHOT.format(question=question),
                     "answer": f"{work}\n#### {value}"})
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
