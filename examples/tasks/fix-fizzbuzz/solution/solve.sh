#!/usr/bin/env bash
# Reference solution: check the combined case first.
set -eu
cd "${APP_DIR:-/app}"
cat > fizzbuzz.py <<'PY'
def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


if __name__ == "__main__":
    print(" ".join(fizzbuzz(i) for i in range(1, 16)))
PY
