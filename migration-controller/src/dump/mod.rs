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
    let (database, owner) = (db.database_name(), db.owner_role());
    let copied = copy_once(
        saga,
        (&source, &target),
        &database,
        &owner,
        Contents::Everything,
    );
    Ok(StepOutcome::Done(match copied.await? {
        Copied::Already(objects) => format!(
            "already copied: {objects} objects in the target database (the restore is one transaction)"
        ),
        Copied::Now {
            pg_dump,
            pg_restore,
            seconds,
        } => format!(
            "pg_dump {} of {database} on {} restored by pg_restore {} into {} in {seconds:.1}s, owned by {owner}",
            pg_dump.version.version,
            at(&source),
            pg_restore.version.version,
            at(&target),
        ),
    }))
}

/// What [`copy_once`] did.
pub enum Copied {
    /// Nothing: the target database has this many objects already.
    Already(i64),
    /// The copy, with these programs, in this many seconds.
    Now {
        pg_dump: pg_tools::Program,
        pg_restore: pg_tools::Program,
        seconds: f64,
    },
}

/// Streams `database` (its `contents`) of `source` into the database of that name on
/// `target`, owned by `owner`, with the programs that suit both servers; nothing when the
/// target database has objects already (the restore is one transaction, so it has all).
pub async fn copy_once(
    saga: &Saga<'_>,
    (source, target): (&Resolved, &Resolved),
    database: &str,
    owner: &str,
    contents: Contents,
) -> Result<Copied> {
    let t = session(saga, target, database).await?;
    let already = sql::user_objects(&t).await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    drop(t);
    if already > 0 {
        return Ok(Copied::Already(already));
    }
    let s = session(saga, source, database).await?;
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
    let (from, to) = (side(source, database), side(target, database));
    pipe::copy(&programs, &from, &to, owner, contents).await?;
    Ok(Copied::Now {
        pg_dump,
        pg_restore,
        seconds: started.elapsed().as_secs_f64(),
    })
}
