//! Socket helpers shared by the unit tests of the connection code (tests only).

use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// A connected loopback pair: (the connecting side, the accepted side).
pub async fn loopback() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (s, _) = l.accept().await.unwrap();
    (c, s)
}

/// True when nothing arrives on `s` for 50 ms: a send that should not have happened.
pub async fn nothing_to_read(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    tokio::time::timeout(Duration::from_millis(50), s.read(&mut b))
        .await
        .is_err()
}
