//! ProvisionTarget: the role and database on the target, marked with this Migration, and
//! the source's extensions; its compensation drops what carries this Migration's mark.

use dbops_api::{Database, MigrationReason};
use dbops_shared::postgres::extensions;

use crate::context::{Saga, StepOutcome};
use crate::error::{Error, Result};
use crate::servers::{
    at, database_uid, migration_uid, names, session, source_server, target_server,
};
use crate::sql;

pub async fn provision_target(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let target = target_server(saga).await?;
    let source = source_server(saga).await?;
    let uid = database_uid(saga)?;
    let muid = migration_uid(saga);
    let mark = sql::migration_mark(&uid, &muid);
    let (database, role) = (db.database_name(), db.owner_role());

    let mut t = session(saga, &target, "postgres").await?;
    let found = sql::observe(&t, &role, &database).await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    if found.role.is_some() && !found.role_is(ours) {
        return Err(Error::step(
            MigrationReason::NameConflict,
            format!("role {role:?} appeared on {} meanwhile", at(&target)),
        ));
    }
    if found.database.is_some() && !found.database_is(ours, &role) {
        return Err(Error::step(
            MigrationReason::NameConflict,
            format!(
                "database {database:?} appeared on {} meanwhile",
                at(&target)
            ),
        ));
    }
    // A password nobody knows: the role is not used before the switch, and the
    // database-controller gives it the connection Secret's password when the Database
    // arrives on this server (this controller never reads a tenant's Secret).
    let password = dbops_shared::postgres::generate_password();
    let mut status = saga.status();
    if !status.target_touched {
        // Written before the first statement that changes the target.
        status.target_touched = true;
        saga.save(status).await?;
    }
    if found.role.is_none() {
        sql::create_role(&mut t, &role, &password, &mark).await?;
    }
    match &found.database {
        None => {
            sql::create_database(&t, &database, &role, db.spec.connection_limit).await?;
            sql::mark_database(&t, &database, &mark).await?;
        }
        Some(d) if d.comment.is_none() => sql::mark_database(&t, &database, &mark).await?,
        Some(_) => {}
    }
    drop(t);

    let s = session(saga, &source, &database).await?;
    let extensions = sql::installed_extensions(&s).await?;
    drop(s);
    if !extensions.is_empty() {
        let t = session(saga, &target, &database).await?;
        let there = sql::installed_extensions(&t).await?;
        let missing: Vec<String> = extensions
            .iter()
            .filter(|e| !there.contains(e))
            .cloned()
            .collect();
        // Preflight checked that the target allows and offers each of them.
        for extension in extensions::available(&t, &missing).await? {
            extensions::create(&t, &extension).await?;
        }
    }
    Ok(StepOutcome::Done(format!(
        "role {role} and database {database} on {} (marked {mark:?}); extensions {extensions:?}",
        at(&target)
    )))
}

pub async fn clean_target(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    if !saga.status().target_touched {
        return Ok("nothing was created on the target".into());
    }
    let target = target_server(saga).await?;
    let uid = database_uid(saga)?;
    let muid = migration_uid(saga);
    let (database, role) = names(saga, db)?;
    let t = session(saga, &target, "postgres").await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    let dropped = sql::drop_marked(&t, &database, &role, &[], ours).await?;
    let mut done = dropped.describe(&database, &role, "not created by this Migration");
    if done.is_empty() {
        done.push("nothing of this Migration's is left".into());
    }
    Ok(format!("on {}: {}", at(&target), done.join(", ")))
}
