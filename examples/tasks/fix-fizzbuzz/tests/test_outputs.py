from fizzbuzz import fizzbuzz

expected = {1: "1", 3: "Fizz", 5: "Buzz", 9: "Fizz", 10: "Buzz", 15: "FizzBuzz", 30: "FizzBuzz", 7: "7"}
for n, want in expected.items():
    got = fizzbuzz(n)
    assert got == want, f"fizzbuzz({n}) = {got!r}, want {want!r}"
print("ok")
