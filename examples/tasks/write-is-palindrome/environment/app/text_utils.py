def is_palindrome(text):
    """Return True if text reads the same both ways, ignoring case and non-alphanumerics."""
    raise NotImplementedError
