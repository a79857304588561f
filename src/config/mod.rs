//! Configuration: raw YAML shapes → validated, typed `Config` (SPEC §6).
//!
//! The rest of the gateway only ever sees a `Config` that passed validation; a config
//! that fails is reported as a list of `Problem`s (file, field path, reason) and never
//! half-applied.

pub mod raw;
pub mod settings;
pub mod shape;
pub mod types;
pub mod units;
pub mod validate;

pub use types::*;
pub use validate::{load_file, parse_str, read_source, ConfigText, EnvLookup, Loaded, Problem};
