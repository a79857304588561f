//! Validation of a provider's transport settings (SPEC §6 providers `http2`, `tls`).
//!
//! What it protects: requests from TLS settings that would only fail at connect time.
//! Every file is read and parsed here, at load and at each reload, so a missing CA
//! file, a certificate without its key or a key that does not parse is a config error
//! with its field path (and a failed reload keeps the old config), never a failed
//! handshake on a request — nor a panic in the TLS layer, which unwraps the client key.

use super::{join, Validator};
use crate::config::raw::RawTls;
use crate::config::types::{BaseUrl, Http2, UpstreamTls};
use pingora::utils::tls::{CertKey, WrappedX509};
use std::sync::Arc;

impl Validator<'_> {
    pub(super) fn http2(&mut self, path: &str, raw: Option<&str>) -> Http2 {
        match raw.unwrap_or("auto") {
            "auto" => Http2::Auto,
            "on" => Http2::On,
            "off" => Http2::Off,
            other => {
                self.err(
                    &join(path, "http2"),
                    format!("{other:?} is not one of auto, on, off"),
                );
                Http2::Auto
            }
        }
    }

    pub(super) fn upstream_tls(
        &mut self,
        path: &str,
        raw: Option<RawTls>,
        url: &BaseUrl,
    ) -> UpstreamTls {
        let Some(raw) = raw else {
            return UpstreamTls::default();
        };
        let path = join(path, "tls");
        if !url.tls {
            self.err(&path, "TLS settings need an https:// base_url");
            return UpstreamTls::default();
        }
        let ca = raw.ca_file.as_ref().and_then(|f| {
            let field = join(&path, "ca_file");
            let certs = self.pem_certs(&field, f)?;
            let wrapped: Vec<WrappedX509> = certs
                .into_iter()
                .map(|der| WrappedX509::new(der, pingora::utils::tls::parse_x509))
                .collect();
            Some(Arc::from(wrapped.into_boxed_slice()))
        });
        let client = match (&raw.client_cert_file, &raw.client_key_file) {
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                self.err(
                    &path,
                    "client_cert_file and client_key_file go together (mutual TLS needs both)",
                );
                None
            }
            (Some(cert), Some(key)) => self.client_cert(&path, cert, key),
        };
        let verify = raw.verify.unwrap_or(true);
        if !verify {
            self.warn(
                &join(&path, "verify"),
                "false: the upstream's certificate is not checked (anyone on the path can read the keys sent to it)",
            );
        }
        let fingerprint = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for f in [&raw.ca_file, &raw.client_cert_file, &raw.client_key_file] {
                f.as_ref()
                    .and_then(|f| std::fs::read(self.base_dir.join(f)).ok())
                    .hash(&mut h);
            }
            verify.hash(&mut h);
            h.finish()
        };
        UpstreamTls {
            ca,
            client,
            verify,
            fingerprint,
        }
    }

    /// The DER certificates of the PEM file `file` (relative to the config's directory).
    fn pem_certs(&mut self, field: &str, file: &str) -> Option<Vec<Vec<u8>>> {
        let p = self.base_dir.join(file);
        let text = match std::fs::read(&p) {
            Ok(t) => t,
            Err(e) => {
                self.err(field, format!("cannot read {}: {e}", p.display()));
                return None;
            }
        };
        let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut text.as_slice()).collect();
        match certs {
            // Pingora parses each certificate again and panics on one that is not X.509.
            Ok(c)
                if c.iter()
                    .any(|d| x509_parser::parse_x509_certificate(d).is_err()) =>
            {
                self.err(
                    field,
                    format!("{}: a certificate is not valid X.509", p.display()),
                );
                None
            }
            Ok(c) if !c.is_empty() => Some(c.into_iter().map(|c| c.to_vec()).collect()),
            Ok(_) => {
                self.err(field, format!("{} holds no PEM certificate", p.display()));
                None
            }
            Err(e) => {
                self.err(field, format!("{}: {e}", p.display()));
                None
            }
        }
    }

    fn client_cert(&mut self, path: &str, cert: &str, key: &str) -> Option<Arc<CertKey>> {
        let certs = self.pem_certs(&join(path, "client_cert_file"), cert)?;
        let field = join(path, "client_key_file");
        let p = self.base_dir.join(key);
        let text = match std::fs::read(&p) {
            Ok(t) => t,
            Err(e) => {
                self.err(&field, format!("cannot read {}: {e}", p.display()));
                return None;
            }
        };
        let der = match rustls_pemfile::private_key(&mut text.as_slice()) {
            Ok(Some(k)) => k.secret_der().to_vec(),
            Ok(None) => {
                self.err(&field, format!("{} holds no PEM private key", p.display()));
                return None;
            }
            Err(e) => {
                self.err(&field, format!("{}: {e}", p.display()));
                return None;
            }
        };
        // The TLS layer converts the key per connection and panics if it cannot.
        if rustls_pki_types::PrivateKeyDer::try_from(der.clone()).is_err() {
            self.err(
                &field,
                format!("{}: not a PKCS#8, PKCS#1 or SEC1 key", p.display()),
            );
            return None;
        }
        Some(Arc::new(CertKey::new(certs, der)))
    }
}
