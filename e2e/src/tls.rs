//! A certificate authority of the test bed's own, for PostgreSQL servers that speak TLS:
//! a CA and server certificates for chosen host names and addresses, as PEM.

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A CA that signs server certificates.
pub struct TestCa {
    key: KeyPair,
    params: CertificateParams,
    pem: String,
}

/// A server's certificate and its private key, PEM.
#[derive(Clone)]
pub struct ServerCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let pem = params.self_signed(&key)?.pem();
        Ok(Self { key, params, pem })
    }

    /// The CA certificate, PEM (what a client trusts: `ca.crt`).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A server certificate for these DNS names and IP addresses.
    pub fn server_cert(&self, dns: &[&str], ips: &[std::net::IpAddr]) -> Result<ServerCert> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(
            DnType::CommonName,
            dns.first().copied().unwrap_or("postgres"),
        );
        let mut sans = Vec::new();
        for name in dns {
            sans.push(SanType::DnsName((*name).try_into()?));
        }
        for ip in ips {
            sans.push(SanType::IpAddress(*ip));
        }
        params.subject_alt_names = sans;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(ServerCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}
