//! Which pg_dump and pg_restore copy between two servers: the Dump mode's CopyData takes
//! the pair that suits both majors of every program (`--pg-bin-dir`), the Logical mode's
//! schema copy and Preflight likewise.

use dbops_api::MigrationReason;
use dbops_shared::pg_tools;

use crate::context::Saga;
use crate::error::{Error, Result, reason_of};
use crate::servers::major;

/// The pg_dump and pg_restore that copy from a server of `source` (`server_version_num`,
/// `server_version`) to one of `target` (`pg_tools::pick_copy`): of every program (`all`,
/// the Dump mode's CopyData), or of `--pg-dump` and `--pg-restore` only (the Logical
/// mode's schema copy). None fitting is fatal, naming the versions.
pub async fn copy_programs(
    saga: &Saga<'_>,
    source: (i32, &str),
    target: (i32, &str),
    all: bool,
) -> Result<(pg_tools::Program, pg_tools::Program)> {
    let state = &saga.ctx.state;
    let clients = if all {
        state.clients.clone()
    } else {
        pg_tools::Clients::new(
            Some(state.pg_dump.clone()),
            Some(state.pg_restore.clone()),
            &[],
        )
    };
    let (dumps, restores) = (clients.pg_dumps().await, clients.pg_restores().await);
    if dumps.is_empty() || restores.is_empty() {
        return Err(Error::step(
            MigrationReason::ClientProgramFailed,
            "no pg_dump or no pg_restore answered `--version` (the log says why)",
        ));
    }
    let major = |num: i32| u32::try_from(major(num)).unwrap_or(0);
    pg_tools::pick_copy(
        &dumps,
        &restores,
        (major(source.0), source.1),
        (major(target.0), target.1),
    )
    .map(|(dump, restore)| (dump.clone(), restore.clone()))
    .map_err(|refusal| refused(refusal, all))
}

/// No client programs fit: fatal (retrying cannot help), saying which flags give others.
fn refused(refusal: pg_tools::Refusal, all: bool) -> Error {
    let flags = if all {
        "--pg-dump, --pg-restore, --pg-bin-dir"
    } else {
        "--pg-dump, --pg-restore: the Logical mode's schema copy"
    };
    Error::step(
        reason_of(refusal.reason),
        format!("{refusal}: run the migration-controller with one ({flags})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::controller::{ErrorKind, ReconcileError};

    #[test]
    fn client_programs_that_cannot_copy_end_the_migration_naming_the_versions() {
        let program = |v: &str| pg_tools::Program {
            path: format!("/pg/{v}/pg_dump").into(),
            version: pg_tools::ClientVersion::parse(v).unwrap(),
        };
        let (dumps, restores) = ([program("15.14")], [program("15.14")]);
        let refusal =
            pg_tools::pick_copy(&dumps, &restores, (18, "18.4"), (18, "18.4")).unwrap_err();
        let fatal = refused(refusal, true);
        assert_eq!(fatal.kind(), ErrorKind::Permanent);
        match fatal {
            Error::Step { reason, message } => {
                assert_eq!(reason, "PgDumpTooOld");
                assert!(
                    message.contains("15.14") && message.contains("PostgreSQL 18.4"),
                    "{message}"
                );
                assert!(message.contains("--pg-bin-dir"), "{message}");
            }
            other => panic!("not fatal: {other:?}"),
        }
        let (dumps, restores) = ([program("18.6")], [program("18.6")]);
        let refusal =
            pg_tools::pick_copy(&dumps, &restores, (13, "13.23"), (16, "16.14")).unwrap_err();
        let e = refused(refusal, false);
        assert_eq!(e.reason(), "PgRestoreTooNew");
        assert!(e.to_string().contains("schema copy"), "{e}");
    }
}
