from text_utils import is_palindrome

cases = {
    "": True,
    "a": True,
    "racecar": True,
    "RaceCar": True,
    "A man, a plan, a canal: Panama": True,
    "No 'x' in Nixon": True,
    "hello": False,
    "ab": False,
}
for text, want in cases.items():
    got = is_palindrome(text)
    assert got is want, f"is_palindrome({text!r}) = {got!r}, want {want!r}"
print("ok")
