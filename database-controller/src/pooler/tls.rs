//! The pooler's serving certificate: self-signed for the names of its Service, made once
//! and kept in its Secret; the connection Secrets carry it as `pooler-ca.crt`, so clients
//! verify the pooler (`sslmode=verify-full`) against it and nothing else.

/// A certificate and its private key (PEM) for Service `name` in `namespace`, by every
/// name a client in the cluster may use for it.
pub fn serving_certificate(name: &str, namespace: &str) -> Result<(String, String), String> {
    let names = vec![
        name.to_string(),
        format!("{name}.{namespace}"),
        format!("{name}.{namespace}.svc"),
        format!("{name}.{namespace}.svc.cluster.local"),
    ];
    let made = rcgen::generate_simple_self_signed(names)
        .map_err(|e| format!("making the pooler's certificate: {e}"))?;
    Ok((made.cert.pem(), made.signing_key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_and_key_for_the_services_names() {
        let (cert, key) = serving_certificate("dbops-pooler-pg-main", "dbops-system").unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(key.contains("PRIVATE KEY"));
        let (again, _) = serving_certificate("dbops-pooler-pg-main", "dbops-system").unwrap();
        assert_ne!(cert, again, "a new key each time: made once, then kept");
    }
}
