//! Byte-level marker search over upstream error bodies.
//!
//! Protects the classifier from bodies it cannot trust: they may be any bytes (not
//! UTF-8, truncated mid-character), so markers are matched as byte substrings, never by
//! decoding. Matching folds ASCII letters only (`A`–`Z` → `a`–`z`) on both sides, so
//! `"Quota Exceeded"` matches the marker `quota exceeded`; every other byte, including
//! all of a multi-byte UTF-8 sequence such as `额度不足`, must match exactly. Folding
//! ASCII never touches a byte ≥ 0x80, so it cannot corrupt UTF-8. Invariants: a
//! `Marker` is never empty (an empty marker would match every body), and at most
//! `MAX_SCAN_BYTES` of a body are ever searched, so the cost per marker is bounded
//! whatever the caller passes in. No Unicode case folding, no regular expressions.

use std::borrow::Cow;

/// How much of an error body is searched for markers (bodies are read bounded anyway).
pub const MAX_SCAN_BYTES: usize = 64 * 1024;

/// A non-empty, ASCII-lowercased needle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Marker(Box<[u8]>);

impl Marker {
    /// `None` for an empty marker.
    pub fn new(text: &str) -> Option<Marker> {
        if text.is_empty() {
            None
        } else {
            Some(Marker(
                text.as_bytes().to_ascii_lowercase().into_boxed_slice(),
            ))
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// An error body prepared once for many marker searches: cut to `MAX_SCAN_BYTES` and
/// ASCII-lowercased (borrowed when it has no upper-case ASCII letter).
#[derive(Clone, Debug)]
pub struct Haystack<'a> {
    bytes: Cow<'a, [u8]>,
}

impl<'a> Haystack<'a> {
    pub fn new(body: &'a [u8]) -> Haystack<'a> {
        let cut = body.get(..MAX_SCAN_BYTES).unwrap_or(body);
        let bytes = if cut.iter().any(u8::is_ascii_uppercase) {
            Cow::Owned(cut.to_ascii_lowercase())
        } else {
            Cow::Borrowed(cut)
        };
        Haystack { bytes }
    }

    /// Does the body contain this compiled marker?
    pub fn contains(&self, marker: &Marker) -> bool {
        find(&self.bytes, marker.as_bytes())
    }

    /// Does the body contain any of these compiled markers?
    pub fn contains_any(&self, markers: &[Marker]) -> bool {
        markers.iter().any(|m| self.contains(m))
    }

    /// Does the body contain any of these built-in markers? Each must already be
    /// lower-case ASCII where it is ASCII; an empty one never matches.
    pub fn contains_any_str(&self, lower_markers: &[&str]) -> bool {
        lower_markers
            .iter()
            .any(|m| !m.is_empty() && find(&self.bytes, m.as_bytes()))
    }
}

/// Plain substring search with a first-byte filter; `needle` is never empty here.
fn find(haystack: &[u8], needle: &[u8]) -> bool {
    let Some(&first) = needle.first() else {
        return false;
    };
    if needle.len() > haystack.len() {
        return false;
    }
    haystack
        .windows(needle.len())
        .any(|w| w.first() == Some(&first) && w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> Marker {
        Marker::new(s).unwrap()
    }

    #[test]
    fn ascii_letters_fold_both_ways() {
        let h = Haystack::new(b"Error: You EXCEEDED your current Quota.");
        assert!(h.contains(&m("exceeded your current quota")));
        assert!(h.contains(&m("EXCEEDED YOUR")));
        assert!(!h.contains(&m("billing")));
    }

    #[test]
    fn utf8_markers_match_as_bytes_even_in_invalid_utf8() {
        let mut body = vec![0xff, 0xfe, b'{'];
        body.extend_from_slice("{\"msg\":\"用户额度不足\"}".as_bytes());
        body.push(0xc3);
        let h = Haystack::new(&body);
        assert!(h.contains(&m("额度不足")));
        assert!(!h.contains(&m("无权访问模型")));
    }

    #[test]
    fn empty_markers_are_refused_and_never_match() {
        assert!(Marker::new("").is_none());
        assert!(!Haystack::new(b"abc").contains_any_str(&[""]));
        assert!(!Haystack::new(b"").contains(&m("a")));
    }

    #[test]
    fn only_the_first_64_kib_is_searched() {
        let mut body = vec![b'x'; MAX_SCAN_BYTES];
        body.extend_from_slice(b"banned");
        assert!(!Haystack::new(&body).contains(&m("banned")));
        body.truncate(MAX_SCAN_BYTES - 6);
        body.extend_from_slice(b"banned");
        assert!(Haystack::new(&body).contains(&m("banned")));
    }

    #[test]
    fn marker_at_both_ends_and_whole_body() {
        let h = Haystack::new(b"abc");
        assert!(h.contains(&m("ab")));
        assert!(h.contains(&m("bc")));
        assert!(h.contains(&m("abc")));
        assert!(!h.contains(&m("abcd")));
    }
}
