//! Whether a server's pooler can keep serving a database a Migration moved to another
//! server (a forward route): its clients stay connected to the source's pooler after the
//! cutover, which then logs in to the target instead.

use dbops_api::DatabaseServer;

/// Why `source`'s pooler cannot forward to `target`, if it cannot. PgBouncer has one
/// server TLS setting for all its routes (`server_tls_sslmode`, `server_tls_ca_file`),
/// so the target must be reached with the same mode and the same CA Secret as the source.
pub fn can_forward(source: &DatabaseServer, target: &DatabaseServer) -> Result<(), String> {
    let name = |s: &DatabaseServer| s.metadata.name.clone().unwrap_or_default();
    if source.spec.pooler.is_none() {
        return Err(format!("DatabaseServer {} has no pooler", name(source)));
    }
    let (from, to) = (&source.spec.tls, &target.spec.tls);
    if from.mode != to.mode {
        return Err(format!(
            "the pooler of DatabaseServer {} reaches its server with TLS mode {}, and DatabaseServer {} asks for {}: PgBouncer has one server TLS mode",
            name(source),
            from.mode.as_str(),
            name(target),
            to.mode.as_str()
        ));
    }
    let ca = |s: &DatabaseServer| {
        s.spec
            .tls
            .ca_secret_ref
            .as_ref()
            .map_or("the system's roots".to_string(), |r| {
                format!("CA Secret {}", r.name)
            })
    };
    if from.ca_secret_ref != to.ca_secret_ref {
        return Err(format!(
            "the pooler of DatabaseServer {} verifies its server with {}, and DatabaseServer {} with {}: PgBouncer has one server CA",
            name(source),
            ca(source),
            name(target),
            ca(target)
        ));
    }
    if u16::try_from(target.spec.port).is_err() {
        return Err(format!(
            "DatabaseServer {} has port {}",
            name(target),
            target.spec.port
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str, tls: serde_json::Value, pooler: bool) -> DatabaseServer {
        let mut spec = serde_json::json!({
            "host": format!("{name}.example"), "port": 5432,
            "adminSecretRef": {"name": "admin"}, "tls": tls,
        });
        if pooler {
            spec["pooler"] = serde_json::json!({});
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_forward_needs_a_pooler_and_the_same_server_tls() {
        let full = serde_json::json!({"mode": "verify-full", "caSecretRef": {"name": "ca"}});
        let a = server("a", full.clone(), true);
        assert_eq!(can_forward(&a, &server("b", full.clone(), false)), Ok(()));
        let without = server("a", full.clone(), false);
        assert!(can_forward(&without, &a).unwrap_err().contains("no pooler"));
        let other_ca = serde_json::json!({"mode": "verify-full", "caSecretRef": {"name": "ca2"}});
        let why = can_forward(&a, &server("b", other_ca, false)).unwrap_err();
        assert!(why.contains("CA Secret ca2"), "{why}");
        let require = serde_json::json!({"mode": "require"});
        let why = can_forward(&a, &server("b", require, false)).unwrap_err();
        assert!(why.contains("asks for require"), "{why}");
    }
}
