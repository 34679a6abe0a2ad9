//! The chart's own files: Chart.yaml, values.yaml, values.schema.json and README.md.

use anyhow::{Context, Result};
use serde_norway::Value;

use super::objects::{Claim, Controller};
use super::template::S3Defaults;

/// What every generated file starts with (as a comment).
/// The command that writes it (named in every generated file).
pub const GENERATOR: &str = "cargo run -p dbops-e2e --bin chartgen";
pub(super) const HEADER: &str =
    "Generated from deploy/ by `cargo run -p dbops-e2e --bin chartgen`; do not edit.";

pub(super) fn chart_yaml(app_version: &str) -> String {
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
pub(super) fn flow(v: &Value) -> Result<String> {
    serde_json::to_string(v).context("a value as JSON")
}

pub(super) fn indented(v: &Value, spaces: usize) -> Result<String> {
    let text = serde_norway::to_string(v)?;
    Ok(text
        .lines()
        .map(|l| format!("{}{l}\n", " ".repeat(spaces)))
        .collect())
}

pub(super) fn values_yaml(
    controllers: &[Controller],
    claim: &Claim,
    s3: &S3Defaults,
) -> Result<String> {
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
pub(super) fn values_schema(controllers: &[Controller]) -> serde_json::Value {
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

pub(super) fn readme(
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
