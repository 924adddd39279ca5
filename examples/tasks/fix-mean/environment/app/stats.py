def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    total = 0
    for v in values[1:]:
        total += v
    return total / (len(values) - 1)
