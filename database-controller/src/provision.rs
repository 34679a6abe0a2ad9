//! Provisioning, as observe → plan → apply: the role, database, session settings, owner
//! logins, extensions and connection Secret brought to the spec on the Database's
//! DatabaseServer. Each step checks before it writes, so a converged Database costs reads
//! only, and a check soon after a full one ([`State::verified`]) reads the Secret only.

use dbops_api::Database;
use dbops_api::reasons::DatabaseReason;
use dbops_shared::controller::Context;
use dbops_shared::postgres::ddl::{InUse, Observed};
use dbops_shared::postgres::{Session, extensions};
use dbops_shared::server::Resolved;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use crate::admit::{admit, already_on};
use crate::connection::{
    claim_secret, confirm_unseen, existing_or_unseen, secret_is_current, write_secret,
};
use crate::error::{Error, Result, Why, template_error};
use crate::live::confirm_live;
use crate::plan::{self, Change};
use crate::server_access::{admin_session, server_of};
use crate::state::{Provisioned, State};
use crate::{clone, limits, owner_logins, restore, routine, secret, sql, status};

/// Brings the role, database, settings, extensions and connection Secret to the spec.
pub(crate) async fn provision(
    db: &Database,
    ctx: &Context<State>,
    migration_active: bool,
) -> Result<Provisioned> {
    let uid = db.uid().unwrap_or_default();
    let generation = db.metadata.generation.unwrap_or_default();
    let recent = ctx
        .state
        .verified
        .recent(&uid, generation, ctx.resync_interval / 2);
    let latest = ctx.state.statuses.latest(db);
    let converged = routine::converged(db, &latest);
    // Only what the API shows is settled: the Secret, rotation, the status.
    let settled = (recent.is_some() || converged)
        && !owner_logins::due(db, &latest, crate::rotation::secs_now())
        && secret_is_current(db, ctx).await?;
    if settled && let Some(done) = recent {
        return Ok(done);
    }
    let routine = settled && converged && !migration_active;
    let provisioned = provision_in_postgres(db, ctx, migration_active, routine).await;
    match &provisioned {
        Ok(p) => ctx.state.verified.record(&uid, generation, p),
        Err(Error::Deferred) => {}
        Err(_) => ctx.state.verified.forget(&uid),
    }
    provisioned
}

/// The admin's session on the Database's server for a full check: for a routine one
/// (see `routine`), only a slot free now, unless the check was put off long enough.
async fn check_session(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    routine: bool,
) -> Result<Session> {
    let uid = db.uid().unwrap_or_default();
    if !routine || !ctx.state.routine.may_defer(&uid, ctx.resync_interval) {
        return admin_session(&ctx.state.servers, target, "postgres").await;
    }
    let free = ctx
        .state
        .servers
        .connect_if_free(&target.endpoint, &target.credentials, "postgres")
        .await?;
    free.ok_or_else(|| {
        ctx.state.routine.deferred(&uid);
        Error::Deferred
    })
}

/// What the connection Secret found says about the owner's password and login.
struct FromSecret {
    /// The password, if still the one this controller wrote.
    password: Option<String>,
    /// The login it names with its password: the owner, or one of its rotation logins.
    login: Option<owner_logins::Kept>,
    /// The previous login it carries (`dbops.dev/previous-login`).
    carried: Option<owner_logins::Carried>,
    /// Whether the login in use is the owner role itself (no Secret yet counts).
    owner_in_use: bool,
    /// Whether no Secret was found because the cache holds none and none was looked for
    /// (`existing_or_unseen`).
    unseen: bool,
}

impl FromSecret {
    fn read(existing: Option<&Secret>, role: &str, unseen: bool) -> Self {
        let login = existing.and_then(|s| {
            Some(owner_logins::Kept {
                login: secret::username(s)?,
                password: secret::kept_password(s)?,
            })
        });
        Self {
            password: existing.and_then(secret::kept_password),
            owner_in_use: login.as_ref().is_none_or(|k| k.login == role),
            carried: existing.and_then(secret::carried),
            login,
            unseen,
        }
    }
}

/// The full check: reads PostgreSQL and repairs whatever differs from the spec.
async fn provision_in_postgres(
    db: &Database,
    ctx: &Context<State>,
    migration_active: bool,
    routine: bool,
) -> Result<Provisioned> {
    let target = server_of(&ctx.state.directory, db).await?;
    admit(&ctx.state, db, &target)?;
    // Refused before anything is written: templates that do not render, requests over
    // the server's ceilings.
    let (connection_limit, settings) =
        limits::login_requests(&db.spec.login, db.spec.connection_limit, &target.server)?;
    let (existing, unseen) = existing_or_unseen(ctx, db).await?;
    let found = FromSecret::read(existing.as_deref(), &db.owner_role(), unseen);

    let mut session = check_session(db, ctx, &target, routine).await?;
    let database = converge_database(
        db,
        ctx,
        &target,
        &mut session,
        &found,
        connection_limit,
        migration_active,
    )
    .await?;
    let existing = existing.or(database.claimed.clone());
    converge_settings(db, ctx, &mut session, &settings, &database.role_settings).await?;
    let logins =
        converge_logins(db, ctx, &mut session, &found, &database.password, &settings).await?;
    let size_bytes = record_size(db, ctx, database.size_bytes);
    ctx.state
        .routine
        .checked(&db.uid().unwrap_or_default(), database.size_read);
    drop(session);
    install_extensions(db, ctx, &target, &database.extensions).await?;

    let desired = secret::desired_for(
        &secret::Owner::database(db).carrying(logins.carried.as_ref()),
        &db.database_name(),
        &logins.login,
        &target,
        &logins.password,
    )
    .map_err(template_error)?;
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    write_secret(ctx, &secrets, db, existing.as_deref(), &desired).await?;

    let server = &target.endpoint.key;
    Ok(Provisioned {
        provider_id: format!("{server}/{}", database.oid),
        server_version: database.server_version,
        server: target.name.clone(),
        endpoint: server.to_string(),
        size_bytes,
        size_limit: target
            .server
            .spec
            .limits
            .as_ref()
            .and_then(|l| l.database_size.as_deref())
            .and_then(limits::quantity_bytes),
        logins,
    })
}

/// The role and database as the plan left them.
struct Converged {
    oid: u32,
    server_version: String,
    /// The owner role's password: kept, or new.
    password: String,
    /// The spec's extensions as the server offers them (each one allowed there).
    extensions: Vec<extensions::Available>,
    /// The owner role's own settings (`name=value`) as the plan left them.
    role_settings: Vec<String>,
    /// `pg_database_size` as the plan left the database, or as last read within
    /// `routine::SIZE_EVERY`.
    size_bytes: i64,
    /// The size, if this check read it.
    size_read: Option<i64>,
    /// The connection Secret this check created (there was none).
    claimed: Option<std::sync::Arc<Secret>>,
}

/// Observe, plan (pure, see `plan`) and apply: the owner role and the database, with the
/// owner's password (kept while the Secret still holds the one written; otherwise new).
async fn converge_database(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    session: &mut Session,
    found: &FromSecret,
    connection_limit: i32,
    migration_active: bool,
) -> Result<Converged> {
    let (database, role) = (db.database_name(), db.owner_role());
    let known_size = ctx.state.routine.recent_size(&db.uid().unwrap_or_default());
    let (observed, in_use) =
        sql::observe_in_use(session, &role, &database, known_size.is_none()).await?;
    let plan = plan::plan(
        &plan::Inputs {
            uid: &db.uid().unwrap_or_default(),
            role: &role,
            database: &database,
            server: &target.endpoint.key.to_string(),
            connection_limit,
            restore_from: db.filled_at_creation(),
            provisioned_before: status::provider_id(db).is_some(),
            // The owner's password matters only while the Secret names the owner.
            arriving: !already_on(db, &target.name) && found.owner_in_use,
            migration_active,
            password_kept: found.password.is_some() || !found.owner_in_use,
        },
        &observed,
    )?;
    // Extensions: one the server does not allow is refused before anything changes there.
    let extensions = allowed_extensions(db, target, session).await?;
    let password = match &found.password {
        Some(kept) if !plan.new_password && found.owner_in_use => kept.clone(),
        _ => dbops_shared::postgres::generate_password(),
    };
    let fill = fill_source(db, ctx, target, &plan.changes).await?;
    // Apply, in order, for the Database that is still the live one.
    let claimed = before_changes(db, ctx, target, &plan.changes, found.unseen, &password).await?;
    let applying = Applying {
        changes: &plan.changes,
        password: &password,
        fill: fill.as_ref(),
    };
    let applied = apply(db, ctx, target, session, &applying, &observed).await?;
    let in_use = match applied.in_use {
        // The database made (or restored) just now, read again.
        Some(again) => again,
        // A role made just now has no settings of its own yet.
        None if plan.changes.contains(&Change::CreateRole) => InUse {
            role_settings: Vec::new(),
            ..in_use
        },
        None => in_use,
    };
    // Read in the same row as the database's oid, which `apply` found; or last read, when
    // this check did not ask (a database `apply` made or restored is read again with it).
    let size_read = in_use.size_bytes;
    let size_bytes = size_read.or(known_size).ok_or_else(|| Error::Reported {
        reason: DatabaseReason::DatabaseMissing.into(),
        message: format!("database {database:?} vanished while it was being checked"),
    })?;
    Ok(Converged {
        oid: applied.oid,
        server_version: observed.server_version,
        password,
        extensions,
        role_settings: in_use.role_settings,
        size_bytes,
        size_read,
        claimed,
    })
}

/// What fills a new database.
enum Fill {
    /// A Backup's artifact (`restoreFrom`, `cloneFrom.backupRef`).
    Artifact(restore::Artifact),
    /// A live Database (`cloneFrom.databaseRef`), with the clone's place in the queue
    /// (held until the fill is dropped).
    Clone {
        source: clone::Source,
        _slot: crate::clone_slots::Slot,
    },
}

/// What fills the new database, if `changes` fill one, checked before anything changes
/// on the server (a refusal or a wait leaves the server as it was): the Backup's
/// artifact verified (its checksum, a key that opens it), or the source Database Ready
/// and the clone's turn come.
async fn fill_source(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    changes: &[Change],
) -> Result<Option<Fill>> {
    if !changes.iter().any(|c| matches!(c, Change::Restore { .. })) {
        return Ok(None);
    }
    let state = &ctx.state;
    if db.database_to_clone().is_some() {
        let source = clone::prepare(db, ctx, target).await?;
        let slot = clone::slot(db, ctx, target, &source)?;
        return Ok(Some(Fill::Clone {
            source,
            _slot: slot,
        }));
    }
    let artifact = restore::verify(db, &ctx.client, &state.restorer, &state.directory).await?;
    Ok(Some(Fill::Artifact(artifact)))
}

/// Before the plan's `changes` on the server (if any): the Database confirmed live, and a
/// connection Secret the cache did not hold (`unseen`) created for a new owner role with
/// its `password` (`claim_secret`, returned) or else looked for (`confirm_unseen`).
async fn before_changes(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    changes: &[Change],
    unseen: bool,
    password: &str,
) -> Result<Option<std::sync::Arc<Secret>>> {
    if changes.is_empty() {
        return Ok(None);
    }
    let creates_role = changes.contains(&Change::CreateRole);
    if unseen && !creates_role {
        confirm_unseen(ctx, db).await?;
    }
    confirm_live(&ctx.client, db).await?;
    if unseen && creates_role {
        return Ok(Some(claim_secret(ctx, db, target, password).await?));
    }
    Ok(None)
}

/// The owner's session settings (the server's sessionLimits, the spec's settings), against
/// the role's own as the observe read them (`current`).
async fn converge_settings(
    db: &Database,
    ctx: &Context<State>,
    session: &mut Session,
    settings: &[(&'static str, String)],
    current: &[String],
) -> Result<()> {
    let role = db.owner_role();
    let changes = crate::role_sql::settings_statements(&role, settings, current);
    if !changes.is_empty() {
        confirm_live(&ctx.client, db).await?;
        crate::role_sql::apply_settings(session, &role, &changes).await?;
    }
    Ok(())
}

/// Password rotation: the owner's logins (`owner_logins`), or the owner alone.
async fn converge_logins(
    db: &Database,
    ctx: &Context<State>,
    session: &mut Session,
    found: &FromSecret,
    password: &str,
    settings: &[(&'static str, String)],
) -> Result<owner_logins::Logins> {
    if !owner_logins::in_play(db, found.login.as_ref()) {
        return Ok(owner_logins::Logins {
            login: db.owner_role(),
            password: password.to_string(),
            ..owner_logins::Logins::default()
        });
    }
    owner_logins::converge(
        db,
        &ctx.state.statuses.latest(db),
        session,
        found.login.as_ref(),
        found.carried.as_ref(),
        password,
        settings,
        &sql::mark(&db.uid().unwrap_or_default()),
        || confirm_live(&ctx.client, db),
    )
    .await
}

/// The database's size (as the observe read it), for the metric; the status and the
/// server's limits.databaseSize take the returned value.
fn record_size(db: &Database, ctx: &Context<State>, size_bytes: i64) -> i64 {
    let (namespace, name) = (db.namespace().unwrap_or_default(), db.name_any());
    crate::metrics::set_database_size(&namespace, &name, size_bytes);
    ctx.state
        .sizes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((namespace, name));
    size_bytes
}

/// Creates the spec's extensions missing from the database, on a session in it.
async fn install_extensions(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    extensions: &[extensions::Available],
) -> Result<()> {
    if extensions.is_empty() {
        return Ok(());
    }
    let session = admin_session(&ctx.state.servers, target, &db.database_name()).await?;
    let installed = sql::installed_extensions(&session).await?;
    let missing = plan::missing_extensions(&db.spec.extensions, &installed);
    if !missing.is_empty() {
        confirm_live(&ctx.client, db).await?;
    }
    for name in missing {
        if let Some(ext) = extensions.iter().find(|e| &e.name == name) {
            extensions::create(&session, ext).await?;
        }
    }
    Ok(())
}

/// The server's word on each extension of the spec, once every one is allowed there
/// (`dbops_shared::postgres::extensions`); a refusal blocks the Database, naming them.
async fn allowed_extensions(
    db: &Database,
    target: &Resolved,
    session: &Session,
) -> Result<Vec<extensions::Available>> {
    if db.spec.extensions.is_empty() {
        return Ok(Vec::new());
    }
    let offered = extensions::available(session, &db.spec.extensions).await?;
    let allowed = target.server.spec.allowed_extensions.as_deref();
    let superuser =
        !extensions::any_untrusted(&offered) || admin_is_superuser(target, session).await?;
    match extensions::refusal(
        &db.spec.extensions,
        allowed,
        &offered,
        &target.name,
        superuser,
    ) {
        Some(refused) => Err(Error::reported(
            Why::shared(refused.reason),
            refused.message,
        )),
        None => Ok(offered),
    }
}

/// Whether the server's admin is a superuser: as its last probe found (status), else
/// asked now.
async fn admin_is_superuser(target: &Resolved, session: &Session) -> Result<bool> {
    let known = target
        .server
        .status
        .as_ref()
        .and_then(|s| s.capabilities.as_ref());
    Ok(match known {
        Some(c) => c.superuser,
        None => {
            dbops_shared::postgres::ddl::capabilities(session)
                .await?
                .superuser
        }
    })
}

/// Fills a database made for `spec.restoreFrom` or `spec.cloneFrom` (see `restore`,
/// `clone`); returns its oid, which changes when a half-filled database had to be made
/// anew.
async fn restore(
    db: &Database,
    ctx: &Context<State>,
    server: &Resolved,
    session: &Session,
    fresh: bool,
    password: &str,
    fill: Option<&Fill>,
) -> Result<Applied> {
    match fill {
        None => {
            return Err(Error::Internal(
                "a restore without its verified source".into(),
            ));
        }
        Some(Fill::Clone { source, .. }) => {
            clone::fill(db, ctx, server, session, fresh, password, source).await?
        }
        Some(Fill::Artifact(artifact)) if !db.mask().is_empty() => {
            clone::fill_from_backup(db, ctx, server, session, fresh, password, artifact).await?
        }
        Some(Fill::Artifact(artifact)) => {
            // Visible while pg_restore runs, which may take long.
            let api: Api<Database> =
                Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
            let restoring = Err(Error::Reported {
                reason: DatabaseReason::Restoring.into(),
                message: format!("restoring Backup {} (SHA-256 verified)", artifact.backup),
            });
            status::publish(db, ctx, &api, &restoring, None).await?;
            restore::restore(
                db,
                &server.endpoint,
                session,
                &ctx.state.restorer,
                artifact,
                fresh,
                &db.owner_role(),
                password,
            )
            .await?
        }
    }
    let database = db.database_name();
    let (again, in_use) = sql::observe_in_use(session, &db.owner_role(), &database, true).await?;
    let oid = again
        .database
        .map(|d| d.oid)
        .ok_or_else(|| Error::Reported {
            reason: DatabaseReason::DatabaseMissing.into(),
            message: format!("database {database:?} vanished right after its restore"),
        })?;
    Ok(Applied {
        oid,
        in_use: Some(in_use),
    })
}

/// What [`apply`] leaves: the database's oid and, when it made or restored the database,
/// what it read of it again.
struct Applied {
    oid: u32,
    in_use: Option<InUse>,
}

/// What [`apply`] takes on the server: the plan's changes, the owner's password, and
/// what fills a new database.
struct Applying<'a> {
    changes: &'a [Change],
    password: &'a str,
    fill: Option<&'a Fill>,
}

/// Takes the plan's changes in order on the admin's session.
async fn apply(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    session: &mut Session,
    applying: &Applying<'_>,
    observed: &Observed,
) -> Result<Applied> {
    let Applying {
        changes,
        password,
        fill,
    } = *applying;
    let uid = db.uid().unwrap_or_default();
    let (database, role) = (db.database_name(), db.owner_role());
    let server = &target.endpoint.key;
    let mut oid = observed.database.as_ref().map(|d| d.oid);
    let mut read_again = None;
    for change in changes {
        match change {
            Change::CreateRole => {
                sql::create_role(session, &role, password, &sql::mark(&uid)).await?
            }
            Change::SetPassword => sql::set_password(session, &role, password).await?,
            Change::CreateDatabase {
                mark,
                connection_limit,
            } => {
                sql::create_database(session, &database, &role, *connection_limit, mark).await?;
                let (again, in_use) = sql::observe_in_use(session, &role, &database, true).await?;
                read_again = Some(in_use);
                oid = Some(
                    again
                        .database
                        .map(|d| d.oid)
                        .ok_or_else(|| Error::Reported {
                            reason: DatabaseReason::DatabaseMissing.into(),
                            message: format!("database {database:?} vanished right after creation"),
                        })?,
                );
            }
            Change::MarkDatabase { mark } => {
                // Created, then a crash before its mark: marked and closed to PUBLIC now,
                // exactly as a database created in one go.
                sql::mark_database(session, &database, mark).await?
            }
            Change::SetOwner => sql::set_owner(session, &database, &role).await?,
            Change::SetConnectionLimit(limit) => {
                sql::set_connection_limit(session, &database, *limit).await?
            }
            Change::Restore { fresh } => {
                // On the heap: a restore or a clone is a 14 KB future, which every
                // reconcile would otherwise carry, filling a database or not.
                let filling = restore(db, ctx, target, session, *fresh, password, fill);
                let restored = Box::pin(filling).await?;
                oid = Some(restored.oid);
                read_again = restored.in_use;
            }
        }
    }
    // Every plan without CreateDatabase starts from an observed database.
    let oid = oid.ok_or_else(|| Error::Reported {
        reason: DatabaseReason::DatabaseMissing.into(),
        message: format!("database {database:?} is not on {server}"),
    })?;
    Ok(Applied {
        oid,
        in_use: read_again,
    })
}
