//! The backup store the backup-controller writes and the database-controller reads back
//! (`spec.restoreFrom`) must be one store, writable, and outlive pods:
//!
//! - a controller on a `file://` store it cannot write is not ready and says why
//!   (`BackupStoreNotWritable`, the path), keeps `/healthz` up, stops at once on SIGTERM,
//!   and becomes ready when the directory is fixed;
//! - the two controllers on different stores: the one started second is not ready
//!   (`BackupStoreMismatch`, both identities, the ConfigMap `dbops-backup-store`); on the
//!   same store, `file://` or `s3://`, both are ready;
//! - `deploy/` mounts one ReadWriteMany claim in both Deployments, where their store URL
//!   points, and `deploy/components/s3-backup-store` turns that into an `s3://` store with
//!   credentials from a Secret and no claim.
//!
//! The directory that cannot be written is a path under a regular file (`ENOTDIR`): the
//! tests run as root, who ignores permission bits, and this fails for every user.

use std::path::Path;
use std::time::{Duration, Instant};

use dbops_e2e::ControllerProcess;
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::s3::S3Server;
use dbops_shared::backup_store::{BackupStore, IDENTITY_OBJECT, registry};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use serde::Deserialize;
use serde_json::Value;

use crate::bed;

/// The retry of a blocked controller is 10 s; this leaves room for a slow machine.
const READY_AFTER_FIX: Duration = Duration::from_secs(45);

/// Starts `controller` with its own ServiceAccount's token, scoped to `ns` (which is then
/// also its `--controller-namespace`), on `store`.
async fn start(
    b: &crate::Bed,
    controller: &str,
    logs: &Path,
    store: &str,
    env: &[(String, String)],
) -> ControllerProcess {
    let kubeconfig = crate::controller_kubeconfig(b.cp, controller).await;
    let args = vec![
        format!("--watch-namespace={}", b.ns.name()),
        format!("--backup-store={store}"),
    ];
    ControllerProcess::start_with_env(controller, &kubeconfig, logs, &args, env)
        .unwrap_or_else(|e| panic!("starting the {controller}: {}", redact(&format!("{e:#}"))))
}

fn redact(text: &str) -> String {
    redact_passwords(text)
}

/// Waits until `/readyz` answers `code` with a body containing every one of `parts`.
async fn wait_readyz(c: &ControllerProcess, code: u16, parts: &[&str], timeout: Duration) {
    let what = format!("{} /readyz {code} naming {parts:?}", c.process.name());
    let result = dbops_e2e::wait::wait_for(
        &what,
        timeout,
        || async { c.get("/readyz") },
        |(got, body)| *got == code && parts.iter().all(|p| body.contains(p)),
    )
    .await;
    if let Err(e) = result {
        panic!(
            "{e:#}\n---- {} log ----\n{}",
            c.process.name(),
            redact(&c.process.log_tail(4000))
        );
    }
}

async fn registration(b: &crate::Bed) -> ConfigMap {
    let api: Api<ConfigMap> = Api::namespaced(b.client.clone(), b.ns.name());
    api.get(registry::CONFIG_MAP).await.unwrap()
}

fn data<'a>(cm: &'a ConfigMap, key: &str) -> &'a str {
    cm.data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(String::as_str)
        .unwrap_or_default()
}

#[tokio::test]
async fn a_controller_on_a_store_it_cannot_write_is_not_ready_until_it_can() {
    let b = bed("store-unwritable").await;
    let logs = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // A regular file where the store's parent directory should be: ENOTDIR, even for root.
    let blocker = dir.path().join("volume");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let root = blocker.join("backups");
    let url = format!("file://{}", root.display());
    let path = root.display().to_string();

    let mut backup = start(&b, "backup-controller", logs.path(), &url, &[]).await;
    let mut database = start(&b, "database-controller", logs.path(), &url, &[]).await;
    for c in [&backup, &database] {
        wait_readyz(
            c,
            503,
            &["BackupStoreNotWritable", &path, "Not a directory"],
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(c.get("/healthz").unwrap().0, 200, "alive while blocked");
    }
    let log = backup.process.log_tail(20_000);
    assert!(
        log.contains("WARN") && log.contains("BackupStoreNotWritable"),
        "the reason is logged at warn:\n{log}"
    );
    assert!(
        !log.contains("controller started"),
        "no controller runs on an unwritable store:\n{log}"
    );

    // SIGTERM during the wait stops the process at once.
    database.process.signal("TERM").unwrap();
    let asked = Instant::now();
    let status = database.process.wait_exit(Duration::from_secs(10)).unwrap();
    let took = asked.elapsed();
    assert!(
        status.success() && took < Duration::from_secs(3),
        "exited with {status} after {took:?}:\n{}",
        redact(&database.process.log_tail(3000))
    );

    // Fixed: the path is a directory now; the next check passes.
    let fixed = Instant::now();
    std::fs::remove_file(&blocker).unwrap();
    std::fs::create_dir_all(&root).unwrap();
    wait_readyz(&backup, 200, &["ready"], READY_AFTER_FIX).await;
    eprintln!("ready {:?} after the fix", fixed.elapsed());
    let id = std::fs::read_to_string(root.join(IDENTITY_OBJECT)).unwrap();
    let cm = registration(&b).await;
    assert_eq!(data(&cm, registry::ID_KEY), id.trim());
    assert_eq!(data(&cm, registry::URL_KEY), url);
    // No probe file is left behind.
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, [IDENTITY_OBJECT]);
    let status = backup
        .process
        .signal_and_wait("TERM", Duration::from_secs(15));
    assert!(status.unwrap().success());
}

#[tokio::test]
async fn the_backup_and_database_controller_must_share_one_store() {
    let b = bed("store-shared").await;
    let logs = tempfile::tempdir().unwrap();
    let (one, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one_url = format!("file://{}", one.path().display());
    let other_url = format!("file://{}", other.path().display());

    let backup = start(&b, "backup-controller", logs.path(), &one_url, &[]).await;
    wait_readyz(&backup, 200, &["ready"], Duration::from_secs(60)).await;
    let id = std::fs::read_to_string(one.path().join(IDENTITY_OBJECT)).unwrap();
    let id = id.trim();
    let cm = registration(&b).await;
    assert_eq!(data(&cm, registry::ID_KEY), id);
    assert_eq!(data(&cm, registry::URL_KEY), one_url);

    // Started second, on another directory: not ready, and it says which stores differ.
    let mut database = start(&b, "database-controller", logs.path(), &other_url, &[]).await;
    let registered = format!(
        "(ConfigMap {}/{}, url {one_url}) has identity {id}",
        b.ns.name(),
        registry::CONFIG_MAP
    );
    wait_readyz(
        &database,
        503,
        &[
            "BackupStoreMismatch",
            &format!("this process's backup store {other_url} has identity"),
            &registered,
            "delete that ConfigMap",
        ],
        Duration::from_secs(30),
    )
    .await;
    let other_id = std::fs::read_to_string(other.path().join(IDENTITY_OBJECT)).unwrap();
    assert_ne!(other_id.trim(), id);
    let (_, body) = database.get("/readyz").unwrap();
    assert!(body.contains(other_id.trim()), "{body}");
    let log = database.process.log_tail(20_000);
    assert!(
        !log.contains("controller started"),
        "no controller runs on the wrong store:\n{log}"
    );
    // The registration is left as the first controller made it.
    assert_eq!(data(&registration(&b).await, registry::ID_KEY), id);
    let status = database
        .process
        .signal_and_wait("TERM", Duration::from_secs(10));
    assert!(status.unwrap().success());

    // On the same directory both are ready.
    let database = start(&b, "database-controller", logs.path(), &one_url, &[]).await;
    wait_readyz(&database, 200, &["ready"], Duration::from_secs(60)).await;
    assert_eq!(backup.get("/readyz").unwrap().0, 200);
}

#[tokio::test]
async fn both_controllers_register_one_s3_store() {
    let b = bed("store-s3").await;
    let logs = tempfile::tempdir().unwrap();
    let server = S3Server::start("s3s-fs", logs.path()).await.unwrap();
    server.create_bucket("backups").unwrap();
    let url = "s3://backups/dbops";

    // Processes creating the identity one after another agree on one. (Racing creators
    // rely on the server honouring If-None-Match: s3s-fs 0.14 did not under concurrent
    // PUTs in one run, so the race is only unit-tested on file:// stores.)
    let mut ids = Vec::new();
    for _ in 0..3 {
        let store = url
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(server.env());
        ids.push(store.identity().await.unwrap());
    }
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    let stored =
        std::fs::read_to_string(server.object_file("backups", "dbops/.dbops-store-id")).unwrap();
    assert_eq!(stored.trim(), ids[0].as_str());

    let backup = start(&b, "backup-controller", logs.path(), url, &server.env()).await;
    let database = start(&b, "database-controller", logs.path(), url, &server.env()).await;
    for c in [&backup, &database] {
        wait_readyz(c, 200, &["ready"], Duration::from_secs(60)).await;
    }
    let cm = registration(&b).await;
    assert_eq!(data(&cm, registry::ID_KEY), ids[0].as_str());
    assert_eq!(data(&cm, registry::URL_KEY), url);
    for c in [&backup, &database] {
        assert!(
            !c.process.log_tail(50_000).contains(server.secret_key()),
            "a credential in the log of {}",
            c.process.name()
        );
    }
}

#[tokio::test]
async fn the_controllers_may_register_their_store_in_their_own_namespace_only() {
    let cp = crate::control_plane().await;
    let system = dbops_e2e::harness::deploy::SYSTEM_NAMESPACE;
    for controller in ["backup-controller", "database-controller"] {
        let kubectl = dbops_e2e::Kubectl::new(&crate::controller_kubeconfig(cp, controller).await);
        let registration = format!("configmaps/{}", registry::CONFIG_MAP);
        let cases: [(&str, &str, &str, bool); 8] = [
            ("get", registration.as_str(), system, true),
            ("create", "configmaps", system, true),
            // Never changed or removed by a controller: an operator deletes it.
            ("update", registration.as_str(), system, false),
            ("patch", registration.as_str(), system, false),
            ("delete", registration.as_str(), system, false),
            // Nothing else of the ConfigMaps there, nothing elsewhere.
            ("list", "configmaps", system, false),
            ("get", "configmaps/kube-root-ca.crt", system, false),
            ("create", "configmaps", "default", false),
        ];
        for (verb, resource, namespace, allowed) in cases {
            assert_eq!(
                kubectl.can_i(verb, resource, Some(namespace)).unwrap(),
                allowed,
                "can-i {verb} {resource} in {namespace} as the {controller}"
            );
        }
    }
    let migration =
        dbops_e2e::Kubectl::new(&crate::controller_kubeconfig(cp, "migration-controller").await);
    assert!(
        !migration
            .can_i("create", "configmaps", Some(system))
            .unwrap()
    );
}

/// `kubectl kustomize <dir>` as JSON values, one per object.
fn render(dir: &Path) -> Vec<Value> {
    let out = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("running kubectl kustomize");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {stderr}",
        dir.display()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .collect()
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendered manifests"))
}

/// The Deployment's controller container and its pod spec.
fn pod_of(deployment: &Value) -> (&Value, &Value) {
    let pod = &deployment["spec"]["template"]["spec"];
    let container = pod["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "controller"))
        .unwrap_or_else(|| panic!("no container `controller`: {deployment}"));
    (container, pod)
}

/// The container's backup store: `--backup-store=` in its args, else DBOPS_BACKUP_STORE.
fn store_url(container: &Value) -> String {
    let from_args = container["args"].as_array().and_then(|args| {
        args.iter()
            .filter_map(Value::as_str)
            .find_map(|a| a.strip_prefix("--backup-store="))
    });
    let from_env = container["env"].as_array().and_then(|env| {
        env.iter()
            .find(|e| e["name"] == "DBOPS_BACKUP_STORE")
            .and_then(|e| e["value"].as_str())
    });
    from_args
        .or(from_env)
        .unwrap_or("file:///var/lib/dbops/backups")
        .to_string()
}

/// The volume mounted at `path` (or at a directory above it), by name.
fn volume_at<'a>(container: &Value, pod: &'a Value, path: &str) -> Option<&'a Value> {
    let mount = container["volumeMounts"].as_array()?.iter().find(|m| {
        let at = m["mountPath"]
            .as_str()
            .unwrap_or_default()
            .trim_end_matches('/');
        path == at || path.starts_with(&format!("{at}/"))
    })?;
    pod["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])
}

const STORE_CONTROLLERS: [&str; 2] = ["dbops-backup-controller", "dbops-database-controller"];

#[test]
fn the_manifests_share_one_claim_and_the_s3_component_replaces_it() {
    let deploy = dbops_e2e::paths::repo_root().join("deploy");
    let base = render(&deploy);
    let mut claims = Vec::new();
    for name in STORE_CONTROLLERS {
        let (container, pod) = pod_of(object(&base, "Deployment", name));
        let url = store_url(container);
        let path = url
            .strip_prefix("file://")
            .unwrap_or_else(|| panic!("{name}: the base store is file://, not {url}"));
        let volume = volume_at(container, pod, path)
            .unwrap_or_else(|| panic!("{name}: nothing is mounted at its store {path}"));
        assert!(
            volume.get("emptyDir").is_none(),
            "{name}: the store {path} is on an emptyDir, which dies with the pod: {volume}"
        );
        let claim = volume["persistentVolumeClaim"]["claimName"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: the store {path} is not on a claim: {volume}"));
        claims.push(claim.to_string());
    }
    assert_eq!(
        claims[0], claims[1],
        "the two controllers mount different claims"
    );
    let claim = object(&base, "PersistentVolumeClaim", &claims[0]);
    assert_eq!(claim["metadata"]["namespace"], "dbops-system");
    let modes = claim["spec"]["accessModes"].as_array().unwrap();
    assert!(
        modes.iter().any(|m| m == "ReadWriteMany"),
        "pods of two Deployments on any nodes share it: {claim}"
    );

    // An overlay with the component, outside deploy/ (kustomize refuses a cycle).
    let overlay = tempfile::tempdir().unwrap();
    let up = "../".repeat(overlay.path().components().count() - 1);
    let to_deploy = format!(
        "{up}{}",
        deploy.display().to_string().trim_start_matches('/')
    );
    let bucket = "s3://example-bucket/dbops";
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{to_deploy}]
components: [{to_deploy}/components/s3-backup-store]
patches:
  - target: {{group: apps, version: v1, kind: Deployment, name: dbops-(backup|database)-controller}}
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata: {{name: ignored-the-target-names-them}}
      spec:
        template:
          spec:
            containers:
              - name: controller
                env: [{{name: DBOPS_BACKUP_STORE, value: "{bucket}"}}]
"#
        ),
    )
    .unwrap();
    let s3 = render(overlay.path());
    for name in STORE_CONTROLLERS {
        let (container, pod) = pod_of(object(&s3, "Deployment", name));
        assert_eq!(store_url(container), bucket, "{name}");
        let from_secret = container["envFrom"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["secretRef"]["name"] == "dbops-backup-store-s3");
        let keys_from_secret = container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| {
                e["valueFrom"]["secretKeyRef"]["name"] == "dbops-backup-store-s3"
                    && e["name"].as_str().is_some_and(|n| n.starts_with("AWS_"))
            })
            .count();
        assert!(
            from_secret || keys_from_secret >= 2,
            "{name}: no AWS_* credentials from the Secret dbops-backup-store-s3: {container}"
        );
        let on_claims: Vec<&Value> = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| v.get("persistentVolumeClaim").is_some())
            .collect();
        assert!(on_claims.is_empty(), "{name}: {on_claims:?}");
        assert!(
            volume_at(container, pod, "/var/lib/dbops/backups").is_none(),
            "{name}: still mounts the file:// store"
        );
    }
    assert!(
        !s3.iter().any(|o| o["kind"] == "PersistentVolumeClaim"),
        "the claim is left in the S3 overlay"
    );
    // Everything else is the base's.
    assert_eq!(s3.len(), base.len() - 1);
}
