//! Preflight: records the source, refuses a target that cannot take the Database (the
//! admission: exists, not being deleted, allows the namespace, has room), reads both
//! servers and chooses the mode once. Read only: nothing to compensate.

use std::sync::Arc;
use std::time::Duration;

use dbops_api::{ChosenMode, Database, DatabaseServer, MigrationMode, MigrationReason, condition};
use dbops_shared::controller::{ErrorKind, retry_of};
use dbops_shared::postgres::{PgError, extensions};
use dbops_shared::server::{Resolved, ServerError};
use dbops_shared::status::Desired;
use kube::ResourceExt;

use crate::context::{Saga, StepOutcome, note};
use crate::dump::programs::copy_programs;
use crate::error::{Error, Result, reason_of};
use crate::servers::{at, database_uid, major, migration_uid, resolve, session, source_ref};
use crate::sql;

/// How long Preflight waits for the cache of Databases to fill after the process starts.
const DATABASES_SYNC_WAIT: Duration = Duration::from_secs(30);

/// Errors that retrying Preflight cannot cure end it at once: refused credentials or
/// TLS, and a DatabaseServer that cannot be used (not found, being deleted, namespace not
/// allowed, admin or CA Secret missing or invalid). Caches not synced yet are retried.
fn preflight_error(e: Error) -> Error {
    match e {
        Error::Postgres(ref pg @ (PgError::AuthenticationFailed { .. } | PgError::Tls { .. })) => {
            Error::refused(reason_of(pg.reason()), e.to_string())
        }
        Error::Server(e) if !e.is_transient() => {
            Error::refused(reason_of(e.reason()), e.to_string())
        }
        e => e,
    }
}

pub async fn preflight(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    if db.metadata.deletion_timestamp.is_some() {
        return Err(Error::step(
            MigrationReason::DatabaseDeleting,
            format!("Database {} is being deleted", db.name_any()),
        ));
    }
    let ready = db
        .status
        .as_ref()
        .is_some_and(|s| dbops_shared::conditions::is_true(&s.conditions, condition::READY));
    if !ready {
        return Ok(StepOutcome::Wait(format!(
            "waiting for Database {} to be Ready",
            db.name_any()
        )));
    }
    let mut status = saga.status();
    if status.source_server.is_none()
        || status.database_uid.is_none()
        || status.database_name.is_none()
        || status.owner_role.is_none()
    {
        status.source_server = Some(db.spec.server_ref.clone());
        status.database_uid = db.uid();
        status.database_name = Some(db.database_name());
        status.owner_role = Some(db.owner_role());
        saga.save(status).await?;
    }
    preflight_checks(saga, db).await.map_err(preflight_error)
}

async fn preflight_checks(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let (source, target) = two_servers(saga, db).await?;
    let (database, role) = (db.database_name(), db.owner_role());
    let (source_version, extensions) = source_database(saga, &source, &database, &role).await?;
    let target_version = target_takes(
        saga,
        &target,
        source_version.clone(),
        &extensions,
        (&database, &role),
    )
    .await?;
    let mode = choose_mode(
        saga,
        &source,
        &database,
        (target_version.0, &target_version.1),
    )
    .await?;
    let (pg_dump, pg_restore) = copy_programs(
        saga,
        (source_version.0, &source_version.1),
        (target_version.0, &target_version.1),
        // The Logical mode's schema copy picks from every program too: pg_restore 17+
        // cannot restore into a server older than 17.
        true,
    )
    .await
    .map_err(|e| match e {
        Error::Step { reason, message } if retry_of(reason.class()) == ErrorKind::Permanent => {
            Error::step(reason, format!("{message}; nothing was changed"))
        }
        e => e,
    })?;
    Ok(StepOutcome::Done(format!(
        "source PostgreSQL {} on {}, target PostgreSQL {} on {}; extensions {extensions:?} available; no role or database {database:?} on the target; mode {mode:?}, copying with pg_dump {} and pg_restore {}",
        source_version.1,
        at(&source),
        target_version.1,
        at(&target),
        pg_dump.version.version,
        pg_restore.version.version
    )))
}

/// The source (as recorded) and the admitted target, resolved: two servers, by name and
/// by `host:port`.
async fn two_servers(saga: &Saga<'_>, db: &Database) -> Result<(Resolved, Resolved)> {
    let source_ref = source_ref(saga)?;
    if source_ref == saga.m.spec.target.server_ref {
        return Err(Error::step(
            MigrationReason::TargetIsSource,
            format!(
                "the target DatabaseServer {} is the one the Database is on",
                source_ref.name
            ),
        ));
    }
    let target = admitted_target(saga, db).await?;
    let source = resolve(saga, &source_ref).await?;
    if source.endpoint.key == target.endpoint.key {
        return Err(Error::step(
            MigrationReason::TargetIsSource,
            format!(
                "the target {} is the server the Database is on ({})",
                at(&target),
                at(&source)
            ),
        ));
    }
    Ok((source, target))
}

/// The source's version (`server_version_num`, `server_version`) and the extensions of
/// its database, which must be the Database's.
async fn source_database(
    saga: &Saga<'_>,
    source: &Resolved,
    database: &str,
    role: &str,
) -> Result<((i32, String), Vec<String>)> {
    let uid = database_uid(saga)?;
    let s = session(saga, source, "postgres").await?;
    let version = sql::server_version(&s).await?;
    let found = sql::observe(&s, role, database).await?.database;
    drop(s);
    if !found.is_some_and(|d| sql::is_databases(d.comment.as_deref(), &uid)) {
        return Err(Error::step(
            MigrationReason::SourceNotFound,
            format!(
                "database {database:?} on {} does not exist or was not created by this Database",
                at(source)
            ),
        ));
    }
    let s = session(saga, source, database).await?;
    let extensions = sql::installed_extensions(&s).await?;
    Ok((version, extensions))
}

/// The target's version, once it is known to take the database: not older than the
/// source, allowing and offering its extensions, no foreign role or database of its names.
async fn target_takes(
    saga: &Saga<'_>,
    target: &Resolved,
    (source_num, source_version): (i32, String),
    extensions: &[String],
    (database, role): (&str, &str),
) -> Result<(i32, String)> {
    let t = session(saga, target, "postgres").await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    if major(target_num) < major(source_num) {
        return Err(Error::step(
            MigrationReason::TargetVersionTooOld,
            format!(
                "the target runs PostgreSQL {target_version}, older than the source's {source_version}"
            ),
        ));
    }
    // Every extension of the source database must be allowed on the target too (its
    // allowedExtensions, or trusted when it has none) and available there.
    let offered = extensions::available(&t, extensions).await?;
    let allowed = target.server.spec.allowed_extensions.as_deref();
    let superuser = !extensions::any_untrusted(&offered) || sql::capabilities(&t).await?.superuser;
    if let Some(refused) =
        extensions::refusal(extensions, allowed, &offered, &target.name, superuser)
    {
        return Err(Error::step(
            reason_of(refused.reason),
            format!(
                "the database uses extensions the target does not take: {}",
                refused.message
            ),
        ));
    }
    let (uid, muid) = (database_uid(saga)?, migration_uid(saga));
    let found = sql::observe(&t, role, database).await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    let conflict = |what: &str, name: &str| {
        Error::step(
            MigrationReason::NameConflict,
            format!(
                "a {what} {name:?} already exists on {} and was not created by this Migration; nothing was changed",
                at(target)
            ),
        )
    };
    if found.database.is_some_and(|d| !ours(d.comment.as_deref())) {
        return Err(conflict("database", database));
    }
    if found.role.is_some_and(|r| !ours(r.comment.as_deref())) {
        return Err(conflict("role", role));
    }
    Ok((target_num, target_version))
}

/// The mode the Migration runs in: recorded once (with the ModeChosen condition and an
/// Event) and never changed afterwards. `Logical` refuses a source that cannot replicate
/// (the Logical Preflight's reason); `Auto` then falls back to Dump, saying why.
async fn choose_mode(
    saga: &mut Saga<'_>,
    source: &Resolved,
    database: &str,
    (target_num, target_version): (i32, &str),
) -> Result<ChosenMode> {
    if let Some(mode) = saga.status().mode {
        return Ok(mode);
    }
    let (mode, reason, message) = match saga.m.spec.mode {
        MigrationMode::Dump => (
            ChosenMode::Dump,
            MigrationReason::DumpRequested,
            "mode Dump: the source is frozen for the whole copy".to_string(),
        ),
        requested => {
            let target = crate::servers::target_server(saga).await?;
            let t = session(saga, &target, "postgres").await?;
            let subscribes = sql::capabilities(&t).await?.create_subscription;
            drop(t);
            let s = session(saga, source, database).await?;
            let unmet =
                crate::logical::preflight(&s, target_num, target_version, subscribes).await?;
            drop(s);
            match crate::logical::auto_mode(unmet) {
                crate::logical::Mode::Logical => (
                    ChosenMode::Logical,
                    MigrationReason::LogicalPossible,
                    format!(
                        "mode {requested:?}: the source can replicate logically; it stays writable until a short freeze for the final catch-up"
                    ),
                ),
                crate::logical::Mode::Dump { because } => {
                    let (reason, why) = crate::logical::condition(&because)
                        .unwrap_or((MigrationReason::LogicalNotPossible, String::new()));
                    if requested == MigrationMode::Logical {
                        return Err(Error::step(
                            reason,
                            format!("mode Logical is not possible on {}: {why}", at(source)),
                        ));
                    }
                    (
                        ChosenMode::Dump,
                        reason,
                        format!(
                            "mode Auto chose Dump (the source is frozen for the whole copy) because logical replication is not possible on {}: {why}",
                            at(source)
                        ),
                    )
                }
            }
        }
    };
    let mut status = saga.status();
    crate::progress::choose_mode(&mut status, mode);
    dbops_shared::conditions::set_condition(
        &mut status.conditions,
        dbops_shared::conditions::ConditionSpec {
            type_: crate::progress::MODE_CHOSEN,
            status: dbops_shared::conditions::ConditionStatus::from(mode == ChosenMode::Logical),
            reason: reason.as_str(),
            message: message.clone(),
            observed_generation: saga.m.metadata.generation,
        },
        dbops_shared::conditions::now(),
    );
    let fallback = saga.m.spec.mode == MigrationMode::Auto && mode == ChosenMode::Dump;
    let event = match mode {
        ChosenMode::Logical => "LogicalModeChosen",
        ChosenMode::Dump => "DumpModeChosen",
    };
    let chosen = note(!fallback, event, message);
    saga.write(Desired::new(status).with(chosen)).await?;
    Ok(mode)
}

/// The target DatabaseServer, resolved, if the Database may move there: it exists (and
/// this installation serves it), is not being deleted, allows the Migration's namespace
/// and has room under its `databasesPerNamespace` limit. Checked before anything is
/// touched; a refusal ends Preflight at once (`preflight_error`).
async fn admitted_target(saga: &Saga<'_>, db: &Database) -> Result<Resolved> {
    let directory = &saga.ctx.state.directory;
    directory.synced().await?;
    let name = &saga.m.spec.target.server_ref.name;
    let server = directory
        .get(name)
        .ok_or_else(|| ServerError::NotFound(name.clone()))?;
    if server.metadata.deletion_timestamp.is_some() {
        return Err(ServerError::Deleting(name.clone()).into());
    }
    directory.admits(&server, &saga.namespace)?;
    check_quota(saga, db, &server).await?;
    Ok(directory.resolve_server(server)?)
}

/// Refuses (`QuotaExceeded`) a move that would put more Databases of the Migration's
/// namespace on `server` than its `limits.databasesPerNamespace`.
async fn check_quota(saga: &Saga<'_>, db: &Database, server: &DatabaseServer) -> Result<()> {
    let Some(limit) = server
        .spec
        .limits
        .as_ref()
        .and_then(|l| l.databases_per_namespace)
    else {
        return Ok(());
    };
    let store = &saga.ctx.state.databases;
    if !dbops_shared::store_ready::ready_within(store, DATABASES_SYNC_WAIT).await {
        return Err(Error::DatabasesNotSynced);
    }
    let name = server.name_any();
    let there = databases_on(&store.state(), &saga.namespace, &name, db);
    if has_room(limit, there) {
        return Ok(());
    }
    Err(Error::step(
        MigrationReason::QuotaExceeded,
        format!(
            "DatabaseServer {name} allows {limit} Databases per namespace and namespace {} has {there} there already; nothing was changed",
            saga.namespace
        ),
    ))
}

/// How many Databases of `namespace` other than `db` name `server` in `spec.serverRef`
/// (being deleted or not: they hold their database there until they are gone).
fn databases_on(all: &[Arc<Database>], namespace: &str, server: &str, db: &Database) -> usize {
    all.iter()
        .filter(|d| d.metadata.namespace.as_deref() == Some(namespace))
        .filter(|d| d.spec.server_ref.name == server)
        .filter(|d| {
            (&d.metadata.namespace, &d.metadata.name) != (&db.metadata.namespace, &db.metadata.name)
        })
        .count()
}

/// Whether one more Database fits under `limit` beside the `there` already on the server.
fn has_room(limit: i32, there: usize) -> bool {
    i64::try_from(there).is_ok_and(|there| there < i64::from(limit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn database(namespace: &str, name: &str, server: &str) -> Database {
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"serverRef": {"name": server}},
        }))
        .unwrap()
    }

    #[test]
    fn the_quota_counts_the_namespaces_other_databases_on_the_target() {
        let moving = database("shop", "orders", "pg-16");
        let all: Vec<Arc<Database>> = [
            database("shop", "orders", "pg-16"),
            database("shop", "carts", "pg-17"),
            database("shop", "users", "pg-17"),
            database("shop", "audit", "pg-16"),
            database("other", "orders", "pg-17"),
        ]
        .into_iter()
        .map(Arc::new)
        .collect();
        assert_eq!(databases_on(&all, "shop", "pg-17", &moving), 2);
        assert_eq!(databases_on(&all, "other", "pg-17", &moving), 1);
        // A Database already there (a target that is its own source) is not counted twice.
        let there = database("shop", "carts", "pg-17");
        assert_eq!(databases_on(&all, "shop", "pg-17", &there), 1);
        assert_eq!(databases_on(&all, "shop", "pg-15", &moving), 0);
    }

    #[test]
    fn one_more_database_fits_only_below_the_limit() {
        assert!(has_room(3, 2));
        assert!(!has_room(3, 3));
        assert!(!has_room(0, 0), "a limit of 0 admits none");
        assert!(has_room(1, 0));
    }

    #[test]
    fn preflight_refuses_an_unusable_server_for_good_and_waits_for_the_caches() {
        let refused = |e: ServerError| match preflight_error(e.into()) {
            Error::Refused { reason, .. } => reason,
            other => panic!("not fatal: {other:?}"),
        };
        assert_eq!(
            refused(ServerError::NotFound("pg-17".into())),
            "ServerNotFound"
        );
        assert_eq!(
            refused(ServerError::NamespaceNotAllowed {
                server: "pg-17".into(),
                namespace: "shop".into(),
                detail: "its labels do not match spec.allowedNamespaces".into(),
            }),
            "NamespaceNotAllowed"
        );
        assert_eq!(
            refused(ServerError::Deleting("pg-17".into())),
            "ServerDeleting"
        );
        assert_eq!(
            refused(ServerError::AdminSecretNotFound {
                server: "pg-17".into(),
                secret: "dbops-system/pg-17-admin".into(),
            }),
            "AdminSecretNotFound"
        );
        assert!(matches!(
            preflight_error(ServerError::NotSynced.into()),
            Error::Server(ServerError::NotSynced)
        ));
        assert!(matches!(
            preflight_error(Error::step(MigrationReason::SessionsRemain, "1 session")),
            Error::Step {
                reason: MigrationReason::SessionsRemain,
                ..
            }
        ));
    }
}
