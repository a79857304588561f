//! Sluice's own HTTP/1 codec: parsing message heads, framing bodies and writing them back
//! (issue #9; docs/decisions.md "Sluice's own HTTP/1 codec").
//!
//! What it protects: the request path's CPU. Pingora's HTTP/1 sessions copy every header
//! into `http` maps with a case map beside them, clone them, and serialise them again;
//! here a head is the bytes as they arrived plus where each field is, looked up by a
//! case-insensitive scan, and written back by copying those bytes. The client side
//! (`server::conn`) and the upstream side (`proxy::h1`) both read and frame with it.
//!
//! Invariants:
//! - pure: no I/O, no clock — bytes in, heads, body pieces and errors out;
//! - a head is at most what its caller allows (the parser sees only that much), its
//!   fields at most [`head::MAX_FIELDS`]; a field is kept exactly as it was received
//!   (name case, order, repeats);
//! - body framing follows RFC 9112 §6: `Transfer-Encoding` wins over `Content-Length`
//!   (and then the connection is not reused), differing or malformed lengths are
//!   errors, and a body that ends before its framing says it is complete is an error,
//!   never a short body taken for a whole one.

pub mod body;
pub mod head;
pub mod names;
pub mod wire;

pub use body::{BodyError, BodyReader, Piece};
pub use head::{BodyLen, Head, HeadError, RequestHead, ResponseHead};
