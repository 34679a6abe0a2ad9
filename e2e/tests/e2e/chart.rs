//! The Helm chart `charts/dbops` and what validates the manifests, with no cluster: the
//! chart is what `deploy/` generates (the drift check), `helm template` renders what
//! `kubectl kustomize` renders (with the file store and with the S3 component), its values
//! take effect, and `kubeconform -strict` accepts everything shipped and refuses a mistake.
//! helm and kubeconform are built from Go modules by e2e/install.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dbops_e2e::chart::{self, kustomize, object_id, overlay, parse_documents};
use dbops_e2e::kubeconform::{self, Manifests, helm_template};
use dbops_e2e::paths;
use serde_norway::Value;

fn deploy_dir() -> PathBuf {
    paths::repo_root().join("deploy")
}

fn chart_dir() -> PathBuf {
    paths::repo_root().join(chart::CHART_DIR)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

#[test]
fn the_chart_is_what_deploy_generates() {
    if let Some(diff) = chart::check(&deploy_dir(), &chart_dir()).unwrap() {
        panic!(
            "charts/dbops is not what deploy/ generates: run `{}`\n{diff}",
            chart::GENERATOR
        );
    }
    // The check can fail: a copy of the chart with one default changed, one with a file
    // more.
    let copy = tempfile::tempdir().unwrap();
    let edited = copy.path().join("edited");
    copy_dir(&chart_dir(), &edited);
    let values = edited.join("values.yaml");
    let text = std::fs::read_to_string(&values).unwrap();
    assert!(text.contains("replicas: 2"), "{text}");
    std::fs::write(&values, text.replacen("replicas: 2", "replicas: 3", 1)).unwrap();
    let diff = chart::check(&deploy_dir(), &edited)
        .unwrap()
        .expect("an edited chart is drift");
    assert!(diff.contains("values.yaml"), "{diff}");
    let extra = copy.path().join("extra");
    copy_dir(&chart_dir(), &extra);
    std::fs::write(
        extra.join("templates/hand-written.yaml"),
        "kind: ConfigMap\n",
    )
    .unwrap();
    let diff = chart::check(&deploy_dir(), &extra)
        .unwrap()
        .expect("a file more is drift");
    assert!(diff.contains("hand-written.yaml"), "{diff}");
}

/// Objects by identity (apiVersion, kind, namespace, name).
fn by_id(objects: Vec<Value>) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for o in objects {
        let id = object_id(&o);
        assert!(out.insert(id.clone(), o).is_none(), "{id} twice");
    }
    out
}

/// Takes `helm.sh/resource-policy: keep` off the object; whether it was there.
fn take_keep(o: &mut Value) -> bool {
    let Some(annotations) = o["metadata"]
        .get_mut("annotations")
        .and_then(Value::as_mapping_mut)
    else {
        return false;
    };
    let kept = annotations.remove("helm.sh/resource-policy") == Some(Value::from("keep"));
    if annotations.is_empty() {
        o["metadata"]
            .as_mapping_mut()
            .unwrap()
            .remove("annotations");
    }
    kept
}

/// Each container's `env` sorted by name: a strategic merge patch (the S3 component's)
/// moves the item it patches to the front, which changes nothing here (no `$(VAR)`
/// refers to another variable).
fn sort_env(o: &mut Value) {
    let Some(containers) = o["spec"]["template"]["spec"]
        .get_mut("containers")
        .and_then(Value::as_sequence_mut)
    else {
        return;
    };
    for c in containers {
        if let Some(env) = c.get_mut("env").and_then(Value::as_sequence_mut) {
            env.sort_by_key(|e| e["name"].as_str().unwrap_or("").to_string());
        }
    }
}

fn assert_same_objects(
    what: &str,
    kustomized: &BTreeMap<String, Value>,
    helm: &BTreeMap<String, Value>,
) {
    let k: Vec<&String> = kustomized.keys().collect();
    let h: Vec<&String> = helm.keys().collect();
    assert_eq!(k, h, "{what}: the objects (kind, name, namespace) differ");
    for (id, want) in kustomized {
        let got = &helm[id];
        assert!(
            want == got,
            "{what}: {id} differs\n-- kustomize --\n{}\n-- helm --\n{}",
            serde_norway::to_string(want).unwrap(),
            serde_norway::to_string(got).unwrap()
        );
    }
}

#[test]
fn helm_template_renders_what_kustomize_renders() {
    // The defaults: deploy/ itself, with the file store.
    let kustomized = by_id(kustomize(&deploy_dir()).unwrap());
    let mut helm = by_id(parse_documents(&helm_template(&chart_dir(), &[]).unwrap()).unwrap());
    assert!(
        kustomized.keys().any(|id| id.contains("/NetworkPolicy "))
            && kustomized
                .keys()
                .any(|id| id.contains("/CustomResourceDefinition "))
            && kustomized
                .keys()
                .any(|id| id.contains("/PersistentVolumeClaim ")),
        "{:#?}",
        kustomized.keys()
    );
    // The one difference on purpose: `helm uninstall` keeps the namespace and the claim.
    let kept: Vec<String> = helm
        .iter_mut()
        .filter_map(|(id, o)| take_keep(o).then(|| id.clone()))
        .collect();
    assert_eq!(
        kept,
        [
            "v1/Namespace /dbops-system",
            "v1/PersistentVolumeClaim dbops-system/dbops-backups"
        ],
    );
    assert_same_objects("default values", &kustomized, &helm);

    // An S3 store: deploy/ with components/s3-backup-store.
    let s3 = overlay(&deploy_dir(), &["s3-backup-store"]).unwrap();
    let mut kustomized = by_id(kustomize(s3.path()).unwrap());
    let mut helm = by_id(
        parse_documents(&helm_template(&chart_dir(), &["--set", "backupStore.type=s3"]).unwrap())
            .unwrap(),
    );
    assert!(
        !kustomized
            .keys()
            .any(|id| id.contains("PersistentVolumeClaim"))
    );
    for o in kustomized.values_mut().chain(helm.values_mut()) {
        take_keep(o);
        sort_env(o);
    }
    assert_same_objects("backupStore.type=s3", &kustomized, &helm);

    // Traces: deploy/ with components/jaeger, but for Jaeger's own objects (jaeger.yaml,
    // applied apart from the chart), is the chart with tracing.otlpEndpoint set to the
    // component's endpoint: the same variable, last in each controller's env.
    let jaeger = overlay(&deploy_dir(), &["jaeger"]).unwrap();
    let mut kustomized = by_id(kustomize(jaeger.path()).unwrap());
    let jaeger_objects =
        std::fs::read_to_string(deploy_dir().join("components/jaeger/jaeger.yaml")).unwrap();
    for o in parse_documents(&jaeger_objects).unwrap() {
        let id = object_id(&o);
        assert!(kustomized.remove(&id).is_some(), "{id} not rendered");
    }
    let endpoint = "http://jaeger-collector.dbops-system.svc:4317";
    let mut helm = by_id(
        parse_documents(
            &helm_template(
                &chart_dir(),
                &["--set", &format!("tracing.otlpEndpoint={endpoint}")],
            )
            .unwrap(),
        )
        .unwrap(),
    );
    for o in kustomized.values_mut().chain(helm.values_mut()) {
        take_keep(o);
    }
    for name in CONTROLLERS {
        let (_, c) = controller(&kustomized, name);
        let env = c["env"].as_sequence().unwrap();
        assert_eq!(
            (&env.last().unwrap()["name"], &env.last().unwrap()["value"]),
            (
                &Value::from("OTEL_EXPORTER_OTLP_ENDPOINT"),
                &Value::from(endpoint)
            ),
            "{name}: components/jaeger no longer sets this endpoint last"
        );
    }
    assert_same_objects("tracing.otlpEndpoint", &kustomized, &helm);
}

const CONTROLLERS: [&str; 3] = [
    "database-controller",
    "backup-controller",
    "migration-controller",
];

/// The Deployment `dbops-<controller>` and its container `controller`.
fn controller<'a>(objects: &'a BTreeMap<String, Value>, name: &str) -> (&'a Value, &'a Value) {
    let d = &objects[&format!("apps/v1/Deployment dbops-system/dbops-{name}")];
    let c = d["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "controller")
        .unwrap();
    (d, c)
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_sequence()?
        .iter()
        .find(|e| e["name"] == name)?["value"]
        .as_str()
}

#[test]
fn the_charts_values_take_effect() {
    let set = |pairs: &[&str]| -> BTreeMap<String, Value> {
        let args: Vec<&str> = pairs.iter().flat_map(|p| ["--set", *p]).collect();
        by_id(parse_documents(&helm_template(&chart_dir(), &args).unwrap()).unwrap())
    };
    let objects = set(&[
        "databaseController.image.repository=registry.example/dbops-database-controller",
        "databaseController.image.tag=1.2.3",
        "backupController.image.pullPolicy=Always",
        "migrationController.replicas=3",
        "backupController.resources.limits.memory=1Gi",
        "networkPolicy.enabled=false",
        "namespace.create=false",
        "backupStore.file.size=5Gi",
        "backupStore.file.storageClassName=nfs-client",
        "backupStore.file.accessModes={ReadWriteOnce}",
    ]);
    let (database, c) = controller(&objects, "database-controller");
    assert_eq!(
        c["image"],
        "registry.example/dbops-database-controller:1.2.3"
    );
    assert_eq!(database["spec"]["replicas"], 2);
    let (_, c) = controller(&objects, "backup-controller");
    assert_eq!(c["image"], "ghcr.io/dbops/dbops-backup-controller:0.1.0");
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(c["resources"]["limits"]["memory"], "1Gi");
    assert_eq!(
        c["resources"]["limits"]["cpu"], "1",
        "the other defaults stay"
    );
    let (migration, c) = controller(&objects, "migration-controller");
    assert_eq!(migration["spec"]["replicas"], 3);
    assert_eq!(c["imagePullPolicy"], "IfNotPresent");
    assert!(!objects.keys().any(|id| id.contains("/NetworkPolicy ")));
    assert!(!objects.keys().any(|id| id.contains("/Namespace ")));
    let claim = &objects["v1/PersistentVolumeClaim dbops-system/dbops-backups"];
    assert_eq!(claim["spec"]["resources"]["requests"]["storage"], "5Gi");
    assert_eq!(claim["spec"]["storageClassName"], "nfs-client");
    assert_eq!(
        claim["spec"]["accessModes"],
        Value::Sequence(vec!["ReadWriteOnce".into()])
    );

    // The S3 store, with an endpoint of its own.
    let objects = set(&[
        "backupStore.type=s3",
        "backupStore.s3.url=s3://bucket-x/prefix",
        "backupStore.s3.secretName=my-s3",
        "backupStore.s3.endpoint=https://minio.example:9000",
    ]);
    assert!(
        !objects
            .keys()
            .any(|id| id.contains("PersistentVolumeClaim"))
    );
    for name in ["database-controller", "backup-controller"] {
        let (d, c) = controller(&objects, name);
        assert_eq!(
            env_value(c, "DBOPS_BACKUP_STORE"),
            Some("s3://bucket-x/prefix")
        );
        assert_eq!(
            env_value(c, "AWS_ENDPOINT_URL"),
            Some("https://minio.example:9000")
        );
        assert_eq!(c["envFrom"][0]["secretRef"]["name"], "my-s3", "{name}");
        let volumes = d["spec"]["template"]["spec"]["volumes"]
            .as_sequence()
            .unwrap();
        assert!(
            !volumes.iter().any(|v| v["name"] == "backups"),
            "{name}: {volumes:?}"
        );
    }
    let (_, c) = controller(&objects, "migration-controller");
    assert!(c.get("envFrom").is_none() && env_value(c, "DBOPS_BACKUP_STORE").is_none());
    // Without an endpoint, none is set (the Secret's, if any, counts).
    let objects = set(&["backupStore.type=s3"]);
    let (_, c) = controller(&objects, "backup-controller");
    assert_eq!(env_value(c, "AWS_ENDPOINT_URL"), None);

    // Traces and more variables: the endpoint on all three controllers, each extraEnv on
    // its own controller only, after deploy/'s variables (which stay); by default neither.
    let names = |c: &Value| -> Vec<String> {
        c["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect()
    };
    let defaults = set(&[]);
    let args = [
        "--set",
        "tracing.otlpEndpoint=http://otel-collector.observability.svc:4317",
        "--set-string",
        "databaseController.extraEnv[0].name=DBOPS_CONCURRENCY",
        "--set-string",
        "databaseController.extraEnv[0].value=8",
        "--set-json",
        r#"migrationController.extraEnv=[{"name":"DBOPS_NODE_UID","valueFrom":{"fieldRef":{"fieldPath":"metadata.uid"}}}]"#,
    ];
    let text = helm_template(&chart_dir(), &args).unwrap();
    let objects = by_id(parse_documents(&text).unwrap());
    for name in CONTROLLERS {
        let (_, before) = controller(&defaults, name);
        let (_, c) = controller(&objects, name);
        assert_eq!(
            env_value(before, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            None,
            "{name}"
        );
        assert_eq!(
            env_value(c, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            Some("http://otel-collector.observability.svc:4317"),
            "{name}"
        );
        let mut want = names(before);
        want.push("OTEL_EXPORTER_OTLP_ENDPOINT".into());
        match name {
            "database-controller" => want.push("DBOPS_CONCURRENCY".into()),
            "migration-controller" => want.push("DBOPS_NODE_UID".into()),
            _ => {}
        }
        assert_eq!(names(c), want, "{name}");
    }
    let (_, c) = controller(&objects, "database-controller");
    assert_eq!(env_value(c, "DBOPS_CONCURRENCY"), Some("8"));
    let (_, c) = controller(&objects, "migration-controller");
    let uid = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "DBOPS_NODE_UID")
        .unwrap();
    assert_eq!(uid["valueFrom"]["fieldRef"]["fieldPath"], "metadata.uid");
    // What they render is valid Kubernetes.
    let outcomes = kubeconform::validate(&[Manifests {
        name: "helm template charts/dbops with tracing and extraEnv".into(),
        text,
    }])
    .unwrap();
    assert!(outcomes[0].resources > 0);

    // values.schema.json: a misspelt value or an unknown store is refused, not ignored.
    for (bad, says) in [
        ("databaseControler.replicas=3", "databaseControler"),
        ("backupStore.type=gcs", "backupStore"),
        ("migrationController.replicas=-1", "replicas"),
        ("backupController.extraEnv[0].value=x", "name"),
        ("tracing.otlpEndpont=http://x:4317", "otlpEndpont"),
    ] {
        let err = helm_template(&chart_dir(), &["--set", bad]).unwrap_err();
        assert!(format!("{err:#}").contains(says), "--set {bad}: {err:#}");
    }
}

#[test]
fn kubeconform_strict_accepts_what_dbops_ships_and_refuses_a_mistake() {
    let manifests = kubeconform::shipped_manifests().unwrap();
    let names: Vec<&str> = manifests.iter().map(|m| m.name.as_str()).collect();
    for wanted in [
        "kubectl kustomize deploy/",
        "deploy/ with components/s3-backup-store",
        "helm template charts/dbops",
        "helm template charts/dbops --set backupStore.type=s3",
    ] {
        assert!(names.contains(&wanted), "{wanted} not validated: {names:?}");
    }
    let outcomes = kubeconform::validate(&manifests).unwrap();
    for o in &outcomes {
        assert!(o.resources > 0, "{}: nothing validated", o.name);
        eprintln!("{}: {} resources valid", o.name, o.resources);
    }

    // The schemas are strict: an unknown field, a wrong type, an unknown field of a
    // custom resource, each refused.
    for (bad, says) in [
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\n\
             spec: {ports: [{port: 80, targetPort: http, protocl: TCP}]}\n",
            "protocl",
        ),
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: n}\n\
             spec: {podSelector: {}, egress: [{ports: [{port: 53}]}], ingres: []}\n",
            "ingres",
        ),
        (
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n\
             spec: {replicas: two, selector: {}, template: {spec: {containers: []}}}\n",
            "replicas",
        ),
        (
            "apiVersion: dbops.dev/v1alpha1\nkind: Database\nmetadata: {name: d}\n\
             spec: {serverRef: {name: s}, deletionPolcy: Delete}\n",
            "deletionPolcy",
        ),
    ] {
        let err = kubeconform::validate(&[Manifests {
            name: "a mistake".into(),
            text: bad.into(),
        }])
        .map(|_| ())
        .unwrap_err();
        assert!(format!("{err:#}").contains(says), "{bad}: {err:#}");
    }
}
