//! Process assembly: listeners and the Pingora server around the gateway's services.

pub mod client_stream;
pub mod frontdoor;
pub mod handover;
pub mod lifecycle;
pub mod listener;
pub mod notify;
pub mod workers;
