#!/usr/bin/env bash
set -eu
cd "${APP_DIR:-/app}"
cat > text_utils.py <<'PY'
def is_palindrome(text):
    """Return True if text reads the same both ways, ignoring case and non-alphanumerics."""
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]
PY
