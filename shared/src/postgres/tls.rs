//! TLS for the controllers' own PostgreSQL sessions, with libpq's `sslmode` meanings:
//!
//! | mode | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | - |
//! | `require` | always | not verified (the handshake's signatures are) |
//! | `verify-ca` | always | chain to a trusted root, any host name |
//! | `verify-full` | always | chain to a trusted root, and the host name |
//!
//! Trusted roots are the system's (read once per process, `rustls-native-certs`) unless a
//! CA of the server's own is given. Each failure has its own condition reason:
//! `CertificateNotTrusted` (no chain to a trusted root), `HostnameMismatch` (the
//! certificate is not for the host dbops connects to) and `ServerWithoutTLS` (TLS is
//! required and the server does not offer it).

use std::sync::{Arc, OnceLock};

use dbops_api::SharedReason;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the server's certificate is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Only the handshake's signatures (`require`).
    Nothing,
    /// The chain to a trusted root, whatever name the certificate is for (`verify-ca`).
    Chain,
    /// The chain to a trusted root and the host name (`verify-full`).
    ChainAndHost,
}

/// Why a TLS session could not be set up, sorted for a condition's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsFailure {
    CertificateNotTrusted,
    HostnameMismatch,
    ServerWithoutTls,
}

impl TlsFailure {
    /// The condition reason.
    pub fn reason(self) -> SharedReason {
        match self {
            TlsFailure::CertificateNotTrusted => SharedReason::CertificateNotTrusted,
            TlsFailure::HostnameMismatch => SharedReason::HostnameMismatch,
            TlsFailure::ServerWithoutTls => SharedReason::ServerWithoutTLS,
        }
    }

    /// What a user should know, before the technical detail.
    pub fn explain(self) -> &'static str {
        match self {
            TlsFailure::CertificateNotTrusted => {
                "the server's certificate does not chain to a trusted root"
            }
            TlsFailure::HostnameMismatch => {
                "the server's certificate is not valid for the host name dbops connects to"
            }
            TlsFailure::ServerWithoutTls => "TLS is required and the server does not offer it",
        }
    }

    /// Finds the TLS failure behind a connection error, if it is one.
    pub fn of(error: &(dyn std::error::Error + 'static)) -> Option<Self> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = cur {
            if let Some(found) = e.downcast_ref::<rustls::Error>().and_then(Self::of_rustls) {
                return Some(found);
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>()
                && let Some(inner) = io.get_ref()
                && let Some(found) = inner
                    .downcast_ref::<rustls::Error>()
                    .and_then(Self::of_rustls)
            {
                return Some(found);
            }
            // tokio-postgres says so in words only.
            if e.to_string().contains("server does not support TLS") {
                return Some(TlsFailure::ServerWithoutTls);
            }
            cur = e.source();
        }
        None
    }

    fn of_rustls(error: &rustls::Error) -> Option<Self> {
        match error {
            rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => Some(TlsFailure::HostnameMismatch),
            rustls::Error::InvalidCertificate(_) => Some(TlsFailure::CertificateNotTrusted),
            _ => None,
        }
    }
}

/// The process's crypto provider: ring, as everywhere else in the process.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The system's trusted roots, read once.
fn system_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            for error in &found.errors {
                tracing::warn!(%error, "a system root certificate could not be read");
            }
            let (added, ignored) = roots.add_parsable_certificates(found.certs);
            tracing::debug!(added, ignored, "system root certificates");
            Arc::new(roots)
        })
        .clone()
}

/// Roots from a PEM bundle (a server's own CA, `ca.crt`).
pub fn roots_from_pem(pem: &[u8]) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("not a PEM certificate: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("not a usable CA certificate: {e}"))?;
        count += 1;
    }
    if count == 0 {
        return Err("no certificate in the PEM data".into());
    }
    Ok(Arc::new(roots))
}

/// The connector for `verify`, trusting `roots` (the system's when `None`).
pub fn connector(
    verify: Verify,
    roots: Option<Arc<RootCertStore>>,
) -> Result<MakeRustlsConnect, rustls::Error> {
    let builder =
        ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let chain = || {
        WebPkiServerVerifier::builder_with_provider(roots.unwrap_or_else(system_roots), provider())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))
    };
    let config = match verify {
        Verify::ChainAndHost => builder.with_webpki_verifier(chain()?).with_no_client_auth(),
        Verify::Nothing | Verify::Chain => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Lenient {
                chain: (verify == Verify::Chain).then(chain).transpose()?,
                provider: provider(),
            }))
            .with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(config))
}

/// `sslmode=require` and `sslmode=verify-ca`: the handshake's signatures are checked as
/// in every mode. `require` accepts any certificate, as libpq without a root certificate
/// (the session is encrypted to whoever holds the certificate's key); `verify-ca`
/// verifies the chain as `verify-full` does and accepts a certificate for another name.
#[derive(Debug)]
struct Lenient {
    /// The chain's verifier (`verify-ca`); none for `require`.
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        // webpki checks the chain before the name, so a name error means a trusted chain.
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    // The signatures as WebPkiServerVerifier checks them: with the provider's algorithms.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_are_told_apart_by_their_cause() {
        let untrusted = std::io::Error::other(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
        assert_eq!(
            TlsFailure::of(&untrusted),
            Some(TlsFailure::CertificateNotTrusted)
        );
        let name = std::io::Error::other(rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName,
        ));
        assert_eq!(TlsFailure::of(&name), Some(TlsFailure::HostnameMismatch));
        let plain =
            std::io::Error::other("error performing TLS handshake: server does not support TLS");
        assert_eq!(TlsFailure::of(&plain), Some(TlsFailure::ServerWithoutTls));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(TlsFailure::of(&refused), None);
        assert_eq!(TlsFailure::HostnameMismatch.reason(), "HostnameMismatch");
    }

    #[test]
    fn a_ca_bundle_must_hold_a_certificate() {
        assert!(roots_from_pem(b"").is_err());
        assert!(
            roots_from_pem(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
                .is_err()
        );
    }

    #[test]
    fn every_mode_builds_a_connector() {
        assert!(connector(Verify::Nothing, None).is_ok());
        assert!(connector(Verify::Chain, None).is_ok());
        assert!(connector(Verify::ChainAndHost, None).is_ok());
    }
}
