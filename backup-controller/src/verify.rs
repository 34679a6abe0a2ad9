//! `spec.verify`: a completed Backup's artifact restored into a scratch database on the
//! verification server and checked against what its dump saw.
//!
//! 1. Refused before anything is made (result Error, `VerificationUnavailable` and the
//!    like): no `--verify-server`, a server that admits tenants (its
//!    `allowedNamespaces` set: a scratch database there would sit beside theirs), an
//!    artifact over `--verify-max-bytes`, no identity for an encrypted artifact, or a
//!    manifest without the dump's inventory.
//! 2. On the server, as its admin: a login role and a database, both named
//!    `dbops-verify-<Backup UID>` (a `-` no tenant's database or role name may hold:
//!    theirs are `^[a-z_][a-z0-9_]*$`), the database closed to PUBLIC; whatever an
//!    interrupted verification left under those names is dropped first.
//! 3. `pg_restore --single-transaction --exit-on-error --no-owner --no-privileges`
//!    connected as that throwaway role (never as the admin: what the dump holds, tenant
//!    code included, runs with the throwaway role's rights only), fed the artifact read
//!    back from the store, decrypted on the way; the SHA-256 of the bytes read must be
//!    the Backup's checksum.
//! 4. The restored copy's inventory, as the throwaway role, compared with the manifest's
//!    (row counts first, then objects and extensions).
//! 5. The database and the role are dropped, whatever happened; steps 2 to 4 are bounded
//!    by `--verify-timeout`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use dbops_api::reasons::BackupReason;
use dbops_api::{Backup, VerificationResult};
use dbops_shared::artifact_copy::{WhenRefused, copy_artifact};
use dbops_shared::pg_tools::{self, Connection};
use dbops_shared::postgres::{Credentials, Session, ddl, generate_password};
use dbops_shared::sealing::{self, Identities};
use dbops_shared::server::Resolved;
use kube::ResourceExt;

use crate::dump::object_key;
use crate::inventory::{self, Difference, Inventory};
use crate::state::State;
pub use crate::status::Outcome;

/// How long dropping the scratch database and role may take after a verification.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a verification did not pass: the result and reason it reports.
struct Verdict {
    result: VerificationResult,
    reason: BackupReason,
    message: String,
}

fn error(reason: BackupReason, message: impl Into<String>) -> Verdict {
    Verdict {
        result: VerificationResult::Error,
        reason,
        message: message.into(),
    }
}

fn failed(reason: BackupReason, message: impl Into<String>) -> Verdict {
    Verdict {
        result: VerificationResult::Failed,
        reason,
        message: message.into(),
    }
}

/// Verifies `backup` (Completed) as the module says.
pub async fn verify(backup: &Backup, state: &State) -> Outcome {
    let started = Instant::now();
    let server = state.verification.server.clone();
    let checked = match prepare(backup, state).await {
        Ok(prepared) => {
            let ran = tokio::time::timeout(
                state.verification.timeout,
                restore_and_compare(backup, state, &prepared),
            )
            .await;
            cleanup(state, &prepared).await;
            match ran {
                Ok(ran) => ran,
                Err(_) => Err(error(
                    BackupReason::VerificationTimedOut,
                    format!(
                        "the verification took longer than --verify-timeout ({}s); the scratch database was dropped",
                        state.verification.timeout.as_secs()
                    ),
                )),
            }
        }
        Err(verdict) => Err(verdict),
    };
    let took = started.elapsed();
    match checked {
        Ok((dumped, server)) => Outcome {
            result: VerificationResult::Passed,
            reason: BackupReason::VerificationPassed,
            message: format!(
                "restored on DatabaseServer {server} in {:.1}s: {} tables with {} rows as in the dump's snapshot, the same {} objects and extensions [{}]",
                took.as_secs_f64(),
                dumped.tables.len(),
                dumped.rows(),
                dumped.objects.values().sum::<i64>(),
                dumped.extensions.join(", ")
            ),
            server: Some(server),
            tables: i64::try_from(dumped.tables.len()).ok(),
            rows: Some(dumped.rows()),
            took,
        },
        Err(Verdict {
            result,
            reason,
            message,
        }) => Outcome {
            result,
            reason,
            message,
            server,
            tables: None,
            rows: None,
            took,
        },
    }
}

/// What step 1 gathered: the server, the key to open the artifact, the dump's inventory,
/// the scratch names.
struct Prepared {
    resolved: Resolved,
    identities: Option<Identities>,
    dumped: Inventory,
    pg_dump_major: Option<u32>,
    scratch: String,
    mark: String,
}

/// Step 1: everything checked that can be without touching the server.
async fn prepare(backup: &Backup, state: &State) -> Result<Prepared, Verdict> {
    let unavailable = |m: String| error(BackupReason::VerificationUnavailable, m);
    let Some(server) = &state.verification.server else {
        return Err(unavailable(
            "the backup-controller has no verification server (--verify-server)".into(),
        ));
    };
    let status = backup.status.clone().unwrap_or_default();
    let size = u64::try_from(status.size_bytes.unwrap_or(0)).unwrap_or(0);
    if size > state.verification.max_bytes {
        return Err(error(
            BackupReason::VerificationTooLarge,
            format!(
                "the artifact has {size} bytes, more than --verify-max-bytes ({})",
                state.verification.max_bytes
            ),
        ));
    }
    state
        .directory
        .synced()
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let resolved = state
        .directory
        .resolve(server)
        .map_err(|e| unavailable(format!("verification server {server}: {e}")))?;
    if resolved.server.spec.allowed_namespaces.is_some() {
        return Err(unavailable(format!(
            "verification server {server} admits tenants' Databases (spec.allowedNamespaces); a scratch database must not sit beside theirs: name a server that admits none"
        )));
    }
    let key = object_key(backup);
    let manifest = state
        .store
        .get_manifest(&key)
        .await
        .map_err(|e| unavailable(format!("reading the manifest: {e}")))?;
    let manifest: serde_json::Value = serde_json::from_slice(&manifest)
        .map_err(|e| unavailable(format!("the manifest is not JSON: {e}")))?;
    let checksum = status.checksum.clone().unwrap_or_default();
    if manifest.get("checksum").and_then(|c| c.as_str()) != Some(checksum.as_str()) {
        return Err(failed(
            BackupReason::VerificationChecksumMismatch,
            format!("the manifest's checksum is not the Backup's ({checksum})"),
        ));
    }
    let identities = match status.encryption {
        Some(_) => Some(identities(state).map_err(unavailable)?),
        None => None,
    };
    let dumped = dumped_inventory(&manifest, identities.as_ref()).map_err(unavailable)?;
    let uid = backup.uid().unwrap_or_default();
    Ok(Prepared {
        resolved,
        identities,
        dumped,
        pg_dump_major: manifest
            .get("pgDumpVersion")
            .and_then(|v| v.as_str())
            .and_then(pg_tools::ClientVersion::parse)
            .map(|v| v.major),
        scratch: format!("dbops-verify-{uid}"),
        mark: format!(
            "dbops verification of Backup {}/{} ({uid})",
            backup.namespace().unwrap_or_default(),
            backup.name_any()
        ),
    })
}

/// `--backup-identities-secret`'s identities.
fn identities(state: &State) -> Result<Identities, String> {
    let Some(name) = &state.verification.identities_secret else {
        return Err(
            "the artifact is encrypted and the backup-controller has no identities to open it (--backup-identities-secret)".into(),
        );
    };
    let secret = state.directory.secret(name);
    sealing::keys_from(
        secret.as_deref(),
        name,
        sealing::IDENTITIES_KEY,
        Identities::parse,
    )
}

/// The inventory the dump took, from the manifest (its sealed part when encrypted).
fn dumped_inventory(
    manifest: &serde_json::Value,
    identities: Option<&Identities>,
) -> Result<Inventory, String> {
    let opened;
    let holder = match (identities, manifest.get("sealed").and_then(|s| s.as_str())) {
        (Some(identities), Some(sealed)) => {
            let plain = identities
                .open_armored(sealed)
                .map_err(|e| format!("opening the manifest's sealed part: {e}"))?;
            opened = serde_json::from_slice::<serde_json::Value>(&plain)
                .map_err(|e| format!("the manifest's sealed part is not JSON: {e}"))?;
            &opened
        }
        _ => manifest,
    };
    let Some(inventory) = holder.get("inventory") else {
        return Err("the manifest holds no inventory of the dump (a Backup made before dbops took one): it cannot be verified".into());
    };
    if let Some(why) = inventory.get("error").and_then(|e| e.as_str()) {
        return Err(format!("the dump took no inventory: {why}"));
    }
    serde_json::from_value(inventory.clone())
        .map_err(|e| format!("the manifest's inventory is unreadable: {e}"))
}

/// Steps 2 to 4: the scratch role and database, the restore as that role, the restored
/// copy's inventory compared; the dump's inventory and the server's name when they match.
async fn restore_and_compare(
    backup: &Backup,
    state: &State,
    prepared: &Prepared,
) -> Result<(Inventory, String), Verdict> {
    let server = prepared.resolved.name.clone();
    let admin_failed = |e: dbops_shared::postgres::PgError| {
        error(
            BackupReason::VerificationUnavailable,
            format!("verification server {server}: {e}"),
        )
    };
    let resolved = &prepared.resolved;
    let mut admin = state
        .servers
        .connect(&resolved.endpoint, &resolved.credentials, "postgres")
        .await
        .map_err(admin_failed)?;
    drop_scratch(&admin, &prepared.scratch)
        .await
        .map_err(admin_failed)?;
    let password = generate_password();
    ddl::create_role(&mut admin, &prepared.scratch, &password, &prepared.mark)
        .await
        .map_err(admin_failed)?;
    ddl::create_database(&admin, &prepared.scratch, &prepared.scratch, 4)
        .await
        .map_err(admin_failed)?;
    ddl::mark_database(&admin, &prepared.scratch, &prepared.mark)
        .await
        .map_err(admin_failed)?;
    let pg_restore = pick_pg_restore(&admin, state, prepared).await?;
    drop(admin);
    let scratch = Credentials {
        username: prepared.scratch.clone(),
        password,
    };
    run_pg_restore(backup, state, prepared, &pg_restore, &scratch).await?;
    let restored = restored_inventory(state, prepared, &scratch).await?;
    match prepared.dumped.compare(&restored) {
        None => Ok((prepared.dumped.clone(), server)),
        Some(d @ Difference::Rows(_)) => Err(failed(
            BackupReason::RowCountMismatch,
            format!("restored on {server}: {d}"),
        )),
        Some(d @ Difference::Objects(_)) => Err(failed(
            BackupReason::ObjectsMismatch,
            format!("restored on {server}: {d}"),
        )),
    }
}

/// Drops the scratch database and role if they exist (left by an interrupted run).
async fn drop_scratch(
    admin: &Session,
    scratch: &str,
) -> Result<(), dbops_shared::postgres::PgError> {
    ddl::drop_database(admin, scratch).await?;
    ddl::drop_role(admin, scratch).await
}

/// Step 5: the scratch database and role dropped (logged when that fails: the next
/// verification of this Backup drops them first).
async fn cleanup(state: &State, prepared: &Prepared) {
    let resolved = &prepared.resolved;
    let dropped = tokio::time::timeout(CLEANUP_TIMEOUT, async {
        let admin = state
            .servers
            .connect(&resolved.endpoint, &resolved.credentials, "postgres")
            .await?;
        drop_scratch(&admin, &prepared.scratch).await
    })
    .await;
    match dropped {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, scratch = prepared.scratch, "could not drop the verification's scratch database")
        }
        Err(_) => tracing::warn!(
            scratch = prepared.scratch,
            "dropping the verification's scratch database timed out"
        ),
    }
}

/// The pg_restore that reads the archive into the verification server.
async fn pick_pg_restore(
    admin: &Session,
    state: &State,
    prepared: &Prepared,
) -> Result<std::path::PathBuf, Verdict> {
    let (num, version) = ddl::server_version(admin)
        .await
        .map_err(|e| error(BackupReason::VerificationUnavailable, e.to_string()))?;
    let restore = state
        .clients
        .pg_restore_for(prepared.pg_dump_major, num, &version);
    restore.await.map_err(|refusal| {
        error(
            BackupReason::VerificationUnavailable,
            format!("{refusal}: run the backup-controller with one (--pg-restore, --pg-bin-dir)"),
        )
    })
}

/// Step 3: pg_restore as the scratch role, fed the artifact from the store.
async fn run_pg_restore(
    backup: &Backup,
    state: &State,
    prepared: &Prepared,
    pg_restore: &std::path::Path,
    scratch: &Credentials,
) -> Result<(), Verdict> {
    let unavailable = |m: String| error(BackupReason::VerificationUnavailable, m);
    let program = pg_restore.display().to_string();
    let (mut command, _root_cert) = pg_tools::command(
        pg_restore,
        &Connection::of(
            &prepared.resolved.endpoint,
            scratch,
            &prepared.scratch,
            "dbops-backup-verify",
        ),
    )
    .map_err(|e| unavailable(format!("could not run {program}: {e}")))?;
    command
        .args(pg_tools::RESTORE_AS_OWNER)
        .arg("--single-transaction")
        .arg(format!("--dbname={}", prepared.scratch))
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = command
        .spawn()
        .map_err(|e| unavailable(format!("could not run {program}: {e}")))?;
    let errors = pg_tools::keep_stderr(child.stderr.take());
    let Some(stdin) = child.stdin.take() else {
        return Err(unavailable("pg_restore's stdin is not piped".into()));
    };
    let key = object_key(backup);
    let identities = prepared.identities.as_ref();
    let copied = copy_artifact(
        &state.store,
        &key,
        identities,
        stdin,
        WhenRefused::HashTheRest,
    )
    .await
    .map_err(|e| unavailable(format!("reading the artifact: {e}")))?;
    let exit = child
        .wait()
        .await
        .map_err(|e| unavailable(format!("waiting for pg_restore: {e}")))?;
    let stderr = errors.await.unwrap_or_default();
    let expected = backup
        .status
        .as_ref()
        .and_then(|s| s.checksum.clone())
        .unwrap_or_default();
    judge_copy(copied, exit, &stderr, &expected)
}

/// What the copy and pg_restore's exit say of the artifact: the bytes first (a restore
/// that failed on changed bytes is said as such: a refused copy read the rest to hash
/// it; one that did not decrypt read nothing), then the restore.
fn judge_copy(
    copied: dbops_shared::artifact_copy::Copied,
    exit: std::process::ExitStatus,
    stderr: &str,
    expected: &str,
) -> Result<(), Verdict> {
    if !copied.sha256.is_empty() && copied.sha256 != expected {
        let cut = copied
            .error
            .map(|e| format!(" (read as far as: {e})"))
            .unwrap_or_default();
        return Err(failed(
            BackupReason::VerificationChecksumMismatch,
            format!(
                "the artifact read back from the store has SHA-256 {} ({} bytes{cut}), the Backup recorded {expected}; it is not the artifact that was written",
                copied.sha256, copied.size
            ),
        ));
    }
    if !exit.success() || copied.error.is_some() {
        let copy = copied.error.map(|e| format!("; {e}")).unwrap_or_default();
        return Err(failed(
            BackupReason::VerificationRestoreFailed,
            format!("pg_restore into the scratch database failed ({exit}): {stderr}{copy}"),
        ));
    }
    Ok(())
}

/// Step 4: the restored copy's inventory, taken as the scratch role.
async fn restored_inventory(
    state: &State,
    prepared: &Prepared,
    scratch: &Credentials,
) -> Result<Inventory, Verdict> {
    let unavailable = |m: String| error(BackupReason::VerificationUnavailable, m);
    let mut session = state
        .servers
        .connect(&prepared.resolved.endpoint, scratch, &prepared.scratch)
        .await
        .map_err(|e| unavailable(format!("connecting to the scratch database: {e}")))?;
    let tx = session
        .transaction()
        .await
        .map_err(|e| unavailable(format!("counting the restored copy: {e}")))?;
    inventory::prepare(&tx, state.verification.timeout)
        .await
        .map_err(unavailable)?;
    let restored = inventory::take(&tx)
        .await
        .map_err(|e| unavailable(format!("counting the restored copy: {e}")))?;
    let _ = tx.rollback().await;
    Ok(restored)
}
