//! Upstream transport (SPEC §6 providers `http2`, `tls`): a TLS upstream signed by a
//! private CA works with `tls.ca_file` and speaks HTTP/2 when it offers it by ALPN; an
//! untrusted certificate is a 502 whose reason names TLS and why; mutual TLS presents
//! the configured client certificate. Every certificate is made here, by `rcgen`.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::{server_section, Gateway, TempDir};
use common::{open_stream, parse_sse, Mock};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use std::path::{Path, PathBuf};

/// A CA and what it signed, as PEM files in a temp dir.
struct Pki {
    dir: TempDir,
    ca: Certificate,
    ca_key: KeyPair,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = TempDir::new("sluice-pki");
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca_key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.0.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.0.join("ca.pem")
    }

    /// Signs a certificate for `names` with `usage`; returns (cert file, key file).
    fn issue(
        &self,
        file: &str,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let (c, k) = (
            self.dir.0.join(format!("{file}.pem")),
            self.dir.0.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A TLS mock with a certificate for 127.0.0.1 from `pki`, plus `extra` arguments.
fn tls_mock(pki: &Pki, extra: &[&str]) -> Mock {
    let (cert, key) = pki.issue(
        "server",
        &["127.0.0.1", "localhost"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let mut args = vec!["--tls-cert", path(&cert), "--tls-key", path(&key)];
    args.extend_from_slice(extra);
    Mock::start(&args)
}

fn config(mock: &Mock, provider_extra: &str) -> String {
    format!(
        "{}providers:
  - id: p
    base_url: \"https://{}\"
    api: openai
{provider_extra}    connections:
      - {{ id: c, api_key_env: KEY }}
models:
  - name: m
    cooldown_wait: false
    targets:
      - {{ provider: p, model: up }}
",
        server_section(""),
        mock.addr
    )
}

const KEY: &[(&str, &str)] = &[("KEY", "tls-key")];
const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

#[test]
fn a_private_ca_upstream_works_with_ca_file_over_http1() {
    let pki = Pki::new("Sluice Test CA");
    let mock = tls_mock(&pki, &[]);
    let gw = Gateway::start(
        &config(
            &mock,
            &format!("    tls: {{ ca_file: \"{}\" }}\n", path(&pki.ca_file())),
        ),
        KEY,
    );
    for _ in 0..3 {
        let r = gw.chat(CHAT);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-mock-http"),
            None,
            "the mock offers no h2: HTTP/1.1"
        );
    }
}

#[test]
fn a_tls_upstream_that_offers_http2_gets_it_multiplexed() {
    let pki = Pki::new("Sluice Test CA");
    let mock = tls_mock(&pki, &["--h2", "--chunks", "3", "--chunk-interval", "10ms"]);
    let gw = Gateway::start(
        &config(
            &mock,
            &format!("    tls: {{ ca_file: \"{}\" }}\n", path(&pki.ca_file())),
        ),
        KEY,
    );
    let r = gw.chat(CHAT);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-http"), Some("2"), "ALPN should pick h2");
    let mut s = open_stream(
        gw.client,
        "POST",
        "/v1/chat/completions",
        &[],
        br#"{"model":"m","stream":true,"messages":[]}"#,
    );
    assert_eq!(s.status, 200);
    assert_eq!(s.header("x-mock-http"), Some("2"));
    let events = parse_sse(&s.read_to_end(std::time::Duration::from_secs(10)));
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    // Concurrent requests share the HTTP/2 connection (no error from stream limits).
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let client = gw.client;
            std::thread::spawn(move || {
                common::request(
                    client,
                    "POST",
                    "/v1/chat/completions",
                    &[("content-type", "application/json")],
                    CHAT.as_bytes(),
                )
                .status
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 200);
    }
    // `http2: off` keeps the same upstream on HTTP/1.1.
    let h1 = Gateway::start(
        &config(
            &mock,
            &format!(
                "    http2: off\n    tls: {{ ca_file: \"{}\" }}\n",
                path(&pki.ca_file())
            ),
        ),
        KEY,
    );
    let r = h1.chat(CHAT);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-http"), None);
}

#[test]
fn an_untrusted_certificate_is_a_502_whose_reason_names_tls() {
    let pki = Pki::new("Unknown CA");
    let mock = tls_mock(&pki, &[]);
    let mut gw = Gateway::start_logged(
        &config(&mock, ""),
        &[("KEY", "tls-key"), ("SLUICE_LOG", "info")],
    );
    let r = gw.chat(CHAT);
    assert_eq!(r.status, 502, "{}", r.text());
    let attempt = &r.json()["error"]["diagnostics"]["attempts"][0];
    assert_eq!(attempt["reason"], "tls", "{}", r.text());
    let detail = attempt["detail"]
        .as_str()
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(
        detail.contains("certificate") || detail.contains("issuer"),
        "{detail}"
    );
    assert_eq!(
        gw.metric(r#"sluice_attempts_total{connection="c",outcome="tls",provider="p"}"#),
        Some(1.0)
    );
    assert!(
        common::wait_until(std::time::Duration::from_secs(5), || gw
            .log()
            .contains(":tls:")),
        "{}",
        gw.log()
    );
    gw.proc.kill();
}

#[test]
fn mutual_tls_presents_the_configured_client_certificate() {
    let server_pki = Pki::new("Server CA");
    let client_pki = Pki::new("Client CA");
    let mock = tls_mock(
        &server_pki,
        &["--tls-client-ca", path(&client_pki.ca_file())],
    );
    let ca = path(&server_pki.ca_file()).to_owned();
    // Without a client certificate the upstream refuses the handshake.
    let anonymous = Gateway::start(
        &config(&mock, &format!("    tls: {{ ca_file: \"{ca}\" }}\n")),
        KEY,
    );
    let r = anonymous.chat(CHAT);
    assert_eq!(r.status, 502, "{}", r.text());
    // TLS 1.3 finishes the client's handshake before the server checks its certificate:
    // the refusal arrives as an alert or a closed connection on the first write.
    let reason = r.json()["error"]["diagnostics"]["attempts"][0]["reason"].clone();
    assert!(reason == "tls" || reason == "reset", "{}", r.text());
    let (cert, key) = client_pki.issue("gateway", &[], ExtendedKeyUsagePurpose::ClientAuth);
    let gw = Gateway::start(
        &config(
            &mock,
            &format!(
                "    tls: {{ ca_file: \"{ca}\", client_cert_file: \"{}\", client_key_file: \"{}\" }}\n",
                path(&cert),
                path(&key)
            ),
        ),
        KEY,
    );
    let r = gw.chat(CHAT);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn verify_false_connects_to_any_certificate_and_warns() {
    let pki = Pki::new("Unknown CA");
    let mock = tls_mock(&pki, &[]);
    let gw = Gateway::start_logged(
        &config(&mock, "    tls: { verify: false }\n"),
        &[("KEY", "tls-key"), ("SLUICE_LOG", "warn")],
    );
    let r = gw.chat(CHAT);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(gw.log().contains("providers[0].tls.verify"), "{}", gw.log());
}

#[test]
fn broken_tls_files_are_config_errors_with_their_paths() {
    let pki = Pki::new("Sluice Test CA");
    let mock = Mock::start(&[]);
    let dir = TempDir::new("sluice-tls-check");
    let not_pem = dir.0.join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let (cert, _) = pki.issue("client", &[], ExtendedKeyUsagePurpose::ClientAuth);
    let cases = [
        (
            format!("    tls: {{ ca_file: \"{}/missing.pem\" }}\n", path(&dir.0)),
            "providers[0].tls.ca_file",
        ),
        (
            format!("    tls: {{ ca_file: \"{}\" }}\n", path(&not_pem)),
            "providers[0].tls.ca_file",
        ),
        (
            format!("    tls: {{ client_cert_file: \"{}\" }}\n", path(&cert)),
            "providers[0].tls",
        ),
        (
            format!(
                "    tls: {{ client_cert_file: \"{}\", client_key_file: \"{}\" }}\n",
                path(&cert),
                path(&not_pem)
            ),
            "providers[0].tls.client_key_file",
        ),
        ("    http2: sometimes\n".to_owned(), "providers[0].http2"),
    ];
    for (extra, field) in cases {
        let yaml = config(&mock, &extra).replace("@DIR@", path(&dir.0));
        let file = dir.0.join("c.yaml");
        std::fs::write(&file, yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config", path(&file)])
            .env("KEY", "k")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra}: {text}");
        assert!(text.contains(field), "{extra}: expected {field} in {text}");
    }
    // TLS settings on a plain http:// upstream are an error too.
    let plain = config(&mock, "    tls: { verify: false }\n")
        .replace("https://", "http://")
        .replace("@DIR@", path(&dir.0));
    let file = dir.0.join("plain.yaml");
    std::fs::write(&file, plain).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", path(&file)])
        .env("KEY", "k")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("https://"));
}
