//! Replicate: the schema, a publication and a replication role on the source, a
//! subscription on the target; done once every table is copied and the lag is small.

use std::time::Duration;

use dbops_api::{Database, MigrationReason, MigrationStep};
use dbops_shared::postgres::Session;

use super::observe::{Ends, ends, observe, record};
use super::sql;
use super::teardown::drop_slot;
use crate::context::{Saga, StepOutcome};
use crate::debug::Moment;
use crate::dump::pipe::Contents;
use crate::dump::{Copied, copy_once};
use crate::error::{Error, Result};
use crate::servers::{at, migration_uid, session};

/// The lag (bytes of the source's WAL the target has not confirmed) under which the
/// Replicate step is done: the catch-up after the freeze then takes about a second.
pub const LAG_BOUND: i64 = 16 * 1024 * 1024;
/// How often Replicate looks at the replication while it waits.
const POLL: Duration = Duration::from_secs(2);

/// Replicate: the schema, the publication and the replication role on the source, the
/// subscription on the target; done once every table is copied and the lag is under
/// [`LAG_BOUND`], else looked at again after [`POLL`].
pub async fn replicate(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let e = ends(saga, &db.database_name()).await?;
    let schema = copy_schema(saga, &e, &db.owner_role()).await?;
    let mut s = session(saga, &e.source, &e.database).await?;
    let login = publish(saga, &mut s, &e).await?;
    let mut t = session(saga, &e.target, &e.database).await?;
    if sql::subscription(&t, &e.name).await?.is_none() {
        subscribe(saga, (&mut s, &mut t), &e, login).await?;
    }
    drop((s, t));
    let seen = observe(saga, &e, None).await?;
    record(saga, &seen).await?;
    let progress = seen.describe();
    if seen.copied < seen.total || seen.lag_bytes.is_none_or(|lag| lag > LAG_BOUND) {
        return Ok(StepOutcome::Poll(
            format!(
                "replicating {} from {}: {progress}",
                e.database,
                at(&e.source)
            ),
            POLL,
        ));
    }
    Ok(StepOutcome::Done(format!(
        "{schema}; publication, replication role and subscription {} replicate {} from {} to {}: {progress}",
        e.name,
        e.database,
        at(&e.source),
        at(&e.target)
    )))
}

/// Who the subscription logs in to the source as.
enum Login {
    /// The Migration's replication role, made just now with this password.
    Made(String),
    /// The Migration's replication role, made by an earlier attempt: it gets a new
    /// password (only this process knows it).
    Existing,
    /// The source's admin itself: an admin that is not a superuser may not make a role
    /// with REPLICATION before PostgreSQL 16, but may replicate as itself.
    Admin,
}

/// The publication of the database's tables on the source (`s`) and the login the
/// subscription uses there, each made once.
async fn publish(saga: &Saga<'_>, s: &mut Session, e: &Ends) -> Result<Login> {
    if !sql::publication_exists(s, &e.name).await? {
        let tables = crate::sql::tables(s).await?;
        sql::create_publication(s, &e.name, &tables).await?;
    }
    let mark = sql::role_mark(&migration_uid(saga));
    match sql::role(s, &e.name).await? {
        None => {
            let can = crate::sql::capabilities(s).await?;
            if !can.create_replication_role {
                // Preflight refused an admin without REPLICATION.
                return Ok(Login::Admin);
            }
            let (source_num, _) = crate::sql::server_version(s).await?;
            let password = dbops_shared::postgres::generate_password();
            let read_all = can.superuser && source_num >= 140000;
            sql::create_role(s, &e.name, &password, &mark, &e.database, read_all).await?;
            Ok(Login::Made(password))
        }
        Some(comment) if comment.as_deref() == Some(mark.as_str()) => Ok(Login::Existing),
        Some(_) => Err(Error::step(
            MigrationReason::NameConflict,
            format!(
                "a role {} exists on {} and was not created by this Migration",
                e.name,
                at(&e.source)
            ),
        )),
    }
}

/// The subscription on the target (`t`), which creates its slot on the source (`s`).
async fn subscribe(
    saga: &Saga<'_>,
    (s, t): (&mut Session, &mut Session),
    e: &Ends,
    login: Login,
) -> Result<()> {
    // A slot of this name without its subscription: a CREATE SUBSCRIPTION that did not
    // commit on the target after it created the slot. Dropped, then made again.
    for slot in sql::slots(s, &e.name, None).await? {
        drop_slot(s, &slot.name).await?;
    }
    let (user, password) = match login {
        Login::Made(p) => (e.name.clone(), p),
        // The password is known only to this process: a new one when the role was not
        // created just now (a restarted controller rotates it).
        Login::Existing => {
            let p = dbops_shared::postgres::generate_password();
            sql::set_password(s, &e.name, &p).await?;
            (e.name.clone(), p)
        }
        Login::Admin => (
            e.source.credentials.username.clone(),
            e.source.credentials.password.clone(),
        ),
    };
    let conninfo = sql::conninfo(&e.source.endpoint, &e.database, &user, &password, &e.name);
    let (target_num, target_version) = crate::sql::server_version(t).await?;
    // Preflight refuses such a target; a Migration that chose Logical before that rule
    // (an older controller) ends here, before anything runs as the admin.
    if let Some(unsafe_target) = crate::logical::unsafe_target(target_num, &target_version) {
        return Err(Error::step(unsafe_target.reason(), unsafe_target.message()));
    }
    sql::create_subscription(t, &e.name, &conninfo)
        .await
        .map_err(|err| subscription_error(err, e))?;
    // The slot exists on the source; the status knows nothing of it yet.
    saga.crash_point(MigrationStep::Replicate, Moment::SlotCreated);
    Ok(())
}

/// The schema, once: a restore in one transaction, so a database with objects of its
/// own has it all. The programs suit both majors, as the Dump mode's copy takes them.
async fn copy_schema(saga: &Saga<'_>, e: &Ends, owner: &str) -> Result<String> {
    let ends = (&e.source, &e.target);
    Ok(
        match copy_once(saga, ends, &e.database, owner, Contents::SchemaOnly).await? {
            Copied::Already(objects) => {
                format!("schema already copied ({objects} objects in the target database)")
            }
            Copied::Now { seconds, .. } => format!("schema copied in {seconds:.1}s"),
        },
    )
}

/// CREATE SUBSCRIPTION's failure, with the server's message: the target could not reach
/// the source (or log in there), or another.
fn subscription_error(err: dbops_shared::postgres::PgError, e: &Ends) -> Error {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    if text.contains("could not connect to the publisher") {
        return Error::step(
            MigrationReason::SourceUnreachableFromTarget,
            format!(
                "the target {} cannot connect to the source {} for the subscription: {text}",
                at(&e.target),
                at(&e.source)
            ),
        );
    }
    Error::step(MigrationReason::SubscriptionFailed, text)
}
