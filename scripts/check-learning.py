#!/usr/bin/env python3
"""check-learning.py STATUS.json — did the run learn? Reads `arl run status --json` and
checks what `make run` promises (issue 19): no trial failed as infrastructure, every step
trained on > 0 samples with grad_norm > 0, the last step's mean reward is above step 1's,
and the final validation beats the one before training. Prints each check; exits 1 if
one fails."""
import json
import sys


def main():
    state = json.load(open(sys.argv[1]))
    steps = state.get("steps", [])
    evals = state.get("evaluations", [])
    checks = []

    def check(ok, what):
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {what}")

    check(state.get("status") == "completed", f"run completed (status {state.get('status')})")
    infra = state.get("failures", {}).get("infrastructure", 0)
    check(infra == 0, f"no infrastructure failures ({infra})")
    check(len(steps) == state.get("total_steps"), f"{len(steps)} of {state.get('total_steps')} steps")
    for s in steps:
        trained = (s.get("batch") or {}).get("samples_trained", 0)
        check(trained > 0 and s["grad_norm"] > 0,
              f"step {s['step']}: {trained} samples trained, grad_norm {s['grad_norm']:.4f}")
    if steps:
        first, last = steps[0]["reward_mean"], steps[-1]["reward_mean"]
        check(last > first, f"mean reward rose: step 1 {first:.3f} -> step {steps[-1]['step']} {last:.3f}")
    if len(evals) >= 2:
        before, after = evals[0], evals[-1]
        check(after["resolution_rate"] > before["resolution_rate"],
              f"validation rose: {before['resolution_rate']:.3f} at step {before['step']} -> "
              f"{after['resolution_rate']:.3f} at step {after['step']}")
    else:
        check(False, f"validation before and after training ({len(evals)} evaluations)")
    sys.exit(0 if all(checks) else 1)


if __name__ == "__main__":
    main()
