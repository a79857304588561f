//! Header names compared without regard to case: fixed sets of names, asked per field of
//! every head that crosses the gateway (the fields stripped on the way upstream and
//! back), and the comparison of two names that a head's lookups use.
//!
//! What it protects: the request path's CPU. A field is compared only with the set's
//! names of its own length — usually none or one — where a walk of the whole list
//! looked at every name for every field (19 on the way upstream), and names are
//! compared eight bytes at a time instead of one.
//!
//! Invariants: membership is exactly "equal to one of the names, ignoring ASCII case",
//! and [`eq_ignore_case`] agrees with `<[u8]>::eq_ignore_ascii_case` on every input;
//! a set's names are given lower-case and 1 to [`MAX_NAME`] bytes long, which the
//! constructor checks when the set is built (at compile time for a `const`).

/// The longest name a set may hold.
pub const MAX_NAME: usize = 40;

/// A set of lower-case header names, grouped by length.
pub struct NameSet<const N: usize> {
    /// The names, shortest first.
    names: [&'static str; N],
    /// `names[at[l]..at[l + 1]]` are the names `l` bytes long.
    at: [u8; MAX_NAME + 2],
}

impl<const N: usize> NameSet<N> {
    /// The set of `names`, which must be lower-case ASCII, 1 to [`MAX_NAME`] bytes long,
    /// fewer than 256 of them.
    pub const fn new(names: [&'static str; N]) -> Self {
        assert!(N < 256, "a name set holds fewer than 256 names");
        let mut names = names;
        let mut i = 0;
        while i < N {
            let b = names[i].as_bytes();
            assert!(
                !b.is_empty() && b.len() <= MAX_NAME,
                "a header name is 1 to MAX_NAME bytes"
            );
            let mut k = 0;
            while k < b.len() {
                assert!(
                    b[k].is_ascii() && !b[k].is_ascii_uppercase(),
                    "header names are given lower-case"
                );
                k += 1;
            }
            // Insertion by length: the names before `i` are in order already.
            let mut j = i;
            while j > 0 && names[j - 1].len() > names[j].len() {
                let t = names[j - 1];
                names[j - 1] = names[j];
                names[j] = t;
                j -= 1;
            }
            i += 1;
        }
        let mut at = [0u8; MAX_NAME + 2];
        let mut len = 0;
        let mut next = 0;
        while len <= MAX_NAME + 1 {
            at[len] = next as u8;
            while next < N && names[next].len() == len {
                next += 1;
            }
            len += 1;
        }
        Self { names, at }
    }

    /// Whether `name` is one of the set's, in any case.
    pub fn contains(&self, name: &[u8]) -> bool {
        let len = name.len();
        if len > MAX_NAME {
            return false;
        }
        let same_length = &self.names[self.at[len] as usize..self.at[len + 1] as usize];
        same_length
            .iter()
            .any(|n| eq_ignore_case(name, n.as_bytes()))
    }
}

/// Whether `a` and `b` are equal ignoring ASCII case, as `<[u8]>::eq_ignore_ascii_case`,
/// eight bytes at a time (a byte-by-byte fold costs ~12 instructions per byte, and
/// `content-length` is 14 bytes). Past the whole words, the last eight bytes are
/// compared again as one word, overlapping; four to seven bytes are two overlapping
/// halves of one word.
#[inline]
pub fn eq_ignore_case(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n >= 8 {
        let mut at = 0;
        while at + 8 <= n {
            if fold_word(load(a, at, 8)) != fold_word(load(b, at, 8)) {
                return false;
            }
            at += 8;
        }
        return at == n || fold_word(load(a, n - 8, 8)) == fold_word(load(b, n - 8, 8));
    }
    if n >= 4 {
        let halves = |s: &[u8]| load(s, 0, 4) | load(s, n - 4, 4) << 32;
        return fold_word(halves(a)) == fold_word(halves(b));
    }
    a.eq_ignore_ascii_case(b)
}

/// The `len` (at most eight) bytes of `s` from `at`, little-endian.
#[inline]
fn load(s: &[u8], at: usize, len: usize) -> u64 {
    let mut w = [0u8; 8];
    w[..len].copy_from_slice(&s[at..at + len]);
    u64::from_le_bytes(w)
}

/// The eight bytes of `w` with every ASCII capital made small, every other byte kept.
#[inline]
fn fold_word(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Each byte below 0x80, so the sums below never carry into the next byte.
    let low = w & !HIGH;
    // High bit set in the bytes at or past 'A', and in those past 'Z'.
    let from_a = low + ONES * (0x80 - u64::from(b'A'));
    let past_z = low + ONES * (0x80 - u64::from(b'Z') - 1);
    // 'A'..='Z', and not a byte at 0x80 or above that only looked like one.
    let capital = from_a & !past_z & !w & HIGH;
    w | (capital >> 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SET: NameSet<6> =
        NameSet::new(["te", "host", "x-api-key", "expect", "trailer", "upgrade"]);

    #[test]
    fn a_name_is_found_in_any_case_and_only_when_it_is_in_the_set() {
        for n in [
            "te",
            "TE",
            "Host",
            "x-API-key",
            "EXPECT",
            "Trailer",
            "upgrade",
        ] {
            assert!(SET.contains(n.as_bytes()), "{n}");
        }
        // Same lengths as members, and longer, shorter, empty, past the longest kept.
        for n in [
            "tf",
            "hast",
            "x-api-kez",
            "accept",
            "trailed",
            "",
            "t",
            "hosts",
        ] {
            assert!(!SET.contains(n.as_bytes()), "{n}");
        }
        assert!(!SET.contains(&[b'a'; MAX_NAME + 1]));
        assert!(!SET.contains(&[b'a'; 1000]));
    }

    #[test]
    fn membership_agrees_with_a_walk_of_the_list() {
        let list = [
            "content-length",
            "te",
            "connection",
            "keep-alive",
            "x-a",
            "x-b",
            "te-x",
        ];
        let set = NameSet::new(list);
        let probes = [
            "Content-Length",
            "content-lengtH",
            "connection",
            "Keep-Alive",
            "keep-alivE",
            "keep-alivf",
            "X-A",
            "x-c",
            "TE-X",
            "te",
            "",
            "c",
        ];
        for p in probes {
            let walked = list.iter().any(|n| p.eq_ignore_ascii_case(n));
            assert_eq!(set.contains(p.as_bytes()), walked, "{p}");
        }
    }

    #[test]
    fn case_is_ignored_exactly_as_the_standard_library_does() {
        // At each place of a word and of the tail, every byte value against itself, its
        // other case and the bytes next to the capitals and the small letters, with
        // neighbours that would show a carry from one byte into the next.
        for len in [1usize, 3, 4, 5, 7, 8, 9, 15, 16, 19] {
            for at in 0..len {
                for x in 0..=255u8 {
                    for y in [
                        x,
                        x ^ 0x20,
                        x.to_ascii_lowercase(),
                        x.to_ascii_uppercase(),
                        0x40,
                        0x5b,
                        0x60,
                        0x7b,
                        0xc1,
                        0xe1,
                    ] {
                        for (fill_a, fill_b) in [
                            (b'k', b'K'),
                            (b'@', b'@'),
                            (b'Z', b'z'),
                            (b'[', b'['),
                            (b'`', b'`'),
                            (0xff, 0xff),
                        ] {
                            let mut a = vec![fill_a; len];
                            let mut b = vec![fill_b; len];
                            a[at] = x;
                            b[at] = y;
                            assert_eq!(
                                eq_ignore_case(&a, &b),
                                a.eq_ignore_ascii_case(&b),
                                "{a:?} {b:?}"
                            );
                        }
                    }
                }
            }
        }
        assert!(eq_ignore_case(b"Content-Length", b"content-length"));
        assert!(!eq_ignore_case(b"Content-Length", b"content-lengthx"));
        assert!(eq_ignore_case(b"", b""));
    }

    #[test]
    fn names_of_every_allowed_length_are_found() {
        let long: &'static str = "abcdefghijklmnopqrstuvwxyzabcdefghijklmn";
        assert_eq!(long.len(), MAX_NAME);
        let set = NameSet::new([&long[..MAX_NAME], &long[..1], &long[..17]]);
        assert!(set.contains(long.to_ascii_uppercase().as_bytes()));
        assert!(set.contains(b"A"));
        assert!(set.contains(&long.as_bytes()[..17]));
        assert!(!set.contains(&long.as_bytes()[..16]));
    }
}
