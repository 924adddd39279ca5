#!/usr/bin/env python3
"""Writes examples/arithmetic/problems.jsonl: small arithmetic questions with GSM8K-style
answers (`#### N`), deterministic (seed 7), for `make run`'s learning demonstration.

SmolLM2-135M-Instruct often computes these right but rarely ends with the `#### N` line
the reward reads, so its reward starts low but not at zero, and GRPO can raise it within a
few steps on two CPU cores: it learns the answer format, and the answers with it.

    scripts/gen-arithmetic.py [COUNT]   (default 400)
"""
import json
import random
import sys
from pathlib import Path

count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
rng = random.Random(7)
out = Path(__file__).resolve().parent.parent / "examples" / "arithmetic" / "problems.jsonl"
rows = []
seen = set()
while len(rows) < count:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        value = a * b
    else:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b
    question = f"What is {a} {op} {b}?"
    if question in seen:
        continue
    seen.add(question)
    rows.append({"id": f"arith-{len(rows):04d}", "question": question,
                 "answer": f"{a} {op} {b} = {value}\n#### {value}"})
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{len(rows)} problems in {out}")
