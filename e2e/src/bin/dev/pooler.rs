//! The pooler of pg-main in the dev environment (DatabaseServer `spec.pooler`, issue 36).
//! Without a node the database-controller's Deployment gets no Pod, so the environment
//! plays that Pod: Debian's PgBouncer on the files of the pooler's Secret (written again
//! and reloaded when the Secret changes, as the kubelet and the image's entrypoint do),
//! listening on 127.0.0.1 at a port of its own, and a Pod object whose status says Ready
//! at that address, where a Migration's cutover finds it.
//!
//! The connection Secrets name the Service (`pooler-host`), which only resolves inside a
//! cluster: `e2e/dev env` exports `DBOPS_POOLER_ADDR` (`&hostaddr=127.0.0.1&port=<port>`),
//! which a client appends to `pooler-uri` to reach this PgBouncer, the certificate still
//! verified for the Service's name.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_e2e::pgbouncer::PgBouncer;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

/// The dev environment's pooler while it runs.
pub struct DevPooler {
    pub bouncer: PgBouncer,
    follower: tokio::task::JoinHandle<()>,
}

impl Drop for DevPooler {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// Waits (`within`) for the pooler Secret of `server` in `namespace`, then runs PgBouncer
/// on it at `port`, trusting `ca_pem` for its server (the pod mounts the CA Secret).
pub async fn start(
    client: &kube::Client,
    namespace: &str,
    server: &str,
    ca_pem: &str,
    dir: &Path,
    port: u16,
    within: Duration,
) -> Result<DevPooler> {
    let name = dbops_shared::pooler::object_name(server);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + within;
    let secret = loop {
        if let Some(s) = secrets.get_opt(&name).await?
            && s.data
                .as_ref()
                .is_some_and(|d| d.contains_key("pgbouncer.ini"))
        {
            break s;
        }
        if Instant::now() > deadline {
            bail!(
                "the database-controller made no pooler Secret {namespace}/{name} within {within:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut files = dbops_e2e::pgbouncer::files_of(&secret);
    files.insert("server-ca/ca.crt".into(), ca_pem.to_string());
    let bouncer =
        PgBouncer::start_from_rendered_on(dir, &files, dbops_shared::pooler::ADMIN_USER, port)
            .await
            .context("PgBouncer on the pooler's Secret")?;
    let follower = bouncer.follow_secret(secrets, &name);
    bouncer
        .publish_pod(client, namespace, &name, &secret)
        .await
        .context("the pooler's Pod")?;
    Ok(DevPooler { bouncer, follower })
}
