//! The pooler's objects in the controllers' namespace (pure): its Secret (configuration
//! and userlist), Deployment, Service and PodDisruptionBudget, all named
//! [`name`]`(server)` and marked as dbops's, with the digest of what was applied.

use std::collections::BTreeMap;

use dbops_api::DatabaseServer;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource, SecurityContext, Service,
    ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use super::render::{CONFIG_DIR, PORT, SERVER_CA_DIR};

/// The label that selects one server's pooler Pods (and marks its objects).
pub const POOLER_LABEL: &str = dbops_api::names::label::POOLER;
pub use dbops_shared::pooler::SERVER_ANNOTATION;
/// The annotation with the SHA-256 of the object as dbops applied it.
pub const APPLIED_ANNOTATION: &str = dbops_api::names::annotation::APPLIED_SHA256;

pub use dbops_shared::pooler::object_name as name;

pub use dbops_shared::pooler::is_ours;

/// The digest of what dbops applied to `meta`'s object, if it did.
pub fn applied(meta: &ObjectMeta) -> Option<&str> {
    meta.annotations
        .as_ref()?
        .get(APPLIED_ANNOTATION)
        .map(String::as_str)
}

fn selector(name: &str) -> BTreeMap<String, String> {
    [(POOLER_LABEL.to_string(), name.to_string())].into()
}

/// The metadata of every pooler object: name, namespace, labels, the server it serves,
/// owned by the DatabaseServer (garbage-collected with it).
fn meta(server: &DatabaseServer, namespace: &str) -> ObjectMeta {
    let name = name(&server.name_any());
    let (managed, dbops) = dbops_api::names::label::MANAGED_BY;
    let mut labels = selector(&name);
    labels.insert(managed.into(), dbops.into());
    labels.insert("app.kubernetes.io/name".into(), "pgbouncer".into());
    labels.insert("app.kubernetes.io/component".into(), "pooler".into());
    labels.insert("app.kubernetes.io/part-of".into(), "dbops".into());
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_string()),
        labels: Some(labels),
        annotations: Some([(SERVER_ANNOTATION.to_string(), server.name_any())].into()),
        owner_references: Some(vec![OwnerReference {
            api_version: DatabaseServer::api_version(&()).into(),
            kind: DatabaseServer::kind(&()).into(),
            name: server.name_any(),
            uid: server.uid().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]),
        ..Default::default()
    }
}

/// `object` with the digest of itself (as it is without the digest) in its annotations.
pub fn stamped<K: serde::Serialize + Resource>(mut object: K) -> K {
    let digest = serde_json::to_vec(&object)
        .map(|bytes| dbops_shared::checksum::sha256_hex(&bytes))
        .unwrap_or_default();
    object
        .meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .insert(APPLIED_ANNOTATION.into(), digest);
    object
}

/// The Secret the Pods mount: `pgbouncer.ini`, `userlist.txt` and the admin password.
pub fn secret(server: &DatabaseServer, namespace: &str, data: BTreeMap<String, String>) -> Secret {
    stamped(Secret {
        metadata: meta(server, namespace),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k, ByteString(v.into_bytes())))
                .collect(),
        ),
        type_: Some("Opaque".into()),
        ..Default::default()
    })
}

/// The Service clients connect to.
pub fn service(server: &DatabaseServer, namespace: &str) -> Service {
    let meta = meta(server, namespace);
    let name = meta.name.clone().unwrap_or_default();
    stamped(Service {
        metadata: meta,
        spec: Some(ServiceSpec {
            selector: Some(selector(&name)),
            ports: Some(vec![ServicePort {
                name: Some("postgres".into()),
                port: i32::from(PORT),
                target_port: Some(IntOrString::Int(i32::from(PORT))),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The PodDisruptionBudget of a pooler with 2 or more replicas: one Pod at a time.
pub fn disruption_budget(server: &DatabaseServer, namespace: &str) -> PodDisruptionBudget {
    let meta = meta(server, namespace);
    let name = meta.name.clone().unwrap_or_default();
    stamped(PodDisruptionBudget {
        metadata: meta,
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The Deployment: `spec.pooler.replicas` Pods of `image` ([`pod`]).
pub fn deployment(server: &DatabaseServer, namespace: &str, image: &str) -> Deployment {
    let meta = meta(server, namespace);
    let name = meta.name.clone().unwrap_or_default();
    let replicas = super::render::replicas(server);
    let mut template_labels = meta.labels.clone().unwrap_or_default();
    template_labels.retain(|k, _| k != dbops_api::names::label::MANAGED_BY.0);
    stamped(Deployment {
        metadata: meta,
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(template_labels),
                    ..Default::default()
                }),
                spec: Some(pod(server, &name, image)),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// A pooler Pod under the restricted Pod Security Standard: PgBouncer as uid 65532 on a
/// read-only root, reading the pooler's Secret (and the server's CA Secret) from
/// read-only volumes, no ServiceAccount token.
fn pod(server: &DatabaseServer, name: &str, image: &str) -> PodSpec {
    let secret_volume = |volume: &str, secret: &str, path: &str| {
        (
            Volume {
                name: volume.into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.into()),
                    default_mode: Some(0o440),
                    ..Default::default()
                }),
                ..Default::default()
            },
            VolumeMount {
                name: volume.into(),
                mount_path: path.into(),
                read_only: Some(true),
                ..Default::default()
            },
        )
    };
    let mut mounted = vec![secret_volume("config", name, CONFIG_DIR)];
    if let Some(ca) = &server.spec.tls.ca_secret_ref {
        mounted.push(secret_volume("server-ca", &ca.name, SERVER_CA_DIR));
    }
    let (volumes, mounts): (Vec<_>, Vec<_>) = mounted.into_iter().unzip();
    PodSpec {
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            fs_group: Some(65532),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        containers: vec![container(image, mounts)],
        volumes: Some(volumes),
        ..Default::default()
    }
}

fn container(image: &str, mounts: Vec<VolumeMount>) -> Container {
    let tcp = |period, failures| Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(i32::from(PORT)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Default::default()
    };
    let quantity = |q: &str| Quantity(q.into());
    Container {
        name: "pgbouncer".into(),
        image: Some(image.into()),
        args: Some(vec![format!("{CONFIG_DIR}/pgbouncer.ini")]),
        ports: Some(vec![ContainerPort {
            name: Some("postgres".into()),
            container_port: i32::from(PORT),
            ..Default::default()
        }]),
        readiness_probe: Some(tcp(5, 2)),
        liveness_probe: Some(tcp(10, 6)),
        resources: Some(ResourceRequirements {
            requests: Some(
                [
                    ("cpu".to_string(), quantity("50m")),
                    ("memory".to_string(), quantity("32Mi")),
                ]
                .into(),
            ),
            limits: Some([("memory".to_string(), quantity("256Mi"))].into()),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str) -> DatabaseServer {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": name, "uid": "s-1"},
            "spec": {"host": "pg.example", "adminSecretRef": {"name": "a"},
                     "tls": {"mode": "verify-full", "caSecretRef": {"name": "pg-ca"}},
                     "pooler": {"replicas": 3}}
        }))
        .unwrap()
    }

    #[test]
    fn names_are_service_names() {
        assert_eq!(name("pg-main"), "dbops-pooler-pg-main");
        assert_eq!(name("pg.main.db"), "dbops-pooler-pg-main-db");
        let long = name(&"a".repeat(200));
        assert!(
            long.len() <= 63 && long.starts_with("dbops-pooler-aaa"),
            "{long}"
        );
        assert_ne!(long, name(&"a".repeat(199)));
    }

    #[test]
    fn objects_are_marked_owned_and_stamped() {
        let s = server("pg-main");
        let d = deployment(&s, "dbops-system", "img:1");
        assert!(is_ours(&d.metadata, "pg-main"));
        assert!(!is_ours(&d.metadata, "pg-other"));
        assert_eq!(
            d.metadata.owner_references.as_ref().unwrap()[0].kind,
            "DatabaseServer"
        );
        let spec = d.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(3));
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(
            pod.volumes.as_ref().unwrap().len(),
            2,
            "config and server CA"
        );
        let c = &pod.containers[0];
        assert_eq!(
            c.security_context
                .as_ref()
                .unwrap()
                .allow_privilege_escalation,
            Some(false)
        );
        let stamp = applied(&d.metadata).unwrap().to_string();
        assert_eq!(
            applied(&deployment(&s, "dbops-system", "img:1").metadata),
            Some(stamp.as_str()),
            "the same object, the same digest"
        );
        assert_ne!(
            applied(&deployment(&s, "dbops-system", "img:2").metadata),
            Some(stamp.as_str())
        );
        let svc = service(&s, "dbops-system");
        assert_eq!(
            svc.spec
                .unwrap()
                .selector
                .unwrap()
                .get(POOLER_LABEL)
                .unwrap(),
            "dbops-pooler-pg-main"
        );
    }
}
