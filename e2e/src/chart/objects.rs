//! The fields of `deploy/`'s objects that become values: per controller its image,
//! replicas and resources; the backup claim's size, class and access modes.

use anyhow::{Context, Result, ensure};
use serde_norway::{Mapping, Value};

use super::template::{END, Templates, item_name};

/// One object of the chart: its value with sentinels and the conditions around it.
pub(super) struct Doc {
    pub(super) value: Value,
    pub(super) conditions: Vec<String>,
}

/// A controller's values, with their defaults from `deploy/`.
pub(super) struct Controller {
    /// `database-controller`
    pub(super) component: String,
    /// `databaseController`
    pub(super) key: String,
    pub(super) repository: String,
    pub(super) tag: String,
    pub(super) pull_policy: String,
    pub(super) replicas: Value,
    pub(super) resources: Value,
}

/// The backup claim's values, with their defaults from `deploy/`.
pub(super) struct Claim {
    pub(super) name: String,
    pub(super) size: String,
    pub(super) storage_class: String,
    pub(super) access_modes: Value,
}

pub(super) fn camel(component: &str) -> String {
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

pub(super) fn mapping_mut<'a>(v: &'a mut Value, what: &str) -> Result<&'a mut Mapping> {
    v.as_mapping_mut()
        .with_context(|| format!("{what} is not a mapping"))
}

/// Adds `helm.sh/resource-policy: keep` to the object's annotations.
pub(super) fn keep_on_uninstall(value: &mut Value) -> Result<()> {
    let metadata = mapping_mut(&mut value["metadata"], "metadata")?;
    let annotations = metadata
        .entry(Value::from("annotations"))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    mapping_mut(annotations, "metadata.annotations")?
        .insert("helm.sh/resource-policy".into(), "keep".into());
    Ok(())
}

/// The controller's values: image, pull policy, replicas, resources.
pub(super) fn template_controller(
    t: &mut Templates,
    doc: &mut Value,
    component: &str,
) -> Result<Controller> {
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
pub(super) fn template_claim(t: &mut Templates, doc: &mut Value) -> Result<Claim> {
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
