//! What a harness waits on: an object the API serves (a Database, a Backup, a Migration,
//! ...), as `crate::wait::object_or_logs` takes it, and a harness that shows its
//! controllers' logs when a wait times out.

use std::fmt::{Debug, Display};
use std::time::Duration;

use dbops_api::{Backup, Migration};
use kube::api::Api;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::harness::bed::Bed;
use crate::postgres::PgServer;

/// A kind of object a harness polls until it is as a test wants it.
pub trait Object:
    kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug
{
}

impl<K> Object for K where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug
{
}

/// A harness whose waits, on a timeout, show the object as last seen and its controllers'
/// logs.
// Not bound to `Send`: a test awaits its harness on its own task.
#[allow(async_fn_in_trait)]
pub trait Logged {
    /// The controllers' logs, redacted, for a failure message.
    fn logs_of_all(&self) -> String;

    /// Polls `api`'s object `name` until `done` holds; on timeout the panic shows what was
    /// last seen and [`Logged::logs_of_all`].
    async fn wait<K: Object>(
        &self,
        api: Api<K>,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&K) -> bool,
    ) -> K {
        crate::wait::object_or_logs(&api, name, what, timeout, done, || self.logs_of_all()).await
    }

    /// For the harness's `Drop`: when its test is panicking, prints its namespace `ns`,
    /// [`Logged::logs_of_all`] and the last `tail` bytes of the log of each of its
    /// `(label, server)`s, passed through `redact`.
    fn print_if_panicking<L: Display>(
        &self,
        ns: &str,
        servers: &[(L, PgServer)],
        tail: u64,
        redact: impl Fn(&str) -> String,
    ) {
        if std::thread::panicking() {
            eprintln!("---- {ns} ----\n{}", self.logs_of_all());
            for (label, pg) in servers {
                eprintln!(
                    "---- PostgreSQL {label} log tail ----\n{}",
                    redact(&pg.log_tail(tail))
                );
            }
        }
    }
}

/// A [`Logged`] harness of one test's namespace (its [`Bed`]): the Backups and Migrations
/// there, waited for by name.
#[allow(async_fn_in_trait)]
pub trait InBed: Logged {
    fn bed(&self) -> &Bed;

    /// Waits until Backup `name` satisfies `done`; on timeout the panic shows the Backup
    /// and [`Logged::logs_of_all`].
    async fn wait_backup(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Backup) -> bool,
    ) -> Backup {
        let api = Api::namespaced(self.bed().client.clone(), self.bed().ns.name());
        self.wait(api, name, what, timeout, done).await
    }

    /// Waits until Migration `name` satisfies `done`; on timeout the panic shows the
    /// Migration and [`Logged::logs_of_all`].
    async fn wait_migration(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Migration) -> bool,
    ) -> Migration {
        let api = Api::namespaced(self.bed().client.clone(), self.bed().ns.name());
        self.wait(api, name, what, timeout, done).await
    }
}
