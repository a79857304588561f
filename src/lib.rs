//! Sluice: a resilient edge gateway for LLM APIs, built on Pingora.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cli;
pub mod config;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod policy;
pub mod mock;
pub mod proxy;
pub mod routing;
pub mod server;
