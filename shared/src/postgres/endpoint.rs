//! Where a server is and how to reach it: its [`ServerKey`] (host and port), its TLS mode
//! and the CA its certificate must chain to.

use std::fmt;
use std::sync::Arc;

use dbops_api::TlsMode;

use super::tls;

/// Which server: host and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerKey {
    pub host: String,
    pub port: u16,
}

/// Where and how the controllers reach a server: its address and its TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub key: ServerKey,
    pub tls: TlsSettings,
}

impl Endpoint {
    /// `host:port` with `mode` and the system's roots (no CA of the server's own).
    pub fn new(host: impl Into<String>, port: u16, mode: TlsMode) -> Self {
        Self {
            key: ServerKey {
                host: host.into(),
                port,
            },
            tls: TlsSettings { mode, ca: None },
        }
    }
}

/// The TLS mode of a server and the CA its certificate must chain to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: TlsMode,
    /// The server's own CA (`ca.crt` of its CA Secret); the system's roots when `None`.
    pub ca: Option<CaBundle>,
}

/// A PEM CA bundle, checked to hold at least one usable certificate.
#[derive(Clone)]
pub struct CaBundle {
    pem: Arc<[u8]>,
    pub(super) roots: Arc<rustls::RootCertStore>,
}

impl CaBundle {
    /// Parses `pem`; refuses data without a usable certificate.
    pub fn from_pem(pem: &[u8]) -> Result<Self, String> {
        let roots = tls::roots_from_pem(pem)?;
        Ok(Self {
            pem: Arc::from(pem),
            roots,
        })
    }

    /// The PEM bytes (for `ca.crt` in a connection Secret and for pg_dump's root file).
    pub fn pem(&self) -> &[u8] {
        &self.pem
    }

    pub(super) fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.pem.hash(&mut h);
        h.finish()
    }
}

impl PartialEq for CaBundle {
    fn eq(&self, other: &Self) -> bool {
        self.pem == other.pem
    }
}

impl Eq for CaBundle {}

impl fmt::Debug for CaBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaBundle")
            .field("bytes", &self.pem.len())
            .finish_non_exhaustive()
    }
}

impl fmt::Display for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}
