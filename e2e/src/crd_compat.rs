//! The CRD evolution rules of docs/development.md ("CRD evolution"), as a check: what an
//! object stored under a released CRD, or a manifest written against it, would meet under
//! this checkout's CRD. Within a served version a field is never removed, retyped or
//! narrowed, no field becomes required, no enum value goes, no default changes, and a
//! version once served stays served. New optional fields, new versions, wider limits and
//! new printer columns are fine. A new CEL rule on an existing field is reported but not
//! refused: the apiserver ratchets validation (an unchanged value of a stored object is
//! not re-judged on update), and the rules are how dbops refuses unsafe input.

use serde_json::Value;

/// One difference between a released CRD and this checkout's: a breaking change, or a
/// note (a new CEL rule on a field that existed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Breaking(String),
    Note(String),
}

impl Change {
    pub fn is_breaking(&self) -> bool {
        matches!(self, Change::Breaking(_))
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Breaking(what) => write!(f, "breaking: {what}"),
            Change::Note(what) => write!(f, "note: {what}"),
        }
    }
}

/// Every difference between `old` and `new`, two `CustomResourceDefinition`s (as JSON) of
/// the same resource.
pub fn changes(old: &Value, new: &Value) -> Vec<Change> {
    let mut out = Vec::new();
    let name = old["metadata"]["name"].as_str().unwrap_or("?").to_string();
    for field in ["group", "scope"] {
        if old["spec"][field] != new["spec"][field] {
            out.push(Change::Breaking(format!(
                "{name}: spec.{field} {} -> {}",
                old["spec"][field], new["spec"][field]
            )));
        }
    }
    for field in ["kind", "plural", "singular", "listKind"] {
        let (was, is) = (&old["spec"]["names"][field], &new["spec"]["names"][field]);
        if !was.is_null() && was != is {
            out.push(Change::Breaking(format!(
                "{name}: spec.names.{field} {was} -> {is}"
            )));
        }
    }
    let versions = |crd: &Value| -> Vec<Value> {
        crd["spec"]["versions"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let new_versions = versions(new);
    for version in versions(old) {
        let v = version["name"].as_str().unwrap_or("?");
        if version["served"] != Value::Bool(true) {
            continue;
        }
        let Some(now) = new_versions.iter().find(|n| n["name"] == version["name"]) else {
            out.push(Change::Breaking(format!(
                "{name}: version {v} was served and is gone"
            )));
            continue;
        };
        if now["served"] != Value::Bool(true) {
            out.push(Change::Breaking(format!(
                "{name}: version {v} is no longer served"
            )));
        }
        if version["storage"] == Value::Bool(true) && now["storage"] != Value::Bool(true) {
            out.push(Change::Note(format!(
                "{name}: version {v} is no longer the storage version (stored objects need a migration)"
            )));
        }
        if version["subresources"] != now["subresources"] {
            let (was, is) = (&version["subresources"], &now["subresources"]);
            for sub in ["status", "scale"] {
                if !was[sub].is_null() && is[sub].is_null() {
                    out.push(Change::Breaking(format!(
                        "{name} {v}: the {sub} subresource is gone"
                    )));
                }
            }
        }
        schema(
            &format!("{name} {v}"),
            "",
            &version["schema"]["openAPIV3Schema"],
            &now["schema"]["openAPIV3Schema"],
            &mut out,
        );
    }
    out
}

/// `old` against `new` at `path` (`.spec.x`), recursively.
fn schema(crd: &str, path: &str, old: &Value, new: &Value, out: &mut Vec<Change>) {
    let at = if path.is_empty() { "." } else { path };
    let mut breaking = |what: String| out.push(Change::Breaking(format!("{crd} {at}: {what}")));
    for key in [
        "type",
        "format",
        "x-kubernetes-list-type",
        "x-kubernetes-map-type",
    ] {
        if old[key] != new[key] && !(key.starts_with("x-") && old[key].is_null()) {
            breaking(format!("{key} {} -> {}", old[key], new[key]));
        }
    }
    if old["x-kubernetes-int-or-string"] != new["x-kubernetes-int-or-string"] {
        breaking("x-kubernetes-int-or-string changed".into());
    }
    if old["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true)
        && new["x-kubernetes-preserve-unknown-fields"] != Value::Bool(true)
    {
        breaking("no longer preserves unknown fields".into());
    }
    if old["default"] != new["default"] {
        breaking(format!("default {} -> {}", old["default"], new["default"]));
    }
    if old["nullable"] == Value::Bool(true) && new["nullable"] != Value::Bool(true) {
        breaking("no longer nullable".into());
    }
    if old["pattern"] != new["pattern"] && !new["pattern"].is_null() {
        breaking(format!("pattern {} -> {}", old["pattern"], new["pattern"]));
    }
    narrowed(old, new, &mut breaking);
    enums(old, new, &mut breaking);
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let was_required = strings(&old["required"]);
    for field in strings(&new["required"]) {
        if !was_required.contains(&field) {
            breaking(format!("{field} became required"));
        }
    }
    let rules = |v: &Value| -> Vec<String> {
        v["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["rule"].as_str().map(str::to_string))
            .collect()
    };
    let old_rules = rules(old);
    for rule in rules(new) {
        if !old_rules.contains(&rule) {
            out.push(Change::Note(format!("{crd} {at}: a new rule {rule:?}")));
        }
    }
    if let Some(properties) = old["properties"].as_object() {
        for (field, was) in properties {
            let child = format!("{path}.{field}");
            match new["properties"].get(field) {
                Some(is) => schema(crd, &child, was, is, out),
                None => out.push(Change::Breaking(format!("{crd} {child}: removed"))),
            }
        }
    }
    for key in ["items", "additionalProperties"] {
        if old[key].is_object() {
            let child = format!("{path}{}", if key == "items" { "[]" } else { "{}" });
            if new[key].is_object() {
                schema(crd, &child, &old[key], &new[key], out);
            } else {
                out.push(Change::Breaking(format!(
                    "{crd} {child}: its {key} schema is gone"
                )));
            }
        }
    }
}

/// A limit that lets less through than it did.
fn narrowed(old: &Value, new: &Value, breaking: &mut impl FnMut(String)) {
    for key in ["maxLength", "maxItems", "maxProperties", "maximum"] {
        let (was, is) = (old[key].as_f64(), new[key].as_f64());
        if let Some(is) = is
            && was.is_none_or(|was| is < was)
        {
            breaking(format!("{key} {} -> {is}", old[key]));
        }
    }
    for key in ["minLength", "minItems", "minProperties", "minimum"] {
        let (was, is) = (old[key].as_f64(), new[key].as_f64());
        if let Some(is) = is
            && was.is_none_or(|was| is > was)
        {
            breaking(format!("{key} {} -> {is}", old[key]));
        }
    }
}

/// An enum that lost a value, or an enum where there was none.
fn enums(old: &Value, new: &Value, breaking: &mut impl FnMut(String)) {
    let Some(is) = new["enum"].as_array() else {
        return;
    };
    match old["enum"].as_array() {
        None => breaking(format!("now limited to {}", new["enum"])),
        Some(was) => {
            for value in was {
                if !is.contains(value) {
                    breaking(format!("enum value {value} removed"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn crd(spec_schema: Value) -> Value {
        json!({
            "metadata": {"name": "things.dbops.dev"},
            "spec": {
                "group": "dbops.dev", "scope": "Namespaced",
                "names": {"kind": "Thing", "plural": "things"},
                "versions": [{
                    "name": "v1alpha1", "served": true, "storage": true,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "properties": {"spec": spec_schema}
                    }}
                }]
            }
        })
    }

    fn base() -> Value {
        json!({
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "maxLength": 63},
                "mode": {"type": "string", "enum": ["A", "B"], "default": "A"},
                "count": {"type": "integer", "format": "int32", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}}
            }
        })
    }

    fn breaking(old: &Value, new: &Value) -> Vec<String> {
        changes(&crd(old.clone()), &crd(new.clone()))
            .into_iter()
            .filter(Change::is_breaking)
            .map(|c| c.to_string())
            .collect()
    }

    #[test]
    fn the_same_crd_and_additions_are_fine() {
        assert!(breaking(&base(), &base()).is_empty());
        let mut wider = base();
        wider["properties"]["extra"] = json!({"type": "string"});
        wider["properties"]["name"]["maxLength"] = json!(253);
        wider["properties"]["mode"]["enum"] = json!(["A", "B", "C"]);
        assert!(
            breaking(&base(), &wider).is_empty(),
            "{:?}",
            breaking(&base(), &wider)
        );
    }

    #[test]
    fn each_kind_of_breaking_change_is_named() {
        type Case = (fn(&mut Value), &'static str);
        let cases: Vec<Case> = vec![
            (
                |s| drop(s["properties"].as_object_mut().unwrap().remove("count")),
                ".spec.count: removed",
            ),
            (
                |s| s["properties"]["count"]["type"] = json!("string"),
                ".spec.count: type",
            ),
            (
                |s| s["properties"]["count"]["format"] = json!("int64"),
                ".spec.count: format",
            ),
            (
                |s| s["properties"]["name"]["maxLength"] = json!(30),
                ".spec.name: maxLength",
            ),
            (
                |s| s["properties"]["count"]["minimum"] = json!(1),
                ".spec.count: minimum",
            ),
            (
                |s| s["properties"]["mode"]["enum"] = json!(["A"]),
                "enum value \"B\" removed",
            ),
            (
                |s| s["properties"]["mode"]["default"] = json!("B"),
                ".spec.mode: default",
            ),
            (
                |s| s["required"] = json!(["name", "count"]),
                "count became required",
            ),
            (
                |s| s["properties"]["tags"]["items"]["type"] = json!("integer"),
                ".spec.tags[]: type",
            ),
            (
                |s| s["properties"]["name"]["pattern"] = json!("^[a-z]+$"),
                ".spec.name: pattern",
            ),
            (
                |s| s["properties"]["count"]["enum"] = json!([1, 2]),
                ".spec.count: now limited",
            ),
        ];
        for (change, wanted) in cases {
            let mut new = base();
            change(&mut new);
            let found = breaking(&base(), &new);
            assert!(
                found.len() == 1 && found[0].contains(wanted),
                "wanted one change naming {wanted:?}, found {found:?}"
            );
        }
    }

    #[test]
    fn a_version_no_longer_served_and_a_rename_are_breaking() {
        let old = crd(base());
        let mut new = old.clone();
        new["spec"]["versions"][0]["served"] = json!(false);
        new["spec"]["names"]["kind"] = json!("Other");
        let found: Vec<String> = changes(&old, &new).iter().map(|c| c.to_string()).collect();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found.iter().any(|c| c.contains("no longer served")));
        assert!(found.iter().any(|c| c.contains("spec.names.kind")));
    }

    #[test]
    fn a_new_rule_on_an_old_field_is_a_note() {
        let mut new = base();
        new["properties"]["name"]["x-kubernetes-validations"] =
            json!([{"rule": "self != 'x'", "message": "not x"}]);
        let found = changes(&crd(base()), &crd(new));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(!found[0].is_breaking());
    }
}
