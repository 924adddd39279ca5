from stats import mean

assert mean([1, 2, 3, 4]) == 2.5, mean([1, 2, 3, 4])
assert mean([5]) == 5
assert mean([-1, 1]) == 0
try:
    mean([])
except ValueError:
    pass
else:
    raise AssertionError("mean([]) must raise ValueError")
print("ok")
