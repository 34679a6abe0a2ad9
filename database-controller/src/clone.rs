//! `spec.cloneFrom.databaseRef`: the new database filled with a copy of a live Database
//! of the same namespace, consistent at one instant, before it turns Ready.
//!
//! The steps, each safe to repeat after a crash (the database keeps its `restore=pending`
//! mark until the copy has committed, and a pending one is made anew, empty):
//! 1. before anything changes on the server ([`prepare`]): the source exists and is
//!    Ready, its server is one this installation serves, the copy's server is of its
//!    major or newer, and `mask` applies to its catalog;
//! 2. a place in the server's queue ([`Slots`]): `limits.concurrentClones` copies at
//!    once (2 by default), and `limits.cloneSpace` for all clones together; the others
//!    wait with `CloneQueued`, looked at again every few seconds;
//! 3. on the source, as its admin: a read-only REPEATABLE READ transaction exports its
//!    snapshot and its instant (`status.clone.copiedAt`), counts the tables, and checks
//!    `mask` against the catalog (`source`); catalog reads only;
//! 4. `pg_dump` of that snapshot → the mask filter → `psql` as the owner, in one
//!    transaction (`copy`): tenant code runs as the owner, never as an admin, and the
//!    original values of masked columns never reach the copy's server;
//! 5. the mark loses `restore=pending`.
//!
//! The source stays writable: pg_dump takes `ACCESS SHARE` locks only, and the snapshot
//! makes the copy consistent without stopping writers.

pub mod copy;
pub mod mask;
pub mod source;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dbops_api::reasons::DatabaseReason;
use dbops_api::{CloneStatus, Database};
use dbops_shared::controller::Context;
use dbops_shared::pg_tools::{self, Connection, Program};
use dbops_shared::postgres::{Session, ddl};
use dbops_shared::server::Resolved;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;

use crate::clone_slots as slots;
use crate::error::{Error, Result};
use crate::server_access::{admin_session, server_of};
use crate::state::State;
use crate::{restore, sql, status};

/// How often a queued clone, or one whose source is not Ready yet, is looked at again.
pub const QUEUED_AGAIN: Duration = Duration::from_secs(5);
/// How often a running copy's progress is written to its status.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// `limits.concurrentClones` when the server does not set it.
pub const DEFAULT_CONCURRENT_CLONES: usize = 2;

/// The Database a clone copies, and its server.
pub struct Source {
    pub db: Arc<Database>,
    pub server: Resolved,
}

impl Source {
    fn describe(&self) -> String {
        format!("Database {} on {}", self.db.name_any(), self.server.name)
    }
}

/// Step 1: the source named in `cloneFrom.databaseRef`, Ready, on a server this
/// installation serves, of a major the copy's server (`target`) can take.
pub async fn prepare(db: &Database, ctx: &Context<State>, target: &Resolved) -> Result<Source> {
    let name = db.database_to_clone().unwrap_or_default();
    let namespace = db.namespace().unwrap_or_default();
    let source = ctx
        .state
        .databases
        .get()
        .and_then(|store| store.get(&ObjectRef::new(name).within(&namespace)))
        .ok_or_else(|| Error::Reported {
            reason: DatabaseReason::CloneSourceNotFound.into(),
            message: format!(
                "spec.cloneFrom.databaseRef: there is no Database {namespace}/{name} to copy"
            ),
        })?;
    let ready = source.metadata.deletion_timestamp.is_none()
        && status::provider_id(&source).is_some()
        && dbops_shared::conditions::get(
            &source.status.clone().unwrap_or_default().conditions,
            dbops_api::condition::READY,
        )
        .is_some_and(|c| c.status == "True");
    if !ready {
        return Err(Error::Waiting {
            reason: DatabaseReason::CloneSourceNotReady.into(),
            message: format!("waiting for Database {name}, the source of this clone, to be Ready"),
            again: QUEUED_AGAIN,
        });
    }
    let server = server_of(&ctx.state.directory, &source).await?;
    let major = |v: Option<&str>| v.and_then(|v| v.split(['.', ' ']).next()?.parse::<u32>().ok());
    let from = major(
        source
            .status
            .as_ref()
            .and_then(|s| s.server_version.as_deref()),
    );
    let into = major(
        target
            .server
            .status
            .as_ref()
            .and_then(|s| s.server_version.as_deref()),
    );
    if let (Some(from), Some(into)) = (from, into)
        && into < from
    {
        return Err(older_major(name, from, &target.name, into));
    }
    let source = Source { db: source, server };
    check_mask(db, ctx, &source).await?;
    Ok(source)
}

/// `cloneFrom.mask` checked against the source's catalog as it is now, so that a mask
/// that cannot apply is refused before anything is made on the copy's server (the copy
/// checks it again in its own snapshot).
async fn check_mask(db: &Database, ctx: &Context<State>, source: &Source) -> Result<()> {
    if db.mask().is_empty() {
        return Ok(());
    }
    let database = source.db.database_name();
    let on = (&source.server, database.as_str());
    mask_rules_on(ctx, on, db, &source.describe())
        .await
        .map(|_| ())
}

/// `db`'s mask checked against the catalog of `database` on `server` (a read-only
/// transaction as the admin: catalog reads only) and turned into the filter's rules.
async fn mask_rules_on(
    ctx: &Context<State>,
    (server, database): (&Resolved, &str),
    db: &Database,
    described: &str,
) -> Result<mask::Rules> {
    let checking = || dbops_shared::postgres::PgError::sql("checking the mask");
    let mut session = admin_session(&ctx.state.servers, server, database).await?;
    let tx = session.transaction().await.map_err(checking())?;
    tx.batch_execute("SET TRANSACTION READ ONLY")
        .await
        .map_err(checking())?;
    let rules = source::rules(&tx, db.mask(), described).await;
    let _ = tx.rollback().await;
    rules
}

fn older_major(source: &str, from: u32, target: &str, into: u32) -> Error {
    Error::Reported {
        reason: DatabaseReason::CloneToOlderMajor.into(),
        message: format!(
            "Database {source} is on PostgreSQL {from}, and {target} runs {into}: a copy goes to the same major or a newer one only"
        ),
    }
}

/// Step 2: a place for `db`'s copy on `target`, or `CloneQueued` saying what it waits for.
pub fn slot(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    source: &Source,
) -> Result<slots::Slot> {
    let limits = target.server.spec.limits.as_ref();
    let most = limits
        .and_then(|l| l.concurrent_clones)
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(DEFAULT_CONCURRENT_CLONES);
    let space = limits
        .and_then(|l| l.clone_space.as_deref())
        .and_then(crate::limits::quantity_bytes);
    let uid = db.uid().unwrap_or_default();
    let ask = slots::Ask {
        server: &target.name,
        uid: &uid,
        who: (db.namespace().unwrap_or_default(), db.name_any()),
        size: source
            .db
            .status
            .as_ref()
            .and_then(|s| s.size_bytes)
            .unwrap_or(0),
        most,
        space,
        used: clones_size(ctx, &target.name, &uid),
    };
    ctx.state
        .clones
        .take(&ask)
        .map_err(|message| Error::Waiting {
            reason: DatabaseReason::CloneQueued.into(),
            message,
            again: QUEUED_AGAIN,
        })
}

/// The sizes, as last read, of the clones on `server` other than `uid`'s.
fn clones_size(ctx: &Context<State>, server: &str, uid: &str) -> i64 {
    let Some(store) = ctx.state.databases.get() else {
        return 0;
    };
    store
        .state()
        .iter()
        .filter(|d| d.spec.clone_from.is_some() && d.uid().as_deref() != Some(uid))
        .filter_map(|d| d.status.as_ref())
        .filter(|s| s.server.as_deref() == Some(server))
        .filter_map(|s| s.size_bytes)
        .sum()
}

/// Steps 3 to 5, into the database just made (`fresh`) or made anew here.
#[allow(clippy::too_many_arguments)]
pub async fn fill(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    session: &Session,
    fresh: bool,
    password: &str,
    source: &Source,
) -> Result<()> {
    let (owner, database, uid) = (
        db.owner_role(),
        db.database_name(),
        db.uid().unwrap_or_default(),
    );
    if !fresh {
        restore::start_over(session, db, &owner).await?;
    }
    let (into_num, _) = ddl::server_version(session).await?;
    let source_database = source.db.database_name();
    let mut on_source = admin_session(&ctx.state.servers, &source.server, &source_database).await?;
    let tx = on_source
        .transaction()
        .await
        .map_err(dbops_shared::postgres::PgError::sql(
            "beginning the clone's snapshot",
        ))?;
    let snapshot = source::snapshot(&tx).await?;
    let (from, into) = (major(snapshot.server_version_num), major(into_num));
    if into < from {
        return Err(older_major(&source.db.name_any(), from, &target.name, into));
    }
    let rules = source::rules(&tx, db.mask(), &source.describe()).await?;
    let (pg_dump, psql) = programs(ctx, from, into).await?;
    let mut clone = CloneStatus {
        source: Some(source.describe()),
        copied_at: Some(Time(snapshot.at)),
        started_at: Some(dbops_shared::conditions::now()),
        tables_total: Some(snapshot.tables),
        ..CloneStatus::default()
    };
    let key = dbops_shared::postgres::generate_password().into_bytes();
    let filter = mask::Filter::new(rules, key);
    let programs = copy::Programs {
        pg_dump: &pg_dump.path,
        psql: &psql,
        pg_dump_major: pg_dump.version.major,
        from: Connection::of(
            &source.server.endpoint,
            &source.server.credentials,
            &source_database,
            "dbops-database-controller-clone",
        ),
        into: Connection {
            server: &target.endpoint,
            username: &owner,
            password,
            database: &database,
            application: "dbops-database-controller-clone",
        },
        snapshot: &snapshot.id,
    };
    let copy = |tally: watch::Sender<mask::Tally>| async move {
        copy::run(&programs, filter, &tally).await
    };
    let tally = copied(db, ctx, copy, &mut clone).await;
    let _ = tx.rollback().await;
    let tally = tally?;
    sql::comment_database(session, &database, &sql::mark(&uid)).await?;
    tracing::info!(
        database,
        source = clone.source,
        tables = tally.tables,
        masked = tally.masked,
        bytes = tally.bytes,
        "cloned"
    );
    Ok(())
}

fn major(version_num: i32) -> u32 {
    u32::try_from(version_num / 10000).unwrap_or(0)
}

/// The copy, with its progress written to status every few seconds and once at the end.
async fn copied<F, Fut>(
    db: &Database,
    ctx: &Context<State>,
    copy: F,
    clone: &mut CloneStatus,
) -> Result<mask::Tally>
where
    F: FnOnce(watch::Sender<mask::Tally>) -> Fut,
    Fut: std::future::Future<Output = Result<mask::Tally>>,
{
    let (tx, mut rx) = watch::channel(mask::Tally::default());
    report(db, ctx, clone, &mask::Tally::default()).await?;
    let copying = copy(tx);
    tokio::pin!(copying);
    let tally = loop {
        tokio::select! {
            done = &mut copying => break done?,
            _ = tokio::time::sleep(PROGRESS_EVERY) => {
                let now = *rx.borrow_and_update();
                report(db, ctx, clone, &now).await?;
            }
        }
    };
    clone.completed_at = Some(dbops_shared::conditions::now());
    report(db, ctx, clone, &tally).await?;
    Ok(tally)
}

/// Writes the clone's progress: `status.clone` and the `Cloning` condition's message.
async fn report(
    db: &Database,
    ctx: &Context<State>,
    clone: &mut CloneStatus,
    tally: &mask::Tally,
) -> Result<()> {
    clone.tables = Some(i32::try_from(tally.tables).unwrap_or(i32::MAX));
    clone.bytes = Some(i64::try_from(tally.bytes).unwrap_or(i64::MAX));
    clone.masked_values = Some(i64::try_from(tally.masked).unwrap_or(i64::MAX));
    let of_total = clone
        .tables_total
        .map(|t| format!(" of {t}"))
        .unwrap_or_default();
    let message = match clone.completed_at {
        Some(_) => format!(
            "copied {} ({}{of_total} tables, {} bytes); finishing",
            clone.source.as_deref().unwrap_or_default(),
            tally.tables,
            tally.bytes
        ),
        None => format!(
            "copying {}: {}{of_total} tables, {} bytes so far",
            clone.source.as_deref().unwrap_or_default(),
            tally.tables,
            tally.bytes
        ),
    };
    let cloning = Err(Error::Reported {
        reason: DatabaseReason::Cloning.into(),
        message,
    });
    status::publish_clone(db, ctx, &cloning, clone.clone()).await
}

/// The pg_dump and the psql beside it that copy a database of `from` into `into`: a
/// pg_dump that dumps the source (its major or newer), the copy server's own major first,
/// else the newest older one, else a newer one whose output the server takes
/// (`pg_tools::restores_into`).
async fn programs(ctx: &Context<State>, from: u32, into: u32) -> Result<(Program, PathBuf)> {
    let dumps = ctx.state.restorer.clients.pg_dumps().await;
    let fits = |p: &&Program| p.version.major >= from;
    let exact = dumps.iter().filter(fits).find(|p| p.version.major == into);
    let older = dumps
        .iter()
        .filter(fits)
        .filter(|p| p.version.major < into)
        .max_by_key(|p| p.version.major);
    let newer = dumps
        .iter()
        .filter(fits)
        .filter(|p| p.version.major > into && pg_tools::restores_into(p.version.major, into))
        .min_by_key(|p| p.version.major);
    let Some(pg_dump) = exact.or(older).or(newer) else {
        return Err(Error::Reported {
            reason: DatabaseReason::ClientProgramMissing.into(),
            message: format!(
                "no pg_dump given to the database-controller copies PostgreSQL {from} into {into} (found: {}); run it with one (--pg-dump, --pg-bin-dir)",
                dumps
                    .iter()
                    .map(|p| p.version.version.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    };
    Ok((pg_dump.clone(), pg_dump.path.with_file_name("psql")))
}

/// `cloneFrom.backupRef` with a `mask`: the Backup's verified artifact restored as the
/// owner in three parts, so that no original value of a masked column reaches the
/// server: its schema (`pg_restore --section=pre-data`, committed: it holds no row), the
/// mask checked against that schema (catalog reads, as the admin), its rows
/// (`--section=data` as plain SQL through the mask filter into psql, one transaction),
/// then its indexes, constraints and triggers (`--section=post-data`; one that the masked
/// values break is `MaskInvalid`). A failure leaves the database marked pending: the next
/// attempt starts again from an empty one.
pub async fn fill_from_backup(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    session: &Session,
    fresh: bool,
    password: &str,
    artifact: &restore::Artifact,
) -> Result<()> {
    let (owner, database) = (db.owner_role(), db.database_name());
    if !fresh {
        restore::start_over(session, db, &owner).await?;
    }
    let restorer = &ctx.state.restorer;
    let pg_restore = restore::pick_pg_restore(session, restorer, artifact).await?;
    let into = restore::Target {
        db,
        server: &target.endpoint,
        owner: &owner,
        password,
    };
    let schema = restore::restore_section(&into, &pg_restore, restorer, artifact, Some("pre-data"));
    schema.await?;
    let described = format!("Backup {}", artifact.backup);
    // The mask against the schema just restored into the new database.
    let rules = mask_rules_on(ctx, (target, &database), db, &described).await?;
    let mut clone = CloneStatus {
        source: Some(described),
        copied_at: artifact.taken_at.clone(),
        started_at: Some(dbops_shared::conditions::now()),
        ..CloneStatus::default()
    };
    let key = dbops_shared::postgres::generate_password().into_bytes();
    let filter = mask::Filter::new(rules, key);
    let (to, program) = (&into, pg_restore.as_path());
    let copy = |tally: watch::Sender<mask::Tally>| async move {
        masked_rows(to, program, restorer, artifact, filter, &tally).await
    };
    copied(db, ctx, copy, &mut clone).await?;
    let constraints =
        restore::restore_section(&into, &pg_restore, restorer, artifact, Some("post-data"));
    constraints.await.map_err(|e| Error::Reported {
        reason: DatabaseReason::MaskInvalid.into(),
        message: format!(
            "spec.cloneFrom.mask: the Backup's indexes and constraints do not hold on the masked values ({e}); hash both ends of a foreign key, and keep unique columns unique"
        ),
    })?;
    sql::comment_database(
        session,
        &database,
        &sql::mark(&db.uid().unwrap_or_default()),
    )
    .await?;
    tracing::info!(
        database,
        source = clone.source,
        masked = clone.masked_values,
        "cloned"
    );
    Ok(())
}

/// `pg_restore --section=data --file=-` fed the artifact → the mask → psql as the owner.
async fn masked_rows(
    into: &restore::Target<'_>,
    pg_restore: &std::path::Path,
    restorer: &restore::Restorer,
    artifact: &restore::Artifact,
    filter: mask::Filter,
    tally: &watch::Sender<mask::Tally>,
) -> Result<mask::Tally> {
    let mut command = tokio::process::Command::new(pg_restore);
    command
        .args([
            "--section=data",
            "--file=-",
            "--no-owner",
            "--no-privileges",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let database = into.db.database_name();
    let connection = Connection {
        server: into.server,
        username: into.owner,
        password: into.password,
        database: &database,
        application: "dbops-database-controller-clone",
    };
    let psql = pg_restore.with_file_name("psql");
    let (load, _ca) =
        copy::load_command(&psql, &connection).map_err(|e| copy::could_not_run(&psql, e))?;
    let source = copy::Source {
        command,
        program: pg_restore,
    };
    let feed = |stdin: Option<tokio::process::ChildStdin>| async move {
        let stdin = stdin.ok_or_else(|| "pg_restore's input is not piped".to_string())?;
        let (copy_error, copied) = restore::feed_part(stdin, restorer, artifact, true)
            .await
            .map_err(|e| e.to_string())?;
        restore::copied_as_verified(copy_error, &copied, artifact).map_err(|e| e.to_string())
    };
    copy::pipeline(source, load, feed, filter, tally).await
}
