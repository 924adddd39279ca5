//! Comparing secrets (lease tokens, bearer tokens) without leaking, through the time a
//! comparison takes, how much of a guess was right.

/// True when `presented` equals `expected`. Takes the same time for every `presented` of
/// a given length, wherever the first difference is; only the length can be learned.
pub fn same_secret(presented: &[u8], expected: &[u8]) -> bool {
    if presented.len() != expected.len() {
        return false;
    }
    let difference = presented
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    // Keeps the optimizer from turning the fold into an early-exit comparison.
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::same_secret;

    #[test]
    fn only_the_same_bytes_match() {
        assert!(same_secret(b"abc123", b"abc123"));
        assert!(same_secret(b"", b""));
        assert!(!same_secret(b"abc124", b"abc123"));
        assert!(!same_secret(b"bbc123", b"abc123"));
        assert!(!same_secret(b"abc12", b"abc123"));
        assert!(!same_secret(b"abc1234", b"abc123"));
    }
}
