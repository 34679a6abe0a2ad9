//! The committed deploy/crds/*.yaml are exactly what crdgen prints.

use std::path::PathBuf;

#[test]
fn committed_crds_match_crdgen() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    let mut stale = Vec::new();
    for crd in dbops_api::crds() {
        let file = dir.join(dbops_api::crd_file_name(&crd));
        let expected = dbops_api::crd_yaml(&crd).unwrap();
        let committed = std::fs::read_to_string(&file).unwrap_or_default();
        if committed != expected {
            stale.push(file.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "stale CRDs: {stale:?}; run `cargo run -p dbops-api --bin crdgen -- --out-dir deploy/crds`"
    );
}

#[test]
fn every_field_has_a_description() {
    fn walk(path: &str, schema: &serde_json::Value, missing: &mut Vec<String>) {
        let Some(props) = schema.get("properties").and_then(|p| p.as_object()) else {
            if let Some(items) = schema.get("items") {
                walk(&format!("{path}[]"), items, missing);
            }
            return;
        };
        for (name, prop) in props {
            let p = format!("{path}.{name}");
            let top_level =
                path.is_empty() && ["apiVersion", "kind", "metadata"].contains(&name.as_str());
            if !top_level && prop.get("description").is_none() {
                missing.push(p.clone());
            }
            walk(&p, prop, missing);
        }
    }
    let mut missing = Vec::new();
    for crd in dbops_api::crds() {
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
        walk(
            &crd.spec.names.kind,
            &schema["openAPIV3Schema"],
            &mut missing,
        );
    }
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:?}"
    );
}
