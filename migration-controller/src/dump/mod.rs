//! The Dump mode's own step, CopyData: `pg_dump` of the frozen source piped into
//! `pg_restore` on the target, in one transaction ([`pipe`]), with the programs that suit
//! both servers ([`programs`]). Its other steps are the ones both modes run (`steps`).
//! The Logical mode's schema copy uses the same pipe.

pub mod pipe;
pub mod programs;

use dbops_api::Database;
use dbops_shared::pg_tools;
use dbops_shared::server::Resolved;

use crate::context::{Saga, StepOutcome};
use crate::error::Result;
use crate::servers::{at, session, source_server, target_server};
use crate::sql;
use pipe::{Contents, Programs, Side};
use programs::copy_programs;

/// CopyData: the whole database, unless the target database has objects already (the
/// restore is one transaction: a crash leaves none).
pub async fn copy_data(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let source = source_server(saga).await?;
    let target = target_server(saga).await?;
    let database = db.database_name();
    let t = session(saga, &target, &database).await?;
    let already = sql::user_objects(&t).await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    drop(t);
    if already > 0 {
        return Ok(StepOutcome::Done(format!(
            "already copied: {already} objects in the target database (the restore is one transaction)"
        )));
    }
    let s = session(saga, &source, &database).await?;
    let (source_num, source_version) = sql::server_version(&s).await?;
    drop(s);
    let (pg_dump, pg_restore) = copy_programs(
        saga,
        (source_num, &source_version),
        (target_num, &target_version),
        true,
    )
    .await?;
    let started = std::time::Instant::now();
    copy_between(
        (&pg_dump, &pg_restore),
        (&source, &target),
        &database,
        &db.owner_role(),
        Contents::Everything,
    )
    .await?;
    Ok(StepOutcome::Done(format!(
        "pg_dump {} of {database} on {} restored by pg_restore {} into {} in {:.1}s, owned by {}",
        pg_dump.version.version,
        at(&source),
        pg_restore.version.version,
        at(&target),
        started.elapsed().as_secs_f64(),
        db.owner_role()
    )))
}

/// Streams `database` of `source` into the database of that name on `target`, owned by
/// `owner`, with `pg_dump` and `pg_restore`.
pub async fn copy_between(
    (pg_dump, pg_restore): (&pg_tools::Program, &pg_tools::Program),
    (source, target): (&Resolved, &Resolved),
    database: &str,
    owner: &str,
    contents: Contents,
) -> Result<()> {
    fn side<'a>(server: &'a Resolved, database: &'a str) -> Side<'a> {
        Side {
            server: &server.endpoint,
            credentials: &server.credentials,
            database,
        }
    }
    let programs = Programs {
        pg_dump: &pg_dump.path,
        pg_restore: &pg_restore.path,
    };
    pipe::copy(
        &programs,
        &side(source, database),
        &side(target, database),
        owner,
        contents,
    )
    .await?;
    Ok(())
}
