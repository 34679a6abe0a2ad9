//! The pooler's serving certificate: the one the platform names (`spec.pooler.
//! certificateSecretRef`, with the CA clients verify it against), or one self-signed for
//! the names of its Service, made once and kept in its Secret; the connection Secrets
//! carry the CA (or the self-signed certificate) as `pooler-ca.crt`, so clients verify
//! the pooler (`sslmode=verify-full`) against it and nothing else.

use k8s_openapi::api::core::v1::Secret;

/// The certificate, key and client CA (PEM) of the Secret `name` the platform named, or
/// why it cannot serve: missing, without `tls.crt` or `tls.key`, or not PEM.
pub fn named_certificate(
    secret: Option<&Secret>,
    name: &str,
) -> Result<(String, String, String), String> {
    let secret = secret.ok_or_else(|| {
        format!("spec.pooler.certificateSecretRef: no Secret {name} in the controllers' namespace")
    })?;
    let value = |key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
            .filter(|v| !v.trim().is_empty())
    };
    let (Some(cert), Some(key)) = (value("tls.crt"), value("tls.key")) else {
        return Err(format!(
            "spec.pooler.certificateSecretRef: Secret {name} lacks tls.crt or tls.key"
        ));
    };
    let ca = value("ca.crt").unwrap_or_else(|| cert.clone());
    if !cert.contains("-----BEGIN CERTIFICATE-----")
        || !ca.contains("-----BEGIN CERTIFICATE-----")
        || !key.contains("PRIVATE KEY-----")
    {
        return Err(format!(
            "spec.pooler.certificateSecretRef: Secret {name} does not hold PEM (tls.crt, tls.key, ca.crt)"
        ));
    }
    Ok((cert, key, ca))
}

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

    #[test]
    fn a_named_certificate_needs_a_cert_and_a_key_in_pem() {
        let (cert, key) = serving_certificate("p", "ns").unwrap();
        let secret = |pairs: &[(&str, &str)]| Secret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            k8s_openapi::ByteString(v.as_bytes().to_vec()),
                        )
                    })
                    .collect(),
            ),
            ..Default::default()
        };
        let full = secret(&[("tls.crt", &cert), ("tls.key", &key), ("ca.crt", &cert)]);
        assert_eq!(
            named_certificate(Some(&full), "c"),
            Ok((cert.clone(), key.clone(), cert.clone()))
        );
        let without_ca = secret(&[("tls.crt", &cert), ("tls.key", &key)]);
        assert_eq!(named_certificate(Some(&without_ca), "c").unwrap().2, cert);
        assert!(
            named_certificate(None, "c")
                .unwrap_err()
                .contains("no Secret c")
        );
        let without_key = secret(&[("tls.crt", &cert)]);
        assert!(
            named_certificate(Some(&without_key), "c")
                .unwrap_err()
                .contains("lacks")
        );
        let not_pem = secret(&[("tls.crt", "x"), ("tls.key", "y")]);
        assert!(
            named_certificate(Some(&not_pem), "c")
                .unwrap_err()
                .contains("PEM")
        );
    }
}
