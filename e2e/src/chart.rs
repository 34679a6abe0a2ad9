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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_norway::{Mapping, Value};

/// Where the chart lives in the repository.
pub const CHART_DIR: &str = "charts/dbops";
/// The command that writes it (named in every generated file).
pub const GENERATOR: &str = "cargo run -p dbops-e2e --bin chartgen";

const IF_FILE: &str = r#"{{- if eq .Values.backupStore.type "file" }}"#;
const IF_S3: &str = r#"{{- if eq .Values.backupStore.type "s3" }}"#;
const END: &str = "{{- end }}";
/// What every generated file starts with (as a comment).
const HEADER: &str =
    "Generated from deploy/ by `cargo run -p dbops-e2e --bin chartgen`; do not edit.";

/// `kubectl kustomize <dir>`: the objects, in kustomize's order.
pub fn kustomize(dir: &Path) -> Result<Vec<Value>> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .context("running kubectl kustomize (kubectl is installed by e2e/install)")?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse_documents(&String::from_utf8(out.stdout).context("kustomize's output")?)
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

/// What a sentinel stands for.
enum Tpl {
    /// Replaces the sentinel inside its line (a scalar's value).
    Inline(String),
    /// Replaces the sentinel's whole line (a mapping key `dbopstpl<n>x: null` or a
    /// sequence item `- dbopstpl<n>x`) with these lines, at the sentinel's indentation.
    Raw(Vec<String>),
    /// A mapping value `key: dbopstpl<n>x` becomes `key:` and `toYaml <expr>` below it.
    Block(String),
    /// A sequence item `- dbopstpl<n>x` becomes the items of the list `<expr>` (none when
    /// it is empty), at the sentinel's indentation.
    Items(String),
}

#[derive(Default)]
struct Templates(Vec<Tpl>);

impl Templates {
    fn add(&mut self, t: Tpl) -> Value {
        self.0.push(t);
        Value::String(format!("dbopstpl{}x", self.0.len() - 1))
    }
    fn inline(&mut self, text: impl Into<String>) -> Value {
        self.add(Tpl::Inline(text.into()))
    }
    fn raw(&mut self, lines: &[&str]) -> Value {
        self.add(Tpl::Raw(lines.iter().map(|l| l.to_string()).collect()))
    }
    fn block(&mut self, expr: impl Into<String>) -> Value {
        self.add(Tpl::Block(expr.into()))
    }
    fn items(&mut self, expr: impl Into<String>) -> Value {
        self.add(Tpl::Items(expr.into()))
    }

    /// The YAML of `value` with its sentinels expanded (and any literal `{{` escaped, so
    /// Helm renders it as it is).
    fn render(&self, value: &Value) -> Result<String> {
        let text = serde_norway::to_string(value).context("serializing a template")?;
        let text = text.replace("{{", r#"{{ "{{" }}"#);
        let mut out = String::new();
        for line in text.lines() {
            let Some(at) = line.find("dbopstpl") else {
                out.push_str(line);
                out.push('\n');
                continue;
            };
            let rest = &line[at + "dbopstpl".len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let token = format!("dbopstpl{digits}x");
            ensure!(
                rest[digits.len()..].starts_with('x'),
                "a malformed sentinel in {line:?}"
            );
            let n: usize = digits.parse().context("a sentinel's number")?;
            let tpl = self.0.get(n).context("an unknown sentinel")?;
            let indent = line.len() - line.trim_start().len();
            let trimmed = line.trim();
            match tpl {
                Tpl::Inline(text) => {
                    ensure!(
                        line.matches("dbopstpl").count() == 1,
                        "two sentinels in {line:?}"
                    );
                    out.push_str(&line.replace(&token, text));
                    out.push('\n');
                }
                Tpl::Raw(lines) => {
                    ensure!(
                        trimmed == format!("- {token}") || trimmed == format!("{token}: null"),
                        "a raw sentinel that is neither a key nor an item: {line:?}"
                    );
                    for l in lines {
                        out.push_str(&" ".repeat(indent));
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                Tpl::Items(expr) => {
                    ensure!(
                        trimmed == format!("- {token}"),
                        "an items sentinel that is not a sequence item: {line:?}"
                    );
                    let pad = " ".repeat(indent);
                    out.push_str(&format!(
                        "{pad}{{{{- with {expr} }}}}\n\
                         {pad}{{{{- toYaml . | nindent {indent} }}}}\n\
                         {pad}{END}\n"
                    ));
                }
                Tpl::Block(expr) => {
                    let head = line
                        .strip_suffix(&token)
                        .with_context(|| format!("a block sentinel not at the end: {line:?}"))?;
                    ensure!(
                        head.ends_with(": "),
                        "a block sentinel not a value: {line:?}"
                    );
                    // The key's column: past the indentation and a sequence item's dash.
                    let key_col = indent + if trimmed.starts_with("- ") { 2 } else { 0 };
                    out.push_str(head.trim_end());
                    out.push('\n');
                    let inner = key_col + 2;
                    out.push_str(&format!(
                        "{}{{{{- toYaml {expr} | nindent {inner} }}}}\n",
                        " ".repeat(inner)
                    ));
                }
            }
        }
        Ok(out)
    }
}

/// The S3 variant's settings that become values.
struct S3Defaults {
    url: String,
    secret_name: String,
}

impl S3Defaults {
    /// From the S3 variant: the backup store URL and the Secret in `envFrom`.
    fn from_variant(docs: &[Value]) -> Result<Self> {
        let mut url = None;
        let mut secret = None;
        for d in docs.iter().filter(|d| d["kind"] == "Deployment") {
            for c in d["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .into_iter()
                .flatten()
            {
                for e in c["env"].as_sequence().into_iter().flatten() {
                    if e["name"] == "DBOPS_BACKUP_STORE"
                        && let Some(v) = e["value"].as_str()
                        && v.starts_with("s3://")
                    {
                        url = Some(v.to_string());
                    }
                }
                for e in c["envFrom"].as_sequence().into_iter().flatten() {
                    if let Some(name) = e["secretRef"]["name"].as_str() {
                        secret = Some(name.to_string());
                    }
                }
            }
        }
        Ok(Self {
            url: url.context("the S3 variant sets no DBOPS_BACKUP_STORE=s3://...")?,
            secret_name: secret.context("the S3 variant takes no Secret in envFrom")?,
        })
    }

    /// A scalar of the S3 variant as template text: a value where it is one.
    fn scalar(&self, v: &Value) -> Result<String> {
        Ok(match v.as_str() {
            Some(s) if s == self.url => "{{ .Values.backupStore.s3.url | quote }}".into(),
            Some(s) if s == self.secret_name => {
                "{{ .Values.backupStore.s3.secretName | quote }}".into()
            }
            _ => literal(v)?,
        })
    }

    /// `v` (only in the S3 variant) with its URL and Secret name as values.
    fn parametrize(&self, t: &mut Templates, v: &Value) -> Result<Value> {
        Ok(match v {
            Value::String(s) if *s == self.url || *s == self.secret_name => {
                let text = self.scalar(v)?;
                t.inline(text)
            }
            Value::Mapping(m) => {
                let mut out = Mapping::new();
                for (k, v) in m {
                    out.insert(k.clone(), self.parametrize(t, v)?);
                }
                Value::Mapping(out)
            }
            Value::Sequence(s) => Value::Sequence(
                s.iter()
                    .map(|v| self.parametrize(t, v))
                    .collect::<Result<_>>()?,
            ),
            other => other.clone(),
        })
    }
}

/// A scalar as YAML flow text (JSON is YAML), with `{{` escaped.
fn literal(v: &Value) -> Result<String> {
    let json = serde_json::to_string(v).context("a scalar as JSON")?;
    Ok(json.replace("{{", r#"{{ "{{" }}"#))
}

/// The name of a sequence item (`name:`), when it has one.
fn item_name(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

/// One template out of the base (`file`) and the S3 variant of the same object.
fn merge(
    t: &mut Templates,
    s3: &S3Defaults,
    base: &Value,
    other: &Value,
    path: &str,
) -> Result<Value> {
    if base == other {
        return Ok(base.clone());
    }
    match (base, other) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            // Keys only the S3 variant has, after the key they follow there.
            let mut added: Vec<(Option<&Value>, &Value, &Value)> = Vec::new();
            let mut prev = None;
            for (k, v) in o {
                if b.contains_key(k) {
                    prev = Some(k);
                } else {
                    added.push((prev, k, v));
                }
            }
            let mut out = Mapping::new();
            let add_after = |out: &mut Mapping, t: &mut Templates, after: Option<&Value>| {
                for (_, k, v) in added.iter().filter(|(a, _, _)| *a == after) {
                    out.insert(t.raw(&[IF_S3]), Value::Null);
                    out.insert((*k).clone(), s3.parametrize(t, v)?);
                    out.insert(t.raw(&[END]), Value::Null);
                }
                anyhow::Ok(())
            };
            add_after(&mut out, t, None)?;
            for (k, v) in b {
                let key = k.as_str().unwrap_or("?");
                match o.get(k) {
                    Some(ov) => {
                        let merged = merge(t, s3, v, ov, &format!("{path}.{key}"))?;
                        out.insert(k.clone(), merged);
                    }
                    None => {
                        out.insert(t.raw(&[IF_FILE]), Value::Null);
                        out.insert(k.clone(), v.clone());
                        out.insert(t.raw(&[END]), Value::Null);
                    }
                }
                add_after(&mut out, t, Some(k))?;
            }
            Ok(Value::Mapping(out))
        }
        (Value::Sequence(b), Value::Sequence(o)) => {
            let names = |s: &[Value]| -> Option<Vec<String>> {
                let names: Option<Vec<String>> =
                    s.iter().map(|v| item_name(v).map(String::from)).collect();
                let names = names?;
                let mut unique = names.clone();
                unique.sort();
                unique.dedup();
                (unique.len() == names.len()).then_some(names)
            };
            match (names(b), names(o)) {
                (Some(bn), Some(on)) => {
                    let mut added: Vec<(Option<&str>, &Value)> = Vec::new();
                    let mut prev = None;
                    for (name, v) in on.iter().zip(o) {
                        if bn.contains(name) {
                            prev = Some(name.as_str());
                        } else {
                            added.push((prev, v));
                        }
                    }
                    let mut out = Vec::new();
                    let add_after =
                        |out: &mut Vec<Value>, t: &mut Templates, after: Option<&str>| {
                            for (_, v) in added.iter().filter(|(a, _)| *a == after) {
                                out.push(t.raw(&[IF_S3]));
                                out.push(s3.parametrize(t, v)?);
                                out.push(t.raw(&[END]));
                            }
                            anyhow::Ok(())
                        };
                    add_after(&mut out, t, None)?;
                    for (name, v) in bn.iter().zip(b) {
                        match on.iter().position(|n| n == name) {
                            Some(i) => {
                                out.push(merge(t, s3, v, &o[i], &format!("{path}[{name}]"))?)
                            }
                            None => {
                                out.push(t.raw(&[IF_FILE]));
                                out.push(v.clone());
                                out.push(t.raw(&[END]));
                            }
                        }
                        add_after(&mut out, t, Some(name))?;
                    }
                    ensure!(
                        !out.is_empty() && bn.iter().any(|n| on.contains(n)),
                        "{path}: the base and the S3 variant share no item; a list that may \
                         render empty is not supported"
                    );
                    Ok(Value::Sequence(out))
                }
                _ if b.len() == o.len() => Ok(Value::Sequence(
                    b.iter()
                        .zip(o)
                        .enumerate()
                        .map(|(i, (bv, ov))| merge(t, s3, bv, ov, &format!("{path}[{i}]")))
                        .collect::<Result<_>>()?,
                )),
                _ => bail!(
                    "{path}: the S3 variant changes a list without names; chartgen cannot \
                     template that change of components/s3-backup-store"
                ),
            }
        }
        (b, o) if !b.is_mapping() && !b.is_sequence() && !o.is_mapping() && !o.is_sequence() => {
            Ok(t.inline(format!(
                r#"{{{{ if eq .Values.backupStore.type "s3" }}}}{}{{{{ else }}}}{}{{{{ end }}}}"#,
                s3.scalar(o)?,
                literal(b)?
            )))
        }
        _ => bail!("{path}: the S3 variant changes its type; chartgen cannot template that"),
    }
}

/// One object of the chart: its value with sentinels and the conditions around it.
struct Doc {
    value: Value,
    conditions: Vec<String>,
}

/// A controller's values, with their defaults from `deploy/`.
struct Controller {
    /// `database-controller`
    component: String,
    /// `databaseController`
    key: String,
    repository: String,
    tag: String,
    pull_policy: String,
    replicas: Value,
    resources: Value,
}

/// The backup claim's values, with their defaults from `deploy/`.
struct Claim {
    name: String,
    size: String,
    storage_class: String,
    access_modes: Value,
}

fn camel(component: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in component.chars() {
        if c == '-' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

fn mapping_mut<'a>(v: &'a mut Value, what: &str) -> Result<&'a mut Mapping> {
    v.as_mapping_mut()
        .with_context(|| format!("{what} is not a mapping"))
}

/// Adds `helm.sh/resource-policy: keep` to the object's annotations.
fn keep_on_uninstall(value: &mut Value) -> Result<()> {
    let metadata = mapping_mut(&mut value["metadata"], "metadata")?;
    let annotations = metadata
        .entry(Value::from("annotations"))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    mapping_mut(annotations, "metadata.annotations")?
        .insert("helm.sh/resource-policy".into(), "keep".into());
    Ok(())
}

/// The controller's values: image, pull policy, replicas, resources.
fn template_controller(t: &mut Templates, doc: &mut Value, component: &str) -> Result<Controller> {
    let key = camel(component);
    let v = format!(".Values.{key}");
    let replicas = doc["spec"]["replicas"].clone();
    ensure!(
        replicas.is_u64(),
        "{component}: spec.replicas is not a number"
    );
    doc["spec"]["replicas"] = t.inline(format!("{{{{ {v}.replicas }}}}"));
    let containers = doc["spec"]["template"]["spec"]["containers"]
        .as_sequence_mut()
        .with_context(|| format!("{component}: no containers"))?;
    let container = containers
        .iter_mut()
        .find(|c| item_name(c) == Some("controller"))
        .with_context(|| format!("{component}: no container `controller`"))?;
    let image = container["image"]
        .as_str()
        .with_context(|| format!("{component}: no image"))?
        .to_string();
    ensure!(
        !image.contains('@'),
        "{component}: an image by digest ({image})"
    );
    let (repository, tag) = image
        .rsplit_once(':')
        .filter(|(_, tag)| !tag.contains('/'))
        .with_context(|| format!("{component}: the image {image} has no tag"))?;
    let pull_policy = container["imagePullPolicy"]
        .as_str()
        .unwrap_or("IfNotPresent")
        .to_string();
    let resources = container["resources"].clone();
    ensure!(resources.is_mapping(), "{component}: no resources");
    let c = mapping_mut(container, "the container")?;
    c.insert(
        "image".into(),
        t.inline(format!(
            r#"{{{{ printf "%s:%s" {v}.image.repository (toString {v}.image.tag) | quote }}}}"#
        )),
    );
    c.insert(
        "imagePullPolicy".into(),
        t.inline(format!("{{{{ {v}.image.pullPolicy | quote }}}}")),
    );
    c.insert("resources".into(), t.block(format!("{v}.resources")));
    // An S3 endpoint of its own (AWS_ENDPOINT_URL), beside the store URL, when the store
    // is S3 and one is set; else the Secret's AWS_ENDPOINT_URL, if any, is used.
    let env = c
        .get_mut("env")
        .and_then(Value::as_sequence_mut)
        .with_context(|| format!("{component}: the container has no env"))?;
    if let Some(at) = env
        .iter()
        .position(|e| item_name(e) == Some("DBOPS_BACKUP_STORE"))
    {
        env.insert(
            at + 1,
            t.raw(&[
                r#"{{- if and (eq .Values.backupStore.type "s3") .Values.backupStore.s3.endpoint }}"#,
                "- name: AWS_ENDPOINT_URL",
                "  value: {{ .Values.backupStore.s3.endpoint | quote }}",
                END,
            ]),
        );
    }
    // Last, as deploy/components/jaeger's patch appends it: the OTLP endpoint
    // (--otlp-endpoint) when one is set; then the controller's extraEnv.
    env.push(t.raw(&[
        "{{- with .Values.tracing.otlpEndpoint }}",
        "- name: OTEL_EXPORTER_OTLP_ENDPOINT",
        "  value: {{ . | quote }}",
        END,
    ]));
    env.push(t.items(format!("{v}.extraEnv")));
    Ok(Controller {
        component: component.to_string(),
        key,
        repository: repository.to_string(),
        tag: tag.to_string(),
        pull_policy,
        replicas,
        resources,
    })
}

/// The claim's values: size, storage class, access modes.
fn template_claim(t: &mut Templates, doc: &mut Value) -> Result<Claim> {
    let name = doc["metadata"]["name"].as_str().unwrap_or("").to_string();
    let spec = mapping_mut(&mut doc["spec"], "the claim's spec")?;
    let size = spec
        .get("resources")
        .and_then(|r| r.get("requests"))
        .and_then(|r| r.get("storage"))
        .and_then(Value::as_str)
        .context("the claim requests no storage")?
        .to_string();
    let access_modes = spec
        .get("accessModes")
        .cloned()
        .context("the claim has no accessModes")?;
    let storage_class = spec
        .remove("storageClassName")
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    let mut out = Mapping::new();
    out.insert(
        t.raw(&[
            "{{- with .Values.backupStore.file.storageClassName }}",
            "storageClassName: {{ . | quote }}",
            END,
        ]),
        Value::Null,
    );
    for (k, v) in std::mem::take(spec) {
        out.insert(k, v);
    }
    out.insert(
        "accessModes".into(),
        t.block(".Values.backupStore.file.accessModes"),
    );
    *spec = out;
    doc["spec"]["resources"]["requests"]["storage"] =
        t.inline("{{ .Values.backupStore.file.size | quote }}");
    keep_on_uninstall(doc)?;
    Ok(Claim {
        name,
        size,
        storage_class,
        access_modes,
    })
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

fn chart_yaml(app_version: &str) -> String {
    format!(
        "# {HEADER}\n\
         apiVersion: v2\n\
         name: dbops\n\
         description: PostgreSQL databases, users, backups and migrations as Kubernetes \
         resources (three controllers), generated from deploy/\n\
         type: application\n\
         version: {}\n\
         appVersion: {}\n",
        env!("CARGO_PKG_VERSION"),
        serde_json::Value::from(app_version),
    )
}

/// A value as one line of YAML (JSON flow style).
fn flow(v: &Value) -> Result<String> {
    serde_json::to_string(v).context("a value as JSON")
}

fn indented(v: &Value, spaces: usize) -> Result<String> {
    let text = serde_norway::to_string(v)?;
    Ok(text
        .lines()
        .map(|l| format!("{}{l}\n", " ".repeat(spaces)))
        .collect())
}

fn values_yaml(controllers: &[Controller], claim: &Claim, s3: &S3Defaults) -> Result<String> {
    let mut y = format!(
        "# {HEADER}\n\
         # The defaults render what `kubectl kustomize deploy/` renders. Everything is installed\n\
         # into the namespace dbops-system (the names are deploy/'s), whatever namespace the\n\
         # release is recorded in.\n\n\
         namespace:\n\
         \x20 # Render the Namespace dbops-system (with the restricted Pod Security labels of\n\
         \x20 # deploy/namespace.yaml; kept on `helm uninstall`). false when it exists already, for\n\
         \x20 # example made by `helm install --namespace dbops-system --create-namespace` (then\n\
         \x20 # label it as deploy/namespace.yaml does).\n\
         \x20 create: true\n"
    );
    for c in controllers {
        y.push_str(&format!(
            "\n# The {}: its image, replicas (leader-elected: one works, the others stand by),\n\
             # the resources of its container and more environment variables for it.\n\
             {}:\n\
             \x20 image:\n\
             \x20   repository: {}\n\
             \x20   tag: {}\n\
             \x20   pullPolicy: {}\n\
             \x20 replicas: {}\n\
             \x20 resources:\n{}\
             \x20 # Appended to the container's env, as Kubernetes writes them, for example\n\
             \x20 # [{{name: DBOPS_CONCURRENCY, value: \"8\"}}] (every flag has its variable; see\n\
             \x20 # docs/operations.md#flags). Do not repeat one deploy/ or tracing sets.\n\
             \x20 extraEnv: []\n",
            c.component,
            c.key,
            flow(&Value::from(c.repository.as_str()))?,
            flow(&Value::from(c.tag.as_str()))?,
            flow(&Value::from(c.pull_policy.as_str()))?,
            flow(&c.replicas)?,
            indented(&c.resources, 4)?,
        ));
    }
    y.push_str(&format!(
        "\n# Where Backup artifacts go (the backup- and database-controller share it).\n\
         backupStore:\n\
         \x20 # file: the claim {claim} (ReadWriteMany), mounted by both controllers at\n\
         \x20 #   /var/lib/dbops/backups (file:///var/lib/dbops/backups); kept on `helm uninstall`.\n\
         \x20 # s3: a bucket, as deploy/components/s3-backup-store does: no claim; the Secret\n\
         \x20 #   `secretName` in dbops-system (create it first) gives every key as an environment\n\
         \x20 #   variable: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, and as needed\n\
         \x20 #   AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP.\n\
         \x20 type: file\n\
         \x20 file:\n\
         \x20   size: {size}\n\
         \x20   # Empty: the cluster's default class (it must be ReadWriteMany-capable).\n\
         \x20   storageClassName: {class}\n\
         \x20   accessModes: {modes}\n\
         \x20 s3:\n\
         \x20   # s3://<bucket>/<prefix>\n\
         \x20   url: {url}\n\
         \x20   secretName: {secret}\n\
         \x20   # The S3 endpoint (MinIO, Ceph RGW, ...) as AWS_ENDPOINT_URL, when not in the Secret.\n\
         \x20   endpoint: \"\"\n\
         \n\
         # The controllers' NetworkPolicies (in: metrics and probes on 8080; out: the\n\
         # apiserver, DNS, PostgreSQL on 5432, Jaeger on 4317, the S3 endpoint on 443 and 9000).\n\
         # A DatabaseServer on another port or an S3 endpoint on another port needs a policy\n\
         # of your own beside them.\n\
         networkPolicy:\n\
         \x20 enabled: true\n\
         \n\
         # Traces: the OTLP/gRPC endpoint (--otlp-endpoint) the three controllers export to, as\n\
         # OTEL_EXPORTER_OTLP_ENDPOINT; empty: no traces. For example the Jaeger of\n\
         # deploy/components/jaeger/jaeger.yaml (kubectl apply -f it):\n\
         # http://jaeger-collector.dbops-system.svc:4317. The NetworkPolicies let the controllers\n\
         # reach only that Jaeger's pods (app.kubernetes.io/name=jaeger in dbops-system) on 4317:\n\
         # a collector elsewhere needs a policy of your own beside them.\n\
         tracing:\n\
         \x20 otlpEndpoint: \"\"\n",
        claim = claim.name,
        size = flow(&Value::from(claim.size.as_str()))?,
        class = flow(&Value::from(claim.storage_class.as_str()))?,
        modes = flow(&claim.access_modes)?,
        url = flow(&Value::from(s3.url.as_str()))?,
        secret = flow(&Value::from(s3.secret_name.as_str()))?,
    ));
    Ok(y)
}

/// A JSON schema of the values (Helm checks it on install, upgrade, template and lint):
/// no key it does not know, so a misspelt `--set` fails instead of doing nothing.
fn values_schema(controllers: &[Controller]) -> serde_json::Value {
    use serde_json::json;
    let object = |properties: serde_json::Value| json!({"type": "object", "additionalProperties": false, "properties": properties});
    let mut top = serde_json::Map::new();
    top.insert(
        "namespace".into(),
        object(json!({"create": {"type": "boolean"}})),
    );
    for c in controllers {
        top.insert(
            c.key.clone(),
            object(json!({
                "image": object(json!({
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": ["string", "number"]},
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                })),
                "replicas": {"type": "integer", "minimum": 0},
                "resources": object(json!({
                    "requests": {"type": "object"},
                    "limits": {"type": "object"},
                    "claims": {"type": "array"},
                })),
                "extraEnv": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string", "minLength": 1}},
                    },
                },
            })),
        );
    }
    top.insert(
        "backupStore".into(),
        object(json!({
            "type": {"enum": ["file", "s3"]},
            "file": object(json!({
                "size": {"type": "string", "minLength": 1},
                "storageClassName": {"type": "string"},
                "accessModes": {
                    "type": "array", "minItems": 1,
                    "items": {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]},
                },
            })),
            "s3": object(json!({
                "url": {"type": "string", "pattern": "^s3://[^/]+"},
                "secretName": {"type": "string", "minLength": 1},
                "endpoint": {"type": "string"},
            })),
        })),
    );
    top.insert(
        "networkPolicy".into(),
        object(json!({"enabled": {"type": "boolean"}})),
    );
    top.insert(
        "tracing".into(),
        object(json!({"otlpEndpoint": {"type": "string"}})),
    );
    let mut schema = object(serde_json::Value::Object(top));
    schema["$schema"] = json!("http://json-schema.org/draft-07/schema#");
    schema
}

fn readme(
    controllers: &[Controller],
    claim: &Claim,
    s3: &S3Defaults,
    crds: &[Value],
) -> Result<String> {
    let mut rows = String::new();
    for c in controllers {
        let k = &c.key;
        rows.push_str(&format!(
            "| `{k}.image.repository` | `{}` |\n| `{k}.image.tag` | `{}` |\n\
             | `{k}.image.pullPolicy` | `{}` |\n| `{k}.replicas` | `{}` |\n\
             | `{k}.resources` | `{}` |\n| `{k}.extraEnv` | `[]` |\n",
            c.repository,
            c.tag,
            c.pull_policy,
            flow(&c.replicas)?,
            flow(&c.resources)?,
        ));
    }
    let crd_names: Vec<String> = crds
        .iter()
        .filter_map(|c| c["metadata"]["name"].as_str())
        .map(|n| format!("`{n}`"))
        .collect();
    Ok(format!(
        r#"<!-- {HEADER} -->
# dbops Helm chart

The same objects as `kubectl apply -k deploy/`: the namespace `dbops-system`, the CRDs
{crds}, and per controller (database-, backup-, migration-controller) a ServiceAccount,
least-privilege RBAC, a Deployment of two leader-elected replicas, a PodDisruptionBudget, a
metrics Service and a NetworkPolicy, and the backup store's claim `{claim}`. The chart is
generated from `deploy/` (kustomize stays the one source): change `deploy/`, then run

    {GENERATOR}             # rewrites charts/dbops
    {GENERATOR} -- --check  # fails, with a diff, when charts/dbops is not what deploy/ generates

With its default values `helm template --include-crds` renders exactly what
`kubectl kustomize deploy/` renders, but for the annotation `helm.sh/resource-policy: keep`
on the Namespace and on the claim (`helm uninstall` leaves the namespace, its admin Secrets
and the backups alone). The e2e tests (`e2e/tests/e2e/chart.rs`) check both, and
`e2e/validate-manifests` runs `kubeconform -strict` on both.

## Install

Everything goes into `dbops-system` whatever the release's namespace. Either let the chart
make the namespace (with the restricted Pod Security labels) and record the release
elsewhere:

    helm install dbops charts/dbops --namespace default

or make the namespace first and record the release in it:

    kubectl apply -f deploy/namespace.yaml
    helm install dbops charts/dbops --namespace dbops-system --set namespace.create=false

(`helm install --create-namespace` makes it without the Pod Security labels: label it as
`deploy/namespace.yaml` does.) Helm installs the CRDs of `crds/` before the rest and never
upgrades or deletes them: after an upgrade of the chart, `kubectl apply -f charts/dbops/crds/`
(or `kubectl apply --server-side -f deploy/crds/`).

An S3 bucket instead of the claim (as `deploy/components/s3-backup-store`; the Secret
before or right after the install: the pods do not start without it):

    kubectl -n dbops-system create secret generic {secret} \
      --from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=... \
      --from-literal=AWS_REGION=eu-west-1
    helm install dbops charts/dbops --set backupStore.type=s3 \
      --set backupStore.s3.url=s3://my-bucket/dbops

Traces to an OTLP/gRPC collector (the controllers' `--otlp-endpoint`; empty, the default:
none), for example the Jaeger of `deploy/components/jaeger` (traces in memory), whose
`jaeger.yaml` goes into `dbops-system` once the namespace exists:

    helm install dbops charts/dbops \
      --set tracing.otlpEndpoint=http://jaeger-collector.dbops-system.svc:4317
    kubectl apply -f deploy/components/jaeger/jaeger.yaml

The NetworkPolicies let the controllers reach that Jaeger's pods (labelled
`app.kubernetes.io/name=jaeger` in `dbops-system`) on 4317, nothing else on that port: a
collector elsewhere needs a NetworkPolicy of your own beside them (policies add up), as
does a DatabaseServer on a port other than 5432 or an S3 endpoint on a port other than 443
or 9000. Any other variable goes into a controller's `extraEnv`, appended to its container's
`env` as written (`--set-string databaseController.extraEnv[0].name=DBOPS_CONCURRENCY`,
`--set-string databaseController.extraEnv[0].value=8`; every flag has its variable).

## Values

`values.schema.json` refuses a key the chart does not know.

| value | default |
|---|---|
| `namespace.create` | `true` |
{rows}| `backupStore.type` | `file` (or `s3`) |
| `backupStore.file.size` | `{size}` |
| `backupStore.file.storageClassName` | `"{class}"` (the default class) |
| `backupStore.file.accessModes` | `{modes}` |
| `backupStore.s3.url` | `{url}` |
| `backupStore.s3.secretName` | `{secret}` |
| `backupStore.s3.endpoint` | `""` (AWS_ENDPOINT_URL from the Secret, if any) |
| `networkPolicy.enabled` | `true` |
| `tracing.otlpEndpoint` | `""` (no traces) |

Anything else (probes, security contexts, arguments, RBAC, the NetworkPolicies' rules) is `deploy/`'s as it is: change
it there and regenerate, or adjust the rendered manifests with `helm install --post-renderer`.
"#,
        crds = crd_names.join(", "),
        claim = claim.name,
        secret = s3.secret_name,
        size = claim.size,
        class = claim.storage_class,
        modes = flow(&claim.access_modes)?,
        url = s3.url,
    ))
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
