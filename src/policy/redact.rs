//! Masking of configured credential values (SPEC §3 secrets).
//!
//! An upstream may echo the key it was sent (in an error message, a header): whatever
//! Sluice passes on to a client or keeps — a held error body and its headers, a
//! cooldown or terminal reason, admin output — goes through a [`Redactor`] built from
//! the generation's credentials first. Invariants: every occurrence of every configured
//! value is replaced by [`MASK`]; text without one is returned untouched (no copy);
//! values shorter than [`MIN_SECRET`] bytes are not searched for (they would mask
//! ordinary words, and no provider issues keys that short).

use aho_corasick::{AhoCorasick, MatchKind};
use std::borrow::Cow;

/// What a masked value reads as.
pub const MASK: &str = "[redacted]";
/// Shorter values are not masked.
pub const MIN_SECRET: usize = 8;
/// A cut-off tail this long or longer that starts a value is dropped.
const MIN_PARTIAL: usize = 4;

/// The credential values of one config generation, ready to mask.
#[derive(Debug, Default)]
pub struct Redactor {
    finder: Option<AhoCorasick>,
    values: Vec<Box<[u8]>>,
}

impl Redactor {
    pub fn new<'a>(values: impl IntoIterator<Item = &'a str>) -> Redactor {
        let mut values: Vec<&str> = values
            .into_iter()
            .filter(|v| v.len() >= MIN_SECRET)
            .collect();
        values.sort_unstable();
        values.dedup();
        if values.is_empty() {
            return Redactor::default();
        }
        let finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&values)
            .ok();
        let values = values.iter().map(|v| v.as_bytes().into()).collect();
        Redactor { finder, values }
    }

    /// `input` masked, then cut to at most `limit` bytes; a tail that could be the start
    /// of a value cut off by the limit (or by the read that stopped there) is dropped
    /// too, so no prefix of a credential survives a cut.
    pub fn bytes_within(&self, input: &[u8], limit: usize) -> Vec<u8> {
        let mut out = self.bytes(input).into_owned();
        out.truncate(limit);
        let cut = self
            .values
            .iter()
            .filter_map(|v| {
                (MIN_PARTIAL..v.len())
                    .rev()
                    .find(|&k| out.ends_with(&v[..k]))
            })
            .max()
            .unwrap_or(0);
        out.truncate(out.len() - cut);
        out
    }

    /// `input` with every credential masked (borrowed when there was none).
    pub fn bytes<'a>(&self, input: &'a [u8]) -> Cow<'a, [u8]> {
        match &self.finder {
            Some(f) if f.is_match(input) => {
                let masks = vec![MASK.as_bytes(); f.patterns_len()];
                Cow::Owned(f.replace_all_bytes(input, &masks))
            }
            _ => Cow::Borrowed(input),
        }
    }

    /// Text version of [`Redactor::bytes`].
    pub fn text<'a>(&self, input: &'a str) -> Cow<'a, str> {
        match &self.finder {
            Some(f) if f.is_match(input) => {
                let masks = vec![MASK; f.patterns_len()];
                Cow::Owned(f.replace_all(input, &masks))
            }
            _ => Cow::Borrowed(input),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn masks_every_occurrence_of_every_value() {
        let r = Redactor::new(["sk-test-AAAA1111", "other-key-2222", "short"]);
        let out = r.text(
            r#"{"error":"bad key sk-test-AAAA1111 (sk-test-AAAA1111), other-key-2222; short"}"#,
        );
        assert_eq!(
            out,
            r#"{"error":"bad key [redacted] ([redacted]), [redacted]; short"}"#
        );
        assert!(matches!(r.text("nothing here"), Cow::Borrowed(_)));
        assert!(matches!(
            Redactor::new([]).bytes(b"sk-test-AAAA1111"),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn a_cut_never_leaves_the_start_of_a_value() {
        let r = Redactor::new(["sk-live-ABCDEFGH"]);
        assert_eq!(
            r.bytes_within(b"error: key sk-live-ABCDEFGH", 17),
            b"error: key [redac"
        );
        assert_eq!(r.bytes_within(b"error: key sk-li", 64), b"error: key ");
        // three bytes are not taken for a credential
        assert_eq!(r.bytes_within(b"error: sk-", 64), b"error: sk-");
        assert_eq!(r.bytes_within(b"fine", 64), b"fine");
    }

    #[test]
    fn a_value_inside_a_longer_one_masks_the_longer_whole() {
        let r = Redactor::new(["abcdefgh", "abcdefgh-and-more"]);
        assert_eq!(r.text("x abcdefgh-and-more y"), "x [redacted] y");
    }

    proptest! {
        #[test]
        fn no_secret_survives(prefix in ".{0,40}", suffix in ".{0,40}", key in "[A-Za-z0-9_-]{8,40}") {
            prop_assume!(!MASK.contains(key.as_str()));
            let r = Redactor::new([key.as_str()]);
            let out = r.text(&format!("{prefix}{key}{suffix}{key}")).into_owned();
            prop_assert!(!out.contains(&key));
        }
    }
}
