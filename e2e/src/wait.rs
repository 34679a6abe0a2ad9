//! Waiting without sleeping blindly: poll a probe until a predicate holds or a deadline
//! passes, and say what was last seen when it does not.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use anyhow::{Result, anyhow};
use dbops_api::{Database, HasConditions};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Client;
use kube::api::Api;
use kube::runtime::wait::await_condition;
use tokio::time::Instant;

/// How often [`wait_for`] and [`holds_for`] probe.
pub const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Polls `probe` every [`POLL_INTERVAL`] until `done` holds for what it returns; returns
/// that value. After `timeout` it fails with `what` and the last value or error seen. A
/// probe error is not fatal: it is retried (the server may be restarting).
pub async fn wait_for<T, F, Fut, P>(
    what: &str,
    timeout: Duration,
    mut probe: F,
    done: P,
) -> Result<T>
where
    T: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
    P: Fn(&T) -> bool,
{
    let deadline = Instant::now() + timeout;
    let mut last: Option<String> = None;
    loop {
        match tokio::time::timeout_at(deadline, probe()).await {
            Ok(Ok(value)) if done(&value) => return Ok(value),
            Ok(Ok(value)) => last = Some(format!("{value:?}")),
            Ok(Err(e)) => last = Some(format!("error: {e:#}")),
            Err(_) => last = Some(last.unwrap_or_default() + " (the last probe hung)"),
        }
        if Instant::now() + POLL_INTERVAL > deadline {
            return Err(anyhow!(
                "timed out after {timeout:?} waiting for {what}; last observed: {}",
                last.as_deref().unwrap_or("nothing (no probe finished)")
            ));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// [`wait_for`] that panics with its message: for tests.
pub async fn eventually<T, F, Fut, P>(what: &str, timeout: Duration, probe: F, done: P) -> T
where
    T: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
    P: Fn(&T) -> bool,
{
    match wait_for(what, timeout, probe, done).await {
        Ok(value) => value,
        Err(e) => panic!("{e:#}"),
    }
}

/// Waits (a watch, bounded by `timeout`) until the object `name` with `uid` is gone; an
/// object of that name with another UID counts as gone.
pub async fn deleted<K>(api: Api<K>, name: &str, uid: &str, timeout: Duration) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Debug + Send + 'static,
{
    match tokio::time::timeout(
        timeout,
        await_condition(api, name, kube::runtime::wait::conditions::is_deleted(uid)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(anyhow!("watching {name} until it is gone: {e}")),
        Err(_) => Err(anyhow!("{name} still exists after {timeout:?}")),
    }
}

/// Polls `probe` every [`POLL_INTERVAL`] for `window` and fails at the first value for
/// which `ok` does not hold (or the first error), naming `what` and that value; returns
/// the last value when it held throughout. For "this must not happen" checks, where
/// watching for a while is the only way to know.
pub async fn holds_for<T, F, Fut, P>(what: &str, window: Duration, mut probe: F, ok: P) -> Result<T>
where
    T: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
    P: Fn(&T) -> bool,
{
    let start = Instant::now();
    let end = start + window;
    loop {
        let value = probe()
            .await
            .map_err(|e| e.context(format!("probing whether {what} holds")))?;
        if !ok(&value) {
            return Err(anyhow!(
                "{what} stopped holding after {:?}: observed {value:?}",
                start.elapsed()
            ));
        }
        if Instant::now() >= end {
            return Ok(value);
        }
        tokio::time::sleep(POLL_INTERVAL.min(end - Instant::now())).await;
    }
}

/// Polls object `name` of `api` until it exists and satisfies `done` (`what` says what that
/// is); returns it. On timeout panics with the object as last seen ([`ObjectView`]) and
/// `logs()` (the controllers' logs, redacted): for tests.
pub async fn object_or_logs<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&K) -> bool,
    logs: impl FnOnce() -> String,
) -> K
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + Debug,
{
    let found = wait_for(
        &format!("{} {name}: {what}", K::kind(&())),
        timeout,
        || async { Ok(api.get_opt(name).await?.map(ObjectView)) },
        |o| o.as_ref().is_some_and(|o| done(&o.0)),
    )
    .await;
    match found {
        Ok(Some(o)) => o.0,
        Ok(None) => unreachable!("done held for an object"),
        Err(e) => panic!("{e:#}\n{}", logs()),
    }
}

/// An object shown in failure messages by its kind, name, finalizers, whether it is being
/// deleted, and its status.
pub struct ObjectView<K>(pub K);

impl<K: kube::Resource<DynamicType = ()> + serde::Serialize> Debug for ObjectView<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let meta = self.0.meta();
        let status = serde_json::to_value(&self.0)
            .ok()
            .and_then(|v| v.get("status").cloned())
            .unwrap_or_default();
        write!(
            f,
            "{} {:?} finalizers {:?} deleting {} status {status}",
            K::kind(&()),
            meta.name,
            meta.finalizers,
            meta.deletion_timestamp.is_some(),
        )
    }
}

/// A condition a test waits for: type and status, and the reason when given. By default
/// the status must also describe the object's current generation.
#[derive(Debug, Clone, Copy)]
pub struct Want<'a> {
    pub type_: &'a str,
    pub status: &'a str,
    pub reason: Option<&'a str>,
    /// Require status.observedGeneration == metadata.generation (default true).
    pub current_generation: bool,
}

impl<'a> Want<'a> {
    pub fn new(type_: &'a str, status: &'a str, reason: Option<&'a str>) -> Self {
        Self {
            type_,
            status,
            reason,
            current_generation: true,
        }
    }

    /// Ready=True with reason Provisioned: a Database provisioned and serving.
    pub fn provisioned() -> Want<'static> {
        Want::new("Ready", "True", Some("Provisioned"))
    }

    /// Progressing=True with `reason`: at work, or waiting for something it names.
    pub fn progressing(reason: &'a str) -> Self {
        Want::new("Progressing", "True", Some(reason))
    }

    /// Ready=False with `reason`: refused or failing, and saying why.
    pub fn not_ready(reason: &'a str) -> Self {
        Want::new("Ready", "False", Some(reason))
    }

    /// The same condition, whatever generation status.observedGeneration names.
    pub fn any_generation(self) -> Self {
        Self {
            current_generation: false,
            ..self
        }
    }

    /// Whether `conditions` has one that matches.
    pub fn matches(&self, conditions: &[Condition]) -> bool {
        conditions.iter().any(|c| {
            c.type_ == self.type_
                && c.status == self.status
                && self.reason.is_none_or(|r| c.reason == r)
        })
    }

    /// Whether `object` has the condition: in a status that describes its current
    /// generation, unless any generation will do.
    pub fn holds_on<K: HasConditions + kube::Resource>(&self, object: &K) -> bool {
        let observed = object.observed_generation();
        let current = observed.is_some() && observed == object.meta().generation;
        (current || !self.current_generation) && self.matches(object.conditions())
    }
}

impl std::fmt::Display for Want<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.type_, self.status)?;
        if let Some(reason) = self.reason {
            write!(f, " reason {reason}")?;
        }
        if self.current_generation {
            write!(f, " (at the current generation)")?;
        }
        Ok(())
    }
}

/// The condition of type `type_` of `object`'s status, if it has one.
pub fn condition<'a, K: HasConditions>(object: &'a K, type_: &str) -> Option<&'a Condition> {
    object.conditions().iter().find(|c| c.type_ == type_)
}

/// Whether the Database has the condition (in a status that describes its current
/// generation, unless `want` says any generation will do).
pub fn database_has(db: &Database, want: Want<'_>) -> bool {
    want.holds_on(db)
}

/// Waits (with a watch) until Database `namespace/name` exists and has the condition
/// `want` (see [`database_has`]); returns the object. On timeout the error shows the object's metadata and status.
pub async fn database_condition(
    client: &Client,
    namespace: &str,
    name: &str,
    want: Want<'_>,
    timeout: Duration,
) -> Result<Database> {
    let api: Api<Database> = Api::namespaced(client.clone(), namespace);
    let waited = tokio::time::timeout(
        timeout,
        await_condition(api.clone(), name, |db: Option<&Database>| {
            db.is_some_and(|db| database_has(db, want))
        }),
    )
    .await;
    match waited {
        Ok(Ok(Some(db))) => Ok(db),
        Ok(Ok(None)) => Err(anyhow!("Database {namespace}/{name} is gone")),
        Ok(Err(e)) => Err(anyhow!("watching Database {namespace}/{name}: {e}")),
        Err(_) => Err(anyhow!(
            "Database {namespace}/{name} did not reach {want} within {timeout:?}; it is \
             now:\n{}",
            describe_database(&api, name).await
        )),
    }
}

/// [`database_condition`] that panics with its message: for tests.
pub async fn expect_database_condition(
    client: &Client,
    namespace: &str,
    name: &str,
    want: Want<'_>,
    timeout: Duration,
) -> Database {
    match database_condition(client, namespace, name, want, timeout).await {
        Ok(db) => db,
        Err(e) => panic!("{e:#}"),
    }
}

/// [`database_condition`] that panics with its message and `log()`, the
/// database-controller's log (its tail, redacted): for tests.
pub async fn database_condition_or_log(
    client: &Client,
    namespace: &str,
    name: &str,
    want: Want<'_>,
    timeout: Duration,
    log: impl FnOnce() -> String,
) -> Database {
    match database_condition(client, namespace, name, want, timeout).await {
        Ok(db) => db,
        Err(e) => panic!("{e:#}\n---- database-controller log ----\n{}", log()),
    }
}

/// Generation, deletion state, finalizers and status of a Database as YAML, for failure
/// messages.
pub async fn describe_database(api: &Api<Database>, name: &str) -> String {
    match api.get_opt(name).await {
        Ok(Some(db)) => {
            let summary = serde_json::json!({
                "generation": db.metadata.generation,
                "deletionTimestamp": db.metadata.deletion_timestamp,
                "finalizers": db.metadata.finalizers,
                "status": db.status,
            });
            serde_norway::to_string(&summary).unwrap_or_else(|e| format!("{summary} ({e})"))
        }
        Ok(None) => "(absent)".to_string(),
        Err(e) => format!("(could not be read: {e})"),
    }
}
