//! Process assembly: listeners and the Pingora server around the gateway's services.

pub mod listener;
