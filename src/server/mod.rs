//! Process assembly: listeners and the Pingora server around the gateway's services.

pub mod conn;
pub mod frontdoor;
pub mod handover;
pub mod lifecycle;
pub mod listener;
pub mod notify;
pub mod workers;
