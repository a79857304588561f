//! systemd's readiness protocol (`sd_notify`), for `Type=notify` units.
//!
//! What it protects: the service manager's idea of which process is the gateway. After
//! a zero-downtime upgrade the successor is a new process; it tells systemd
//! `MAINPID=<its pid>` with `READY=1`, so the unit keeps running when the old process
//! exits (the unit needs `NotifyAccess=all`). A drain says `STOPPING=1`. Without
//! `NOTIFY_SOCKET` in the environment (not under systemd) every call does nothing, and a
//! failed send is only logged: notifying never stops the gateway.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (newline-separated `KEY=value` lines) to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|sock| {
        let path = path.to_string_lossy();
        match path.strip_prefix('@') {
            // An abstract socket name (Linux).
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
                sock.send_to_addr(state.as_bytes(), &addr)
            }
            None => sock.send_to(state.as_bytes(), &*path),
        }
    });
    if let Err(e) = sent {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

/// `READY=1` with this process as the unit's main process.
pub fn ready() {
    notify(&format!("READY=1\nMAINPID={}", std::process::id()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_reaches_the_notify_socket_with_our_pid() {
        let path = std::env::temp_dir().join(format!("sluice-notify-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).unwrap();
        // The variable is read per call; this test is the only one in the crate that sets it.
        std::env::set_var("NOTIFY_SOCKET", &path);
        ready();
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 256];
        listener
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            format!("READY=1\nMAINPID={}", std::process::id())
        );
        let _ = std::fs::remove_file(&path);
        notify("STOPPING=1"); // no socket set: nothing happens, nothing panics
    }
}
