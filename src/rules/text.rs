//! Marker search over upstream error bodies.
//!
//! Protects the classifier from bodies it cannot trust: they may be any bytes (not
//! UTF-8, truncated mid-character, JSON cut in the middle of a string), so markers are
//! matched as byte substrings and nothing is ever parsed as a whole. A marker matches the
//! error text as a client would read it (SPEC §5.10): the raw bytes, and — when the body
//! has a backslash — the same bytes with JSON string escapes decoded (`\u7528\u6237` is
//! `用户`, surrogate pairs included; `\n`, `\"`, `\/` …), so an upstream that escapes its
//! non-ASCII text is restated and classified like one that does not. Matching folds
//! ASCII letters only (`A`–`Z` → `a`–`z`) on both sides, so `"Quota Exceeded"` matches
//! the marker `quota exceeded`; every other byte, including all of a multi-byte UTF-8
//! sequence such as `额度不足`, must match exactly. Folding ASCII never touches a byte ≥
//! 0x80, so it cannot corrupt UTF-8. Invariants: a `Marker` is never empty (an empty
//! marker would match every body), and at most `MAX_SCAN_BYTES` of a body are ever
//! searched (the decoded copy is never longer than that cut), so the cost per marker is
//! bounded whatever the caller passes in. No Unicode case folding, no regular
//! expressions.

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
/// ASCII-lowercased (borrowed when it has no upper-case ASCII letter), plus its
/// escape-decoded form when it has any escape to decode.
#[derive(Clone, Debug)]
pub struct Haystack<'a> {
    bytes: Cow<'a, [u8]>,
    decoded: Option<Vec<u8>>,
}

impl<'a> Haystack<'a> {
    pub fn new(body: &'a [u8]) -> Haystack<'a> {
        let cut = body.get(..MAX_SCAN_BYTES).unwrap_or(body);
        let bytes = if cut.iter().any(u8::is_ascii_uppercase) {
            Cow::Owned(cut.to_ascii_lowercase())
        } else {
            Cow::Borrowed(cut)
        };
        let decoded = bytes.contains(&b'\\').then(|| unescape(&bytes));
        Haystack { bytes, decoded }
    }

    /// Does the body contain this compiled marker, raw or decoded?
    pub fn contains(&self, marker: &Marker) -> bool {
        self.has(marker.as_bytes())
    }

    fn has(&self, needle: &[u8]) -> bool {
        find(&self.bytes, needle) || self.decoded.as_deref().is_some_and(|d| find(d, needle))
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
            .any(|m| !m.is_empty() && self.has(m.as_bytes()))
    }
}

/// `bytes` (already ASCII-lowercased) with JSON string escapes decoded, decoded ASCII
/// lowercased too. Anything that is not a complete escape (a backslash at the end of a
/// cut body, `\u` with fewer than four hex digits, an unknown letter) is copied as is; a
/// lone surrogate becomes U+FFFD. The output is never longer than the input: every
/// escape is at least as long as what it decodes to.
fn unescape(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        let simple = match bytes.get(i + 1) {
            Some(b'n') => Some(b'\n'),
            Some(b't') => Some(b'\t'),
            Some(b'r') => Some(b'\r'),
            Some(b'b') => Some(0x08),
            Some(b'f') => Some(0x0c),
            Some(&c @ (b'"' | b'\\' | b'/')) => Some(c),
            _ => None,
        };
        if let Some(c) = simple {
            out.push(c);
            i += 2;
        } else if let Some((ch, used)) = unicode_escape(&bytes[i..]) {
            let mut buf = [0u8; 4];
            out.extend_from_slice(ch.to_ascii_lowercase().encode_utf8(&mut buf).as_bytes());
            i += used;
        } else {
            out.push(b);
            i += 1;
        }
    }
    out
}

/// The character of a `\uXXXX` escape (or a `\uD8xx\uDCxx` surrogate pair) at the start
/// of `s`, and how many bytes it takes.
fn unicode_escape(s: &[u8]) -> Option<(char, usize)> {
    let unit = |at: usize| -> Option<u32> {
        if s.get(at..at + 2)? != b"\\u" {
            return None;
        }
        let hex = std::str::from_utf8(s.get(at + 2..at + 6)?).ok()?;
        if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(hex, 16).ok()
    };
    let hi = unit(0)?;
    match hi {
        0xd800..=0xdbff => match unit(6) {
            Some(lo @ 0xdc00..=0xdfff) => {
                let c = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
                Some((char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER), 12))
            }
            _ => Some((char::REPLACEMENT_CHARACTER, 6)),
        },
        0xdc00..=0xdfff => Some((char::REPLACEMENT_CHARACTER, 6)),
        _ => Some((char::from_u32(hi).unwrap_or(char::REPLACEMENT_CHARACTER), 6)),
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
    fn escaped_text_matches_like_the_text_it_stands_for() {
        // `用户额度不足` as a JSON encoder with ASCII output writes it.
        let body = br#"{"error":{"message":"\u7528\u6237\u989D\u5ea6\u4e0d\u8db3"}}"#;
        let h = Haystack::new(body);
        assert!(h.contains(&m("用户额度不足")));
        assert!(h.contains(&m("额度不足")));
        assert!(!h.contains(&m("无权访问模型")));
        // The raw form still matches too.
        assert!(h.contains(&m(r"\u7528")));
    }

    #[test]
    fn escapes_of_ascii_fold_and_simple_escapes_decode() {
        let h = Haystack::new(br#"{"m":"\u0051uota \"exceeded\"\nline\/x"}"#);
        assert!(h.contains(&m("quota \"exceeded\"")));
        assert!(h.contains(&m("\nline/x")));
    }

    #[test]
    fn surrogate_pairs_and_broken_escapes() {
        // U+1F600 as a surrogate pair; then a lone surrogate, a short escape, and a body
        // cut right after a backslash.
        let h = Haystack::new(br#""\ud83d\ude00 ok \udc00 \u12 end\"#);
        assert!(h.contains(&m("\u{1F600} ok \u{FFFD} \\u12 end\\")));
        let h = Haystack::new(br"\ud83d then");
        assert!(h.contains(&m("\u{FFFD} then")));
    }

    #[test]
    fn decoding_never_grows_the_body() {
        let body = r"\u0041\n\ud83d\ude00\u00e9\\".repeat(2000);
        let cut = &body.as_bytes()[..MAX_SCAN_BYTES.min(body.len())];
        assert!(unescape(cut).len() <= cut.len());
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

#[cfg(test)]
mod decode_props {
    //! Issue #8: escape decoding is total, never grows the body, and inverts JSON
    //! string escaping (both serde's and an ASCII-only encoder's).
    use super::*;
    use proptest::prelude::*;

    /// Escape-heavy byte soup: complete, partial and broken escapes among raw bytes.
    fn soup() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            proptest::sample::select(vec![
                "\\", "\\u", "\\U", "\\ud83d", "\\ude00", "\\udc00", "\\u00", "\\u0041", "\\n",
                "\\\"", "\\/", "\\x", "u", "D8", "0",
            ])
            .prop_map(|s| s.as_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..6),
        ];
        proptest::collection::vec(piece, 0..80).prop_map(|v| v.concat())
    }

    /// `s` with every character written as `\uXXXX` (surrogate pairs above the BMP).
    fn ascii_escaped(s: &str) -> String {
        let mut out = String::from("\"");
        let mut units = [0u16; 2];
        for c in s.chars() {
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04X}"));
            }
        }
        out.push('"');
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn decoding_is_total_and_never_grows(bytes in soup()) {
            let decoded = unescape(&bytes);
            prop_assert!(decoded.len() <= bytes.len());
            let hay = Haystack::new(&bytes);
            prop_assert!(hay.bytes.len() <= MAX_SCAN_BYTES);
            prop_assert_eq!(hay.decoded.is_some(), bytes.contains(&b'\\'));
            if let Some(d) = &hay.decoded {
                prop_assert!(d.len() <= hay.bytes.len());
            }
        }

        #[test]
        fn decoding_inverts_json_escaping(s in any::<String>()) {
            let want = format!("\"{}\"", s.to_ascii_lowercase()).into_bytes();
            for encoded in [serde_json::to_string(&s).unwrap(), ascii_escaped(&s)] {
                let lowered = encoded.to_ascii_lowercase();
                prop_assert_eq!(unescape(lowered.as_bytes()), want.clone(), "{:?}", encoded);
            }
        }
    }
}
