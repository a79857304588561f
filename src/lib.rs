//! Sluice: a resilient edge gateway for LLM APIs, built on Pingora.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod codes;
pub mod config;
pub mod engine;
pub mod error;
pub mod http1;
pub mod logging;
pub mod metrics;
pub mod mock;
pub mod policy;
pub mod proxy;
pub mod routing;
pub mod rules;
pub mod server;
pub mod sse;
pub mod store;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod test_net;
