//! `kubeconform -strict` on what dbops ships: `deploy/` (with and without its components),
//! the kustomizations under `e2e/`, and `charts/dbops` rendered by `helm template`.
//!
//! kubeconform validates against JSON schemas, one file per kind and version, usually
//! fetched from GitHub, which the test bed cannot reach. They are generated here instead,
//! in the layout kubeconform expects (`<dir>/v<k8s>-standalone-strict/<kind>[-<group>]-<version>.json`,
//! `<group>` being the API group's first label, as in `deployment-apps-v1.json`):
//! - the built-in kinds from the OpenAPI (v2) document of the Kubernetes release the test
//!   bed builds (`api/openapi-spec/swagger.json` of the Go module `k8s.io/kubernetes`, in
//!   the module cache that building the control plane filled), cached in
//!   `<cache>/kubeconform-schemas-<k8s version>/`;
//! - dbops's kinds from `openAPIV3Schema` of the CRDs in `deploy/crds/`, fresh each time.
//!
//! "Strict", as kubeconform's own strict schemas are: every object schema that lists its
//! properties refuses others (`additionalProperties: false`), unless it preserves unknown
//! fields. Each schema file holds the definitions it refers to (`#/definitions/...`), so
//! recursive types (a CRD's JSONSchemaProps) need no inlining. int-or-string becomes
//! `oneOf: [string, integer]` and a quantity `oneOf: [string, number]`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Map, Value, json};

use crate::chart::kustomize_text;
use crate::process::stdout_text;
use crate::{chart, paths};

/// Bumped when the generated schemas change, so that cached ones are made anew.
const GENERATOR_VERSION: &str = "1";

/// kubeconform's name for a kind and API version: `deployment-apps-v1`, `service-v1`.
pub fn schema_name(kind: &str, group: &str, version: &str) -> String {
    let kind = kind.to_lowercase();
    match group.split('.').next().unwrap_or("") {
        "" => format!("{kind}-{}", version.to_lowercase()),
        first => format!("{kind}-{}-{}", first.to_lowercase(), version.to_lowercase()),
    }
}

/// The directory under a schema location that kubeconform reads for `k8s` (`v1.33.13`).
fn strict_dir(location: &Path, k8s: &str) -> PathBuf {
    location.join(format!("{k8s}-standalone-strict"))
}

/// Makes a schema strict and kubeconform-friendly, in place (see the module's notes).
fn tighten(node: &mut Value, int_or_string_format: bool) {
    match node {
        Value::Object(map) => {
            let int_or_string = map.get("x-kubernetes-int-or-string") == Some(&json!(true))
                || (int_or_string_format && map.get("format") == Some(&json!("int-or-string")));
            if int_or_string && !map.contains_key("anyOf") && !map.contains_key("oneOf") {
                map.remove("type");
                map.remove("format");
                map.insert(
                    "oneOf".into(),
                    json!([{"type": "string"}, {"type": "integer"}]),
                );
            }
            if map.get("nullable") == Some(&json!(true))
                && let Some(Value::String(t)) = map.get("type").cloned()
            {
                map.insert("type".into(), json!([t, "null"]));
            }
            let preserves = map.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
            if map.contains_key("properties")
                && !map.contains_key("additionalProperties")
                && !preserves
            {
                map.insert("additionalProperties".into(), json!(false));
            }
            for (key, value) in map.iter_mut() {
                // `properties` and `definitions` are maps of schemas; `enum`, `default`,
                // `example` are data, not schemas.
                if matches!(
                    key.as_str(),
                    "enum" | "default" | "example" | "x-kubernetes-validations"
                ) {
                    continue;
                }
                tighten(value, int_or_string_format);
            }
        }
        Value::Array(items) => {
            for item in items {
                tighten(item, int_or_string_format);
            }
        }
        _ => {}
    }
}

/// Every `#/definitions/<name>` under `node`.
fn refs(node: &Value, out: &mut Vec<String>) {
    match node {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref")
                && let Some(name) = r.strip_prefix("#/definitions/")
            {
                out.push(name.to_string());
            }
            map.values().for_each(|v| refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// Writes a strict schema per kind and version of an OpenAPI v2 document's definitions
/// (those with `x-kubernetes-group-version-kind`) into `dir`; returns how many.
pub fn schemas_from_swagger(swagger: &Value, dir: &Path) -> Result<usize> {
    let definitions = swagger["definitions"]
        .as_object()
        .context("the OpenAPI document has no definitions")?;
    // Tightened once, shared by every file that refers to them.
    let mut tight: Map<String, Value> = definitions.clone();
    for (name, def) in tight.iter_mut() {
        tighten(def, true);
        if name.ends_with(".api.resource.Quantity") {
            def.as_object_mut()
                .context("a Quantity definition")?
                .remove("type");
            def["oneOf"] = json!([{"type": "string"}, {"type": "number"}]);
        }
    }
    std::fs::create_dir_all(dir)?;
    let mut written = 0;
    for (name, def) in &tight {
        let Some(gvks) = definitions[name]["x-kubernetes-group-version-kind"].as_array() else {
            continue;
        };
        // The definitions it needs, transitively.
        let mut needed = Map::new();
        let mut todo = Vec::new();
        refs(def, &mut todo);
        while let Some(r) = todo.pop() {
            if needed.contains_key(&r) {
                continue;
            }
            let d = tight
                .get(&r)
                .with_context(|| format!("{name} refers to an unknown {r}"))?;
            refs(d, &mut todo);
            needed.insert(r, d.clone());
        }
        let mut schema = def.clone();
        if !needed.is_empty() {
            schema["definitions"] = Value::Object(needed);
        }
        let text = serde_json::to_string(&schema)?;
        for gvk in gvks {
            let s = |k: &str| gvk[k].as_str().unwrap_or("");
            let file = dir.join(format!(
                "{}.json",
                schema_name(s("kind"), s("group"), s("version"))
            ));
            std::fs::write(&file, &text).with_context(|| format!("{}", file.display()))?;
            written += 1;
        }
    }
    Ok(written)
}

/// Writes a strict schema per CRD version (its `openAPIV3Schema`) into `dir`.
pub fn schemas_from_crds(crds: &[serde_norway::Value], dir: &Path) -> Result<usize> {
    std::fs::create_dir_all(dir)?;
    let mut written = 0;
    for crd in crds {
        let crd: Value = serde_json::to_value(crd)?;
        let group = crd["spec"]["group"].as_str().context("a CRD's group")?;
        let kind = crd["spec"]["names"]["kind"]
            .as_str()
            .context("a CRD's kind")?;
        for version in crd["spec"]["versions"].as_array().into_iter().flatten() {
            let name = version["name"].as_str().context("a CRD version's name")?;
            let mut schema = version["schema"]["openAPIV3Schema"].clone();
            ensure!(schema.is_object(), "{kind} {name}: no openAPIV3Schema");
            // What the apiserver adds to every custom resource's schema.
            let properties = schema["properties"]
                .as_object_mut()
                .with_context(|| format!("{kind} {name}: no properties"))?;
            for (field, s) in [
                ("apiVersion", json!({"type": "string"})),
                ("kind", json!({"type": "string"})),
                ("metadata", json!({"type": "object"})),
            ] {
                properties.entry(field).or_insert(s);
            }
            tighten(&mut schema, false);
            let file = dir.join(format!("{}.json", schema_name(kind, group, name)));
            std::fs::write(&file, serde_json::to_string(&schema)?)?;
            written += 1;
        }
    }
    Ok(written)
}

/// The `k8s.io/kubernetes` module's directory in the Go module cache (downloaded by `go`
/// from the module proxy when it is not there: building the control plane puts it there).
fn kubernetes_module_dir() -> Result<PathBuf> {
    let version = paths::kubernetes_version()?;
    let out = Command::new("go")
        .args(["mod", "download", "-json"])
        .arg(format!("k8s.io/kubernetes@{version}"))
        .current_dir(paths::repo_root().join("e2e/controlplane"))
        .output()
        .context("running go mod download (go builds the control plane: e2e/install)")?;
    ensure!(
        out.status.success(),
        "go mod download k8s.io/kubernetes@{version}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let info: Value = serde_json::from_slice(&out.stdout).context("go mod download's JSON")?;
    Ok(PathBuf::from(
        info["Dir"]
            .as_str()
            .context("go mod download gave no Dir")?,
    ))
}

/// The schemas of the built-in kinds for the test bed's Kubernetes release, generated
/// once into `<cache>/kubeconform-schemas-<k8s>/` (again when [`GENERATOR_VERSION`]
/// changes); returns that schema location.
pub fn builtin_schemas() -> Result<PathBuf> {
    let k8s = paths::kubernetes_version()?;
    let location = paths::cache_dir().join(format!("kubeconform-schemas-{k8s}"));
    let stamp = location.join(".generator");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(GENERATOR_VERSION) {
        return Ok(location);
    }
    let swagger_path = kubernetes_module_dir()?.join("api/openapi-spec/swagger.json");
    let swagger: Value = serde_json::from_slice(
        &std::fs::read(&swagger_path).with_context(|| format!("{}", swagger_path.display()))?,
    )
    .with_context(|| format!("{}", swagger_path.display()))?;
    std::fs::create_dir_all(paths::cache_dir())?;
    let partial = tempfile::Builder::new()
        .prefix(&format!("kubeconform-schemas-{k8s}.partial."))
        .tempdir_in(paths::cache_dir())?;
    let written = schemas_from_swagger(&swagger, &strict_dir(partial.path(), &k8s))?;
    ensure!(
        written > 100,
        "only {written} schemas from {}",
        swagger_path.display()
    );
    std::fs::write(partial.path().join(".generator"), GENERATOR_VERSION)?;
    let _ = std::fs::remove_dir_all(&location);
    if let Err(e) = std::fs::rename(partial.path(), &location) {
        // Another process generated them at the same time: theirs will do.
        if std::fs::read_to_string(&stamp).ok().as_deref() != Some(GENERATOR_VERSION) {
            return Err(e).with_context(|| format!("moving the schemas to {}", location.display()));
        }
    }
    Ok(location)
}

/// One stream of manifests to validate, by a name that says where it came from.
pub struct Manifests {
    pub name: String,
    pub text: String,
}

/// `helm template dbops charts/dbops --include-crds <args>`.
pub fn helm_template(chart: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(paths::helm()?)
        .args(["template", "dbops"])
        .arg(chart)
        .arg("--include-crds")
        .args(args)
        .output()
        .context("running helm template")?;
    stdout_text(out, &format!("helm template {} {args:?}", chart.display()))
}

/// Everything the repository ships or deploys, rendered: `deploy/`, `deploy/` with the S3
/// component, `deploy/jaeger/`, every kustomization under `e2e/`, and the chart with its
/// default values and with an S3 store.
pub fn shipped_manifests() -> Result<Vec<Manifests>> {
    let root = paths::repo_root();
    let deploy = root.join("deploy");
    let mut all = vec![Manifests {
        name: "kubectl kustomize deploy/".into(),
        text: kustomize_text(&deploy)?,
    }];
    let s3 = chart::overlay(&deploy, &["s3-backup-store"])?;
    all.push(Manifests {
        name: "deploy/ with components/s3-backup-store".into(),
        text: kustomize_text(s3.path())?,
    });
    all.push(Manifests {
        name: "kubectl kustomize deploy/jaeger/".into(),
        text: kustomize_text(&deploy.join("jaeger"))?,
    });
    let mut overlays = Vec::new();
    let mut stack = vec![root.join("e2e")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == "kustomization.yaml") {
                overlays.push(dir.clone());
            }
        }
    }
    overlays.sort();
    for dir in overlays {
        let rel = dir
            .strip_prefix(&root)
            .unwrap_or(&dir)
            .display()
            .to_string();
        all.push(Manifests {
            name: format!("kubectl kustomize {rel}"),
            text: kustomize_text(&dir)?,
        });
    }
    let chart = root.join(chart::CHART_DIR);
    all.push(Manifests {
        name: "helm template charts/dbops".into(),
        text: helm_template(&chart, &[])?,
    });
    all.push(Manifests {
        name: "helm template charts/dbops --set backupStore.type=s3".into(),
        text: helm_template(
            &chart,
            &[
                "--set",
                "backupStore.type=s3",
                "--set",
                "backupStore.s3.endpoint=https://minio.example:9000",
            ],
        )?,
    });
    // What the test bed installs with helm (e2e/cluster deploy --helm): S3, traces, extraEnv.
    let values = root.join("e2e/deployed/helm-values.yaml");
    let values = values.to_string_lossy();
    all.push(Manifests {
        name: "helm template charts/dbops -f e2e/deployed/helm-values.yaml".into(),
        text: helm_template(&chart, &["-f", &values])?,
    });
    Ok(all)
}

/// What kubeconform said of one stream.
pub struct Outcome {
    pub name: String,
    pub resources: usize,
    pub output: String,
}

/// Runs `kubeconform -strict -summary` on each stream, against the built-in schemas and
/// those of `deploy/crds/`; fails on the first stream with an invalid, unknown (no
/// schema) or skipped object.
pub fn validate(manifests: &[Manifests]) -> Result<Vec<Outcome>> {
    let k8s = paths::kubernetes_version()?;
    let builtin = builtin_schemas()?;
    let work = tempfile::Builder::new()
        .prefix("dbops-kubeconform-")
        .tempdir()?;
    let mut crds = Vec::new();
    for entry in std::fs::read_dir(paths::repo_root().join("deploy/crds"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            crds.extend(chart::parse_documents(&std::fs::read_to_string(&path)?)?);
        }
    }
    let crd_location = work.path().join("crd-schemas");
    let n = schemas_from_crds(&crds, &strict_dir(&crd_location, &k8s))?;
    ensure!(n > 0, "no CRD in deploy/crds");
    let kubeconform = paths::kubeconform()?;
    let mut outcomes = Vec::new();
    for (i, m) in manifests.iter().enumerate() {
        let file = work.path().join(format!("{i}.yaml"));
        std::fs::write(&file, &m.text)?;
        let resources = chart::parse_documents(&m.text)?.len();
        let out = Command::new(&kubeconform)
            .arg("-strict")
            .arg("-summary")
            .args(["-kubernetes-version", k8s.trim_start_matches('v')])
            .arg("-schema-location")
            .arg(&builtin)
            .arg("-schema-location")
            .arg(&crd_location)
            .arg(&file)
            .output()
            .context("running kubeconform")?;
        let output = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .replace(&file.display().to_string(), &m.name);
        let summary = format!("Valid: {resources}, Invalid: 0, Errors: 0, Skipped: 0");
        if !out.status.success() || !output.contains(&summary) {
            bail!(
                "kubeconform -strict refused {} (wanted \"{summary}\"):\n{output}",
                m.name
            );
        }
        outcomes.push(Outcome {
            name: m.name.clone(),
            resources,
            output,
        });
    }
    Ok(outcomes)
}
