//! `charts/dbops`, the Helm chart, generated from `deploy/` (kustomize stays the one source
//! of the manifests): `cargo run -p dbops-e2e --bin chartgen` writes it, `-- --check`
//! fails when the committed chart differs from what `deploy/` generates.
//!
//! How: `kubectl kustomize deploy/` renders the base, and the same with the component
//! `components/s3-backup-store` renders the S3 variant. The two are merged into one set of
//! templates: what only the base has is wrapped in `if eq .Values.backupStore.type "file"`,
//! what only the S3 variant has in `if eq .Values.backupStore.type "s3"`, a value that
//! differs becomes an `if`/`else`, the component's placeholder bucket URL and Secret name
//! become values. Then a few fields become values and nothing else: per controller the
//! image (repository, tag, pull policy), replicas and resources; the claim's size, storage
//! class and access modes; whether the Namespace and the NetworkPolicies are rendered; an
//! optional S3 endpoint. Two values add to each controller's `env`, both empty by default:
//! the OTLP endpoint (`tracing.otlpEndpoint`, as `components/jaeger` sets it) and the
//! controller's `extraEnv`. Everything else is the rendered YAML as it is, so with the
//! default values `helm template` renders exactly what `kubectl kustomize deploy/`
//! renders, but for two annotations: `helm.sh/resource-policy: keep` on the Namespace and
//! on the backups claim (`helm uninstall` never deletes the admin Secrets or the backups).
//! CRDs go to `crds/` verbatim, as Helm wants them (installed before the templates, never
//! templated, never upgraded or deleted by Helm).
//!
//! The templates hold `dbopstpl<n>x` sentinels while they are values (a string scalar, a
//! mapping key or a sequence item), serialized as YAML, then each sentinel is expanded into
//! its template text (see [`Tpl`]).

mod files;
mod objects;
mod template;

pub use files::GENERATOR;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_norway::Value;

use files::{HEADER, chart_yaml, readme, values_schema, values_yaml};
use objects::{Doc, keep_on_uninstall, template_claim, template_controller};
use template::{END, IF_FILE, S3Defaults, Templates, merge};

use crate::process::stdout_text;

/// Where the chart lives in the repository.
pub const CHART_DIR: &str = "charts/dbops";

/// `kubectl kustomize <dir>`: the objects, in kustomize's order.
pub fn kustomize(dir: &Path) -> Result<Vec<Value>> {
    parse_documents(&kustomize_text(dir)?)
}

/// `kubectl kustomize <dir>`: the YAML stream.
pub fn kustomize_text(dir: &Path) -> Result<String> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .context("running kubectl kustomize (kubectl is installed by e2e/install)")?;
    stdout_text(out, &format!("kubectl kustomize {}", dir.display()))
}

/// The non-empty documents of a multi-document YAML stream.
pub fn parse_documents(text: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).context("a YAML document")?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// A kustomization in a temporary directory (outside `deploy/`: kustomize refuses an
/// overlay inside the base it includes) with `deploy/` and the given components of
/// `deploy/components/`, nothing else.
pub fn overlay(deploy: &Path, components: &[&str]) -> Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("dbops-overlay-")
        .tempdir()
        .context("a temporary directory")?;
    let deploy = deploy
        .canonicalize()
        .with_context(|| format!("{}", deploy.display()))?;
    // Relative paths: kustomize takes resources relative to the kustomization.
    let up = "../".repeat(dir.path().components().count().saturating_sub(1));
    let to_deploy = format!(
        "{up}{}",
        deploy.display().to_string().trim_start_matches('/')
    );
    let components: Vec<String> = components
        .iter()
        .map(|c| format!("{to_deploy}/components/{c}"))
        .collect();
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             resources: [{to_deploy}]\ncomponents: [{}]\n",
            components.join(", ")
        ),
    )
    .context("writing the overlay")?;
    Ok(dir)
}

/// An object's identity: apiVersion, kind, namespace, name.
pub fn object_id(o: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    format!(
        "{}/{} {}/{}",
        s(&o["apiVersion"]),
        s(&o["kind"]),
        s(&o["metadata"]["namespace"]),
        s(&o["metadata"]["name"])
    )
}

/// Writes the chart generated from `deploy` into `out` (created; must not exist or be
/// empty).
pub fn generate(deploy: &Path, out: &Path) -> Result<()> {
    let base = kustomize(deploy)?;
    let s3_dir = overlay(deploy, &["s3-backup-store"])?;
    let s3_docs = kustomize(s3_dir.path())?;
    let s3 = S3Defaults::from_variant(&s3_docs)?;
    let mut t = Templates::default();

    let mut s3_by_id: BTreeMap<String, &Value> =
        s3_docs.iter().map(|d| (object_id(d), d)).collect();
    let mut crds = Vec::new();
    let mut groups: Vec<(String, Vec<Doc>)> = Vec::new();
    let mut controllers = Vec::new();
    let mut claim = None;
    for object in &base {
        let id = object_id(object);
        let kind = object["kind"].as_str().unwrap_or("");
        if kind == "CustomResourceDefinition" {
            ensure!(
                s3_by_id.remove(&id) == Some(object),
                "{id}: the S3 variant changes a CRD"
            );
            crds.push(object.clone());
            continue;
        }
        let mut doc = match s3_by_id.remove(&id) {
            Some(other) => Doc {
                value: merge(&mut t, &s3, object, other, &id)?,
                conditions: Vec::new(),
            },
            None => Doc {
                value: object.clone(),
                conditions: vec![IF_FILE.to_string()],
            },
        };
        let component = object["metadata"]["labels"]["app.kubernetes.io/component"]
            .as_str()
            .map(String::from);
        match kind {
            "Namespace" => {
                doc.conditions
                    .push("{{- if .Values.namespace.create }}".to_string());
                keep_on_uninstall(&mut doc.value)?;
            }
            "NetworkPolicy" => doc
                .conditions
                .push("{{- if .Values.networkPolicy.enabled }}".to_string()),
            "Deployment" => {
                let component = component
                    .clone()
                    .filter(|c| c.ends_with("-controller"))
                    .with_context(|| format!("{id}: not a controller's Deployment"))?;
                controllers.push(template_controller(&mut t, &mut doc.value, &component)?);
            }
            "PersistentVolumeClaim" => {
                ensure!(
                    claim.is_none() && doc.conditions == [IF_FILE],
                    "{id}: only the file store's claim (absent from the S3 variant) is supported"
                );
                claim = Some(template_claim(&mut t, &mut doc.value)?);
            }
            _ => {}
        }
        let group = component.unwrap_or_else(|| kind.to_lowercase());
        match groups.iter_mut().find(|(g, _)| *g == group) {
            Some((_, docs)) => docs.push(doc),
            None => groups.push((group, vec![doc])),
        }
    }
    if let Some(id) = s3_by_id.keys().next() {
        bail!("{id} is only in the S3 variant; chartgen does not template that");
    }
    let claim = claim.context("deploy/ has no backup claim")?;
    ensure!(
        !controllers.is_empty(),
        "deploy/ has no controller Deployment"
    );

    std::fs::create_dir_all(out.join("templates"))?;
    std::fs::create_dir_all(out.join("crds"))?;
    for crd in &crds {
        let name = crd["metadata"]["name"].as_str().context("a CRD's name")?;
        let text = serde_norway::to_string(crd)?;
        std::fs::write(
            out.join("crds").join(format!("{name}.yaml")),
            format!("# {HEADER}\n{text}"),
        )?;
    }
    for (group, docs) in &groups {
        // A template comment: it renders nothing, so a document whose condition is false
        // renders empty rather than as a comment.
        let mut text = format!("{{{{/* {HEADER} */}}}}\n");
        for (i, doc) in docs.iter().enumerate() {
            if i > 0 {
                text.push_str("---\n");
            }
            for c in &doc.conditions {
                text.push_str(c);
                text.push('\n');
            }
            text.push_str(&t.render(&doc.value)?);
            for _ in &doc.conditions {
                text.push_str(END);
                text.push('\n');
            }
        }
        std::fs::write(out.join("templates").join(format!("{group}.yaml")), text)?;
    }
    let app_version = controllers[0].tag.clone();
    std::fs::write(out.join("Chart.yaml"), chart_yaml(&app_version))?;
    std::fs::write(
        out.join("values.yaml"),
        values_yaml(&controllers, &claim, &s3)?,
    )?;
    std::fs::write(
        out.join("values.schema.json"),
        serde_json::to_string_pretty(&values_schema(&controllers))? + "\n",
    )?;
    std::fs::write(
        out.join("README.md"),
        readme(&controllers, &claim, &s3, &crds)?,
    )?;
    Ok(())
}

/// Every file under `dir`, by path relative to it.
fn files(dir: &Path) -> Result<BTreeMap<PathBuf, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("{}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(dir)?.to_path_buf();
                out.insert(rel, std::fs::read(&path)?);
            }
        }
    }
    Ok(out)
}

/// The drift check: `None` when `chart` is what `deploy` generates, else a description
/// of the difference (a unified diff, from `diff -ru`, when it is available).
pub fn check(deploy: &Path, chart: &Path) -> Result<Option<String>> {
    let fresh = tempfile::Builder::new()
        .prefix("dbops-chartgen-")
        .tempdir()?;
    let generated = fresh.path().join("dbops");
    generate(deploy, &generated)?;
    let want = files(&generated)?;
    let have = if chart.is_dir() {
        files(chart)?
    } else {
        BTreeMap::new()
    };
    if want == have {
        return Ok(None);
    }
    let mut report = String::new();
    for path in want.keys().filter(|p| !have.contains_key(*p)) {
        report.push_str(&format!(
            "missing from {}: {}\n",
            chart.display(),
            path.display()
        ));
    }
    for path in have.keys().filter(|p| !want.contains_key(*p)) {
        report.push_str(&format!("not generated: {}\n", chart.join(path).display()));
    }
    let diff = Command::new("diff")
        .arg("-ru")
        .arg(chart)
        .arg(&generated)
        .output();
    if let Ok(out) = diff {
        report.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    Ok(Some(report))
}
