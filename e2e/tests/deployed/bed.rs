//! The cluster of `e2e/cluster`, as the deployed suite sees it from inside its network and
//! mount namespace (`e2e/cluster exec` sets `KUBECONFIG` and `DBOPS_CLUSTER_DIR`): the
//! Kubernetes API, the controllers' Pods and Leases, the node's containerd.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dbops_e2e::Kubectl;
use dbops_e2e::controlplane::client_from_kubeconfig;
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use rand::distr::{Alphanumeric, SampleString};

/// Where the controllers run.
pub const SYSTEM: &str = "dbops-system";
/// The three controllers, as `dbops-<name>` names their Deployment, Lease and Service.
pub const CONTROLLERS: [&str; 3] = [
    "database-controller",
    "backup-controller",
    "migration-controller",
];
/// The DatabaseServers the deployment step creates (PostgreSQL 15 and 17 StatefulSets).
pub const MAIN: &str = "pg-main";
pub const TARGET: &str = "pg-target";

pub struct Bed {
    pub client: Client,
    pub kubectl: Kubectl,
}

/// The cluster, with a client of this test's own: a client's connection tasks live on the
/// runtime that made it, and every `#[tokio::test]` has a runtime of its own.
pub async fn bed() -> &'static Bed {
    std::env::var_os("DBOPS_CLUSTER_DIR").expect(
        "the deployed suite runs inside the cluster: \
         e2e/cluster exec -- cargo test -p dbops-e2e --test deployed (e2e/test does)",
    );
    let kubeconfig = PathBuf::from(std::env::var_os("KUBECONFIG").expect("KUBECONFIG"));
    let client = client_from_kubeconfig(&kubeconfig)
        .await
        .expect("a client of the cluster");
    Box::leak(Box::new(Bed {
        client,
        kubectl: Kubectl::new(&kubeconfig),
    }))
}

impl Bed {
    pub fn api<K>(&self, namespace: &str) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// `kubectl ARGS`, failing with its output when it fails.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl.run(args, None)?;
        if !out.success {
            bail!("kubectl {}: {}", args.join(" "), out.text());
        }
        Ok(out.stdout)
    }

    /// The Pods of `dbops-<controller>`, running or not, but not those being deleted.
    pub async fn pods_of(&self, controller: &str) -> Result<Vec<Pod>> {
        let pods: Api<Pod> = self.api(SYSTEM);
        let lp =
            ListParams::default().labels(&format!("app.kubernetes.io/name=dbops-{controller}"));
        Ok(pods
            .list(&lp)
            .await?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect())
    }

    /// The Pod that holds the Lease `dbops-<controller>`, when one does.
    pub async fn leader(&self, controller: &str) -> Result<Option<String>> {
        let leases: Api<Lease> = self.api(SYSTEM);
        let lease = leases.get_opt(&format!("dbops-{controller}")).await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }

    /// Waits until a leader holds the Lease of `controller` and is one of its Ready Pods.
    pub async fn ready_leader(&self, controller: &str, timeout: Duration) -> Result<String> {
        wait_for(
            &format!("a Ready leader of {controller}"),
            timeout,
            || async {
                let leader = self.leader(controller).await?;
                let pods = self.pods_of(controller).await?;
                Ok(leader.filter(|l| {
                    pods.iter().any(|p| {
                        p.name_any() == *l
                            && pod_ready(p)
                            && p.metadata.deletion_timestamp.is_none()
                    })
                }))
            },
            |l: &Option<String>| l.is_some(),
        )
        .await
        .map(|l| l.unwrap_or_default())
    }

    /// A Ready leader of `controller` (its Pod's name) and a replica that is not it.
    pub async fn leader_and_standby(
        &self,
        controller: &str,
        timeout: Duration,
    ) -> Result<(String, Pod)> {
        let leader = self.ready_leader(controller, timeout).await?;
        let standby = self
            .pods_of(controller)
            .await?
            .into_iter()
            .find(|p| p.name_any() != leader)
            .with_context(|| format!("{controller} has no replica besides its leader {leader}"))?;
        Ok((leader, standby))
    }

    /// Waits until Deployment `dbops-<controller>` has rolled out: every replica of the
    /// current template updated, Ready and available, none of an older one left.
    pub async fn rolled_out(&self, controller: &str, timeout: Duration) -> Result<Deployment> {
        let deployments: Api<Deployment> = self.api(SYSTEM);
        let name = format!("dbops-{controller}");
        wait_for(
            &format!("Deployment {name} rolled out"),
            timeout,
            || async { Ok(deployments.get(&name).await?) },
            |d: &Deployment| {
                let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                let st = d.status.clone().unwrap_or_default();
                st.observed_generation >= d.metadata.generation
                    && st.updated_replicas == Some(want)
                    && st.ready_replicas == Some(want)
                    && st.available_replicas == Some(want)
                    && st.replicas == Some(want)
            },
        )
        .await
    }

    /// `ctr -n k8s.io ARGS` against the node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("ctr")
            .args(["-a", "/run/containerd/containerd.sock", "-n", "k8s.io"])
            .args(args)
            .output()
            .context("running ctr")?;
        if !out.status.success() {
            bail!(
                "ctr {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The host PID of the first container of `pod` (from `ctr tasks ls`).
    pub fn container_pid(&self, pod: &Pod) -> Result<(String, u32)> {
        let id = container_id(pod)?;
        let tasks = self.ctr(&["tasks", "ls"])?;
        for line in tasks.lines().skip(1) {
            let mut cols = line.split_whitespace();
            if cols.next() == Some(id.as_str()) {
                let pid = cols.next().context("ctr tasks ls: no PID column")?;
                return Ok((id, pid.parse().context("ctr tasks ls: PID")?));
            }
        }
        bail!("no task {id} in ctr tasks ls: {tasks}")
    }
}

/// The containerd ID of the first container of `pod`.
pub fn container_id(pod: &Pod) -> Result<String> {
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .with_context(|| format!("Pod {} has no container status", pod.name_any()))?;
    let id = status
        .container_id
        .as_deref()
        .with_context(|| format!("Pod {} has no container ID yet", pod.name_any()))?;
    Ok(id.trim_start_matches("containerd://").to_owned())
}

pub fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A namespace of the test's own (an application team's), deleted when dropped.
pub struct Tenant {
    pub name: String,
    suffix: String,
}

impl Tenant {
    pub async fn create(bed: &Bed, prefix: &str) -> Result<Self> {
        let suffix = Alphanumeric
            .sample_string(&mut rand::rng(), 5)
            .to_lowercase();
        let name = format!("{prefix}-{suffix}");
        let suffix = suffix.clone();
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        ns.metadata.labels = Some([("dbops.dev/e2e".to_owned(), "true".to_owned())].into());
        Api::<Namespace>::all(bed.client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        Ok(Self { name, suffix })
    }
}

impl Tenant {
    /// A Database name unique on the shared servers (they name databases and roles after
    /// it, whatever the namespace): `<base>-<this namespace's suffix>`.
    pub fn db(&self, base: &str) -> String {
        format!("{base}-{}", self.suffix)
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("keeping namespace {} of a failed test", self.name);
            return;
        }
        let name = self.name.clone();
        // Deleting the namespace deletes its Databases (deletionPolicy decides what
        // happens to the data); not waited for. A client of its own: the test's client
        // runs on the test's runtime, which this drop blocks.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let (Ok(rt), Some(kubeconfig)) = (rt, std::env::var_os("KUBECONFIG")) {
                let _ = rt.block_on(async {
                    let client = client_from_kubeconfig(&PathBuf::from(kubeconfig)).await?;
                    Api::<Namespace>::all(client)
                        .delete(&name, &DeleteParams::default())
                        .await
                        .map_err(anyhow::Error::from)
                });
            }
        })
        .join();
    }
}
