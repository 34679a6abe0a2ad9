//! What brings a Database back to the scheduler besides its own changes.

use std::sync::Arc;

use dbops_api::{Backup, Database};
use dbops_shared::controller::{self, Context};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector;
use kube::runtime::{Controller, WatchStreamExt, watcher};

use crate::schedule::state::State;
use dbops_api::names::label::SCHEDULE_OF;

/// The scheduled Backups (by label, into `store`'s reflector), each mapped to the
/// Database its label names: a Backup that finishes or goes brings retention and the next
/// slot back to its Database.
pub fn watches(
    c: Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    writer: reflector::store::Writer<Backup>,
) -> Controller<Database> {
    let backups: Api<Backup> = controller::scoped_api(ctx.client.clone(), namespace);
    let watch = watcher(backups, watcher::Config::default().labels(SCHEDULE_OF))
        .default_backoff()
        // The store keeps what the plan reads; managedFields is most of an object.
        .modify(|b| controller::slim(&mut b.metadata));
    let stream = reflector::reflector(writer, watch).touched_objects();
    c.watches_stream(stream, |b: Backup| {
        let ns = b.namespace()?;
        let db = b.labels().get(SCHEDULE_OF)?;
        Some(reflector::ObjectRef::new(db).within(&ns))
    })
}
