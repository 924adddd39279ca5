//! Cutting text to a byte budget without splitting a character: what log tails, span
//! attributes, dead-letter reasons and agent observations are cut with.

/// At most `max` bytes from the start of `text`, ending at a character boundary.
pub fn head(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// At most `max` bytes from the end of `text`, starting at a character boundary.
pub fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_between_characters_and_respect_the_budget() {
        let text = "aé€😀z"; // 1 + 2 + 3 + 4 + 1 bytes
        assert_eq!(head(text, 0), "");
        assert_eq!(head(text, 2), "a");
        assert_eq!(head(text, 3), "aé");
        assert_eq!(head(text, 100), text);
        assert_eq!(tail(text, 1), "z");
        assert_eq!(tail(text, 4), "z");
        assert_eq!(tail(text, 5), "😀z");
        assert_eq!(tail(text, 100), text);
        for max in 0..=text.len() {
            assert!(head(text, max).len() <= max);
            assert!(tail(text, max).len() <= max);
        }
    }
}
