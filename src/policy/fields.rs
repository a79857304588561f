//! Read access to a message's header fields, whoever holds them: an `http` map (the
//! error path, HTTP/2, tests) or a head of Sluice's own HTTP/1 codec (the hot path),
//! so the policies that read a few named fields need neither to build a map.
//!
//! Names are asked for in lower case and matched in any case; the first value wins.

/// A message's header fields.
pub trait Fields {
    /// The first value of the field `name`, as received (surrounding spaces trimmed).
    fn field(&self, name: &str) -> Option<&[u8]>;

    /// [`Fields::field`] as text: `None` also when the value is not UTF-8.
    fn field_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.field(name)?).ok()
    }
}

impl Fields for http::HeaderMap {
    fn field(&self, name: &str) -> Option<&[u8]> {
        self.get(name).map(|v| v.as_bytes())
    }
}

impl Fields for crate::http1::Head {
    fn field(&self, name: &str) -> Option<&[u8]> {
        self.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::Fields;

    #[test]
    fn a_map_and_a_parsed_head_answer_alike() {
        let wire =
            b"HTTP/1.1 200 OK\r\nX-RateLimit-Remaining-Requests: 7\r\nx-a: 1\r\nX-A: 2\r\n\r\n";
        let head = crate::http1::head::parse_response(wire, wire.len())
            .unwrap()
            .unwrap();
        let map = head.to_header_map();
        for f in [&*head as &dyn Fields, &map as &dyn Fields] {
            assert_eq!(f.field_str("x-ratelimit-remaining-requests"), Some("7"));
            assert_eq!(f.field("x-a"), Some(&b"1"[..]));
            assert_eq!(f.field("absent"), None);
        }
    }
}
