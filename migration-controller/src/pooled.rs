//! The cutover through the source server's pooler (a DatabaseServer with `spec.pooler`):
//! clients connected to the pooler see a wait of about the freeze, and no error.
//!
//! 1. [`hold`], in FreezeSource before the freeze: if the source's pooler can serve the
//!    database on the target (`dbops_shared::pooler::can_forward`: PgBouncer has one
//!    server TLS setting), the record `status.pooler` is written (`held`), then every
//!    ready pooler instance gets `PAUSE <db>`: new transactions of the database wait in
//!    the pooler, and the freeze that follows finds no pooled session in a transaction.
//! 2. [`release`], in SwitchTraffic once the Database is Ready on the target: the
//!    database-controller now renders the database's route in the source's pooler to the
//!    target (`forwards` of its pooler module); each instance is asked where the route
//!    points (`SHOW DATABASES`), told to `RELOAD`, and its Pod's annotation is bumped so
//!    the kubelet brings the new Secret into its volume at once; an instance still
//!    routing to the source that is not paused (a Pod started since) is paused. Once
//!    every instance routes to the target, each gets `RESUME <db>` and the record its
//!    `resumedAt`.
//! 3. [`let_go`], in FreezeSource's compensation (the route never left the source) and in
//!    SwitchTraffic for a Database deleted since the switch: `RESUME` on every instance.
//!
//! Instances are the pooler's ready Pods in the controllers' namespace, reached at their
//! Pod IP on the console over TLS with the pooler's own certificate and admin login
//! (`dbops_shared::pooler::Console`).

use std::time::Duration;

use dbops_api::names::{annotation, label};
use dbops_api::{MigrationReason, PoolerCutover};
use dbops_shared::conditions::now;
use dbops_shared::pooler::{self, ADMIN_PASSWORD_KEY, Console, Instance};
use dbops_shared::server::Resolved;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use crate::context::Saga;
use crate::error::{Error, Result};

/// The bound of one console command (connect, SHOW, RELOAD, RESUME).
const CONSOLE_WITHIN: Duration = Duration::from_secs(5);
/// How long `PAUSE` may wait for the database's transactions in flight to end. Past it
/// the freeze ends them, as it ends every other session.
const PAUSE_WITHIN: Duration = Duration::from_secs(10);
/// How soon SwitchTraffic looks again while an instance does not route to the target yet.
pub const ROUTE_POLL: Duration = Duration::from_millis(500);

/// A pooler's instances and how to reach their consoles.
struct Pooler {
    instances: Vec<Instance>,
    password: String,
    ca_pem: Vec<u8>,
    /// The configuration's digest, for the Pod annotation that wakes the kubelet.
    applied: String,
}

impl Pooler {
    async fn console(&self, instance: &Instance) -> Result<Console> {
        Console::connect(instance, &self.password, &self.ca_pem, CONSOLE_WITHIN)
            .await
            .map_err(unreachable)
    }

    /// `RESUME database` on every instance; how many.
    async fn resume(&self, database: &str) -> Result<usize> {
        for instance in &self.instances {
            self.console(instance)
                .await?
                .resume(database)
                .await
                .map_err(unreachable)?;
        }
        Ok(self.instances.len())
    }
}

fn unreachable(e: pooler::ConsoleError) -> Error {
    Error::step(MigrationReason::PoolerUnreachable, e.to_string())
}

/// `server`'s pooler as dbops made it (its Secret), with its ready Pods; `None` when it
/// has none.
async fn pooler_of(saga: &Saga<'_>, server: &Resolved) -> Result<Option<Pooler>> {
    let Some(access) = &server.pooler else {
        return Ok(None);
    };
    let directory = &saga.ctx.state.directory;
    let name = pooler::object_name(&server.name);
    let secret = directory.secret(&name);
    let value = |key: &str| {
        secret
            .as_ref()
            .and_then(|s| s.data.as_ref()?.get(key))
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
    };
    let password = value(ADMIN_PASSWORD_KEY).ok_or_else(|| {
        Error::step(
            MigrationReason::PoolerUnreachable,
            format!("the pooler's Secret {name} has no {ADMIN_PASSWORD_KEY}"),
        )
    })?;
    let applied = secret
        .as_ref()
        .and_then(|s| {
            s.metadata
                .annotations
                .as_ref()?
                .get(annotation::APPLIED_SHA256)
        })
        .cloned()
        .unwrap_or_default();
    let instances = instances(saga, directory.controller_namespace(), &name).await?;
    Ok(Some(Pooler {
        instances,
        password,
        ca_pem: access.ca_pem.clone(),
        applied,
    }))
}

/// The ready Pods of the pooler `name` (label `dbops.dev/pooler=<name>`), each at its
/// Pod IP and its container port `pgbouncer`. (Not the Service's EndpointSlices: they
/// hold the same Pods, but refuse loopback addresses, which the test bed's PgBouncer
/// standing in for a Pod listens on.)
async fn instances(saga: &Saga<'_>, namespace: &str, name: &str) -> Result<Vec<Instance>> {
    let pods: Api<Pod> = Api::namespaced(saga.ctx.client.clone(), namespace);
    let listed = pods
        .list(&ListParams::default().labels(&format!("{}={name}", label::POOLER)))
        .await?;
    let mut out: Vec<Instance> = listed.into_iter().filter_map(instance).collect();
    out.sort_by(|a, b| (&a.address, a.port).cmp(&(&b.address, b.port)));
    out.dedup();
    Ok(out)
}

/// A pooler Pod as an instance, if it is ready and not going away.
fn instance(pod: Pod) -> Option<Instance> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let address = status.pod_ip.clone().filter(|ip| !ip.is_empty())?;
    if !ready {
        return None;
    }
    let port = pod
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("pgbouncer"))
        .and_then(|p| u16::try_from(p.container_port).ok())
        .unwrap_or(pooler::PORT);
    Some(Instance {
        address,
        port,
        pod: pod.metadata.name,
    })
}

/// FreezeSource, before the freeze: the source's pooler holds `database`'s new
/// transactions, if it has a pooler that can serve the database on the target. What it
/// did, for the step's message (`None`: the source has no pooler).
pub async fn hold(
    saga: &mut Saga<'_>,
    source: &Resolved,
    database: &str,
) -> Result<Option<String>> {
    let mut status = saga.status();
    if let Some(record) = &status.pooler
        && !record.holds()
    {
        return Ok(record.message.clone());
    }
    let Some(p) = pooler_of(saga, source).await? else {
        return Ok(None);
    };
    let target = &saga.m.spec.target.server_ref.name;
    let forward = match saga.ctx.state.directory.get(target) {
        Some(t) => pooler::can_forward(&source.server, &t),
        None => Err(format!("DatabaseServer {target} is not in the cache")),
    };
    if let Err(why) = forward {
        let message = format!(
            "the pooler of DatabaseServer {} does not hold {database}: {why}; its clients reconnect after the switch, as direct clients do",
            source.name
        );
        status.pooler = Some(PoolerCutover {
            server: source.name.clone(),
            database: database.to_string(),
            held: false,
            message: Some(message.clone()),
            ..Default::default()
        });
        saga.save(status).await?;
        return Ok(Some(message));
    }
    // Recorded before the first PAUSE: the compensation resumes whatever this began.
    let mut record = status.pooler.clone().unwrap_or_else(|| PoolerCutover {
        server: source.name.clone(),
        database: database.to_string(),
        held: true,
        paused_at: Some(now()),
        ..Default::default()
    });
    status.pooler = Some(record.clone());
    saga.save(status.clone()).await?;
    let mut slow = Vec::new();
    for instance in &p.instances {
        let console = p.console(instance).await?;
        match console.pause(database, PAUSE_WITHIN).await {
            Ok(()) => {}
            Err(pooler::ConsoleError::TimedOut { .. }) => slow.push(instance.to_string()),
            Err(e) => return Err(unreachable(e)),
        }
    }
    let mut message = format!(
        "the pooler of DatabaseServer {} holds {database}'s new transactions on {} instances",
        source.name,
        p.instances.len()
    );
    if !slow.is_empty() {
        message.push_str(&format!(
            " ({} still had transactions in flight after {PAUSE_WITHIN:?}, ended by the freeze: {})",
            slow.len(),
            slow.join(", ")
        ));
    }
    record.instances = i32::try_from(p.instances.len()).unwrap_or(i32::MAX);
    record.message = Some(message.clone());
    status.pooler = Some(record);
    saga.save(status).await?;
    Ok(Some(message))
}

/// What [`release`] came to.
pub enum Release {
    /// Nothing held, or every instance routes to the target and resumed (the message).
    Done(Option<String>),
    /// Instances still route elsewhere: looked at again after [`ROUTE_POLL`].
    Waiting(String),
}

/// SwitchTraffic, once the Database is Ready on `target`: every instance of the source's
/// pooler routes the database there, then resumes it.
pub async fn release(saga: &mut Saga<'_>, source: &Resolved, target: &Resolved) -> Result<Release> {
    let mut status = saga.status();
    let Some(mut record) = status.pooler.clone() else {
        return Ok(Release::Done(None));
    };
    if !record.holds() {
        return Ok(Release::Done(record.message.clone()));
    }
    let database = record.database.clone();
    let Some(p) = pooler_of(saga, source).await? else {
        // The pooler went (spec.pooler removed): no client waits in it.
        record.resumed_at = Some(now());
        record.message = Some(format!(
            "the pooler of DatabaseServer {} is gone",
            source.name
        ));
        status.pooler = Some(record.clone());
        saga.save(status).await?;
        return Ok(Release::Done(record.message));
    };
    let (host, port) = (&target.server.spec.host, target.server.spec.port);
    let mut behind = Vec::new();
    for instance in &p.instances {
        let console = p.console(instance).await?;
        let mut route = console.route(&database).await.map_err(unreachable)?;
        if !routes_to(route.as_ref(), host, port) {
            console.reload().await.map_err(unreachable)?;
            route = console.route(&database).await.map_err(unreachable)?;
        }
        if routes_to(route.as_ref(), host, port) {
            continue;
        }
        if route.as_ref().is_some_and(|r| !r.paused) {
            // A Pod started since the freeze: its clients wait too.
            console
                .pause(&database, PAUSE_WITHIN)
                .await
                .map_err(unreachable)?;
        }
        behind.push(instance.clone());
    }
    if !behind.is_empty() {
        wake(saga, &behind, &p.applied).await?;
        let names: Vec<String> = behind.iter().map(ToString::to_string).collect();
        return Ok(Release::Waiting(format!(
            "the Database is Ready on DatabaseServer {}; waiting for {} pooler instances of DatabaseServer {} to route {database} there: {}",
            target.name,
            behind.len(),
            source.name,
            names.join(", ")
        )));
    }
    p.resume(&database).await?;
    let message = format!(
        "the pooler of DatabaseServer {} routes {database} to DatabaseServer {} ({host}:{port}) on {} instances and let its clients go on",
        source.name,
        target.name,
        p.instances.len()
    );
    record.resumed_at = Some(now());
    record.message = Some(message.clone());
    status.pooler = Some(record);
    saga.save(status).await?;
    Ok(Release::Done(Some(message)))
}

/// FreezeSource's compensation (its route never left the source), and SwitchTraffic for a
/// Database deleted since the switch (no route will follow it): every instance of the
/// source's pooler resumes the database. What was done, if anything.
pub async fn let_go(saga: &mut Saga<'_>, source: &Resolved) -> Result<Option<String>> {
    let mut status = saga.status();
    let Some(mut record) = status.pooler.clone() else {
        return Ok(None);
    };
    if !record.holds() {
        return Ok(None);
    }
    let database = record.database.clone();
    let resumed = match pooler_of(saga, source).await? {
        Some(p) => p.resume(&database).await?,
        None => 0,
    };
    let message = format!(
        "the pooler of DatabaseServer {} resumed {database} where it routes it ({resumed} instances)",
        source.name
    );
    record.resumed_at = Some(now());
    record.message = Some(message.clone());
    status.pooler = Some(record);
    saga.save(status).await?;
    Ok(Some(message))
}

fn routes_to(route: Option<&pooler::RouteState>, host: &str, port: i32) -> bool {
    route.is_some_and(|r| r.host == host && i32::from(r.port) == port)
}

/// Bumps the Pods' annotation with the configuration's digest: an updated Pod makes the
/// kubelet sync its volumes now rather than at its next periodic sync.
async fn wake(saga: &Saga<'_>, behind: &[Instance], applied: &str) -> Result<()> {
    let namespace = saga.ctx.state.directory.controller_namespace();
    let pods: Api<Pod> = Api::namespaced(saga.ctx.client.clone(), namespace);
    let patch = json!({"metadata": {"annotations": {annotation::POOLER_CONFIG: applied}}});
    for pod in behind.iter().filter_map(|i| i.pod.as_deref()) {
        match pods
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            // Gone since the endpoints were read: the next look sees its successor.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            other => {
                other?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: &str, ip: Option<&str>, port: Option<i32>) -> Pod {
        let mut container = serde_json::json!({"name": "pgbouncer", "image": "x"});
        if let Some(port) = port {
            container["ports"] = serde_json::json!([{"name": "pgbouncer", "containerPort": port}]);
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p-1"},
            "spec": {"containers": [container]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_ready_pod_with_an_address_is_an_instance() {
        assert_eq!(
            instance(pod("True", Some("10.0.0.7"), Some(7000))),
            Some(Instance {
                address: "10.0.0.7".into(),
                port: 7000,
                pod: Some("p-1".into())
            })
        );
        assert_eq!(
            instance(pod("True", Some("10.0.0.7"), None)).map(|i| i.port),
            Some(6432)
        );
        assert_eq!(instance(pod("False", Some("10.0.0.7"), None)), None);
        assert_eq!(instance(pod("True", None, None)), None);
    }

    #[test]
    fn a_route_to_the_target_is_by_host_and_port() {
        let route = pooler::RouteState {
            host: "pg-new.example".into(),
            port: 5432,
            database: "shop_orders".into(),
            paused: true,
        };
        assert!(routes_to(Some(&route), "pg-new.example", 5432));
        assert!(!routes_to(Some(&route), "pg-new.example", 5433));
        assert!(!routes_to(Some(&route), "pg-old.example", 5432));
        assert!(!routes_to(None, "pg-new.example", 5432));
    }
}
