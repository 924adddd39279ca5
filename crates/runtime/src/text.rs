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

/// `text` whole if it fits in `max` bytes; else its head and tail, `max / 2` bytes each,
/// with a line between them saying how much was left out — what a tool's output shown to
/// an agent is cut with (the start says what ran, the end how it ended).
pub fn head_and_tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let half = max / 2;
    let (head, tail) = (head(text, half), tail(text, half));
    format!(
        "{head}\n[… {} characters left out …]\n{tail}",
        text.len() - head.len() - tail.len()
    )
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

    #[test]
    fn long_output_keeps_head_and_tail() {
        let text = "a".repeat(1000) + &"b".repeat(1000);
        let short = head_and_tail(&text, 200);
        assert!(short.starts_with(&"a".repeat(100)) && short.ends_with(&"b".repeat(100)));
        assert!(short.contains("1800 characters left out"));
        assert_eq!(head_and_tail("short", 200), "short");
    }
}
