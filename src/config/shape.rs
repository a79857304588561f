//! A pre-parse guard for operator YAML (config and rule files).
//!
//! The YAML parser takes time quadratic in nesting depth before its own recursion
//! limit (128) refuses a document, so a few hundred KiB of `[[[[…` would stall
//! `sluice check`, startup and every reload for minutes. This guard runs first, in one
//! linear pass: a file over [`MAX_BYTES`], or nested deeper than [`MAX_DEPTH`] (flow
//! brackets outside quotes and comments, plus block levels opened on one line by
//! `- - -`), is refused before the parser sees it. Any document the parser would accept
//! is far inside both limits.

/// Largest config or rule file read.
pub const MAX_BYTES: usize = 4 << 20;
/// Deepest nesting accepted (the parser itself stops at 128).
pub const MAX_DEPTH: usize = 100;

/// Reads a regular file of at most `limit` bytes as text. Anything else (a FIFO, a
/// device such as `/dev/zero`, a larger file) is an error, never a hang or an
/// unbounded read.
pub fn read_file(path: &std::path::Path, limit: usize) -> std::io::Result<String> {
    use std::io::Read;
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit as u64 + 1)
        .read_to_string(&mut text)?;
    if text.len() > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(text)
}

/// `Err(reason)` when `text` is too large or too deeply nested to be parsed safely.
pub fn check(text: &str) -> Result<(), String> {
    if text.len() > MAX_BYTES {
        return Err(format!(
            "the file is {} bytes; at most {MAX_BYTES} are read",
            text.len()
        ));
    }
    let mut depth = 0usize;
    for line in text.lines() {
        let mut quote: Option<u8> = None;
        let mut at_start = true;
        let mut dashes = 0usize;
        let bytes = line.as_bytes();
        for (i, &b) in bytes.iter().enumerate() {
            if let Some(q) = quote {
                if b == q {
                    quote = None;
                }
                continue;
            }
            match b {
                b'#' if i == 0 || bytes[i - 1].is_ascii_whitespace() => break,
                b'"' | b'\'' => quote = Some(b),
                b'[' | b'{' => depth += 1,
                b']' | b'}' => depth = depth.saturating_sub(1),
                b'-' if at_start && bytes.get(i + 1).is_none_or(|c| *c == b' ') => dashes += 1,
                b' ' => {}
                _ => at_start = false,
            }
            if depth > MAX_DEPTH || dashes > MAX_DEPTH {
                return Err(format!(
                    "nested more than {MAX_DEPTH} levels deep (line {})",
                    text[..text
                        .len()
                        .min(line.as_ptr() as usize - text.as_ptr() as usize)]
                        .lines()
                        .count()
                        + 1
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_files_pass() {
        for text in [
            "a: [1, [2, {b: c}]]\n",
            "list:\n  - - x\n    - y\n",
            "s: \"[[[[[[\" # ]]]]\n",
            "url: http://x/#frag\n",
        ] {
            assert_eq!(check(text), Ok(()), "{text}");
        }
    }

    #[test]
    fn only_small_regular_files_are_read() {
        let dir = std::env::temp_dir().join(format!("sluice-shape-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("k");
        std::fs::write(&f, "0123456789").unwrap();
        assert_eq!(read_file(&f, 10).unwrap(), "0123456789");
        assert!(read_file(&f, 9).unwrap_err().to_string().contains("larger"));
        assert!(read_file(&dir, 100).is_err());
        assert!(read_file(std::path::Path::new("/dev/zero"), 100).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn deep_or_huge_files_are_refused() {
        assert!(check(&"[".repeat(101)).unwrap_err().contains("100 levels"));
        assert!(check(&format!("a: {}", "{".repeat(500))).is_err());
        assert!(check(&"- ".repeat(200)).is_err());
        assert!(check(&"a".repeat(MAX_BYTES + 1))
            .unwrap_err()
            .contains("bytes"));
        assert_eq!(check(&"[".repeat(100)), Ok(()));
    }
}
