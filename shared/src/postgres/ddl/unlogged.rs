//! Statements that carry a secret (a password's verifier) run with every way the server
//! could record a statement's text turned off for them ([`execute_unlogged`]).

use crate::postgres::credentials::password_verifier;
use crate::postgres::error::PgError;
use crate::postgres::quote::{quote_ident, quote_literal};
use crate::postgres::session::Session;

/// Gives the role a new password (its SCRAM verifier), with statement logging off.
pub async fn set_password(s: &mut Session, role: &str, password: &str) -> Result<(), PgError> {
    execute_unlogged(
        s,
        Unlogged::InTransactionAfter(""),
        &password_statement(role, password),
        format!("setting the password of {role}"),
    )
    .await
}

/// `ALTER ROLE <role> PASSWORD '<SCRAM verifier>'`: the one statement that gives a role
/// its password, for [`execute_unlogged`]. The password itself is never in it.
pub fn password_statement(role: &str, password: &str) -> String {
    format!(
        "ALTER ROLE {} PASSWORD {}",
        quote_ident(role),
        quote_literal(&password_verifier(role, password))
    )
}

/// What could record a statement's text on the server, and the value that keeps it from
/// doing so: the statement log (`log_statement`), the duration logs and their samples, the
/// statement quoted under an error (`log_min_error_statement`), and `pg_stat_statements`'
/// utility statements (where the module is loaded: otherwise the setting does not exist
/// and is left alone).
pub const STATEMENT_RECORDING: &[(&str, &str)] = &[
    ("log_statement", "none"),
    ("log_min_duration_statement", "-1"),
    ("log_min_duration_sample", "-1"),
    ("log_transaction_sample_rate", "0"),
    ("log_min_error_statement", "panic"),
    ("pg_stat_statements.track_utility", "off"),
];

/// How [`execute_unlogged`] runs its statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unlogged<'a> {
    /// In one transaction, after these statements (nothing secret in them: they are logged
    /// as usual; empty for none). The settings are `SET LOCAL`: whatever becomes of the
    /// transaction (committed, failed, rolled back when the caller gives up on it half-way)
    /// they end with it, and the session goes back to the pool as it was.
    InTransactionAfter(&'a str),
    /// Alone, outside any transaction block (`CREATE SUBSCRIPTION ... create_slot` cannot
    /// run in one). The settings are `SET` for the session and `RESET` right after the
    /// statement; when the caller gives up before that, the `RESET` is queued on the
    /// connection as the future is dropped, so it reaches the server before anything a
    /// later user of the pooled session sends.
    Alone,
}

/// Runs `secret`, a statement that carries a password, a SCRAM verifier or a connection
/// string, with every setting of [`STATEMENT_RECORDING`] the session may change turned off
/// for it, then restored: neither the server's log (not even under an error) nor
/// `pg_stat_statements` keeps its text. The span records it with its literals masked, and a
/// failure keeps the server's message, never the statement.
///
/// Best effort: a superuser changes them all; another admin those it was granted
/// (`GRANT SET ON PARAMETER`, PostgreSQL 15+) and none before 15, and the statement runs
/// anyway, which is why passwords are only ever sent as verifiers where a verifier will do.
/// One query first reads which settings exist and may be changed, so nothing fails (and
/// nothing is logged as an error) on the way.
pub async fn execute_unlogged(
    s: &mut Session,
    how: Unlogged<'_>,
    secret: &str,
    doing: String,
) -> Result<(), PgError> {
    let settings = changeable_recording_settings(s)
        .await
        .map_err(PgError::sql(format!(
            "{doing}: reading the logging settings"
        )))?;
    match how {
        Unlogged::InTransactionAfter(logged) => {
            let tx = s
                .transaction()
                .await
                .map_err(PgError::sql(format!("{doing}: BEGIN")))?;
            if !logged.is_empty() {
                tx.batch_execute(logged)
                    .await
                    .map_err(PgError::sql(doing.clone()))?;
            }
            // Its own message: the server decides whether to log a message before it runs
            // any of it, so the settings must be in force before `secret` arrives.
            if let Some(set) = set_statements("SET LOCAL", &settings) {
                tx.batch_execute(&set).await.map_err(PgError::sql(format!(
                    "{doing}: turning statement logging off"
                )))?;
            }
            tx.batch_execute(secret)
                .await
                .map_err(PgError::sql(doing.clone()))?;
            tx.commit()
                .await
                .map_err(PgError::sql(format!("{doing}: COMMIT")))
        }
        Unlogged::Alone => {
            let Some(set) = set_statements("SET", &settings) else {
                return s.batch_execute(secret).await.map_err(PgError::sql(doing));
            };
            let reset = settings
                .iter()
                .map(|(name, _)| format!("RESET {name}"))
                .collect::<Vec<_>>()
                .join("; ");
            // From here on, however this ends, the RESET reaches the server.
            let mut pending = ResetOnDrop {
                client: s,
                reset: Some(reset),
            };
            let done = match pending.client.batch_execute(&set).await {
                Ok(()) => pending
                    .client
                    .batch_execute(secret)
                    .await
                    .map_err(PgError::sql(doing.clone())),
                Err(e) => Err(PgError::sql(format!(
                    "{doing}: turning statement logging off"
                ))(e)),
            };
            let reset = pending.reset.take().unwrap_or_default();
            // Fails only with the connection, which then never goes back to the pool.
            let restored = pending.client.batch_execute(&reset).await;
            done?;
            restored.map_err(PgError::sql(format!(
                "{doing}: restoring statement logging"
            )))
        }
    }
}

/// Of [`STATEMENT_RECORDING`], the settings the server has (pg_stat_statements' only
/// where it is loaded) and this session may change, with the value that turns each off.
pub(super) async fn changeable_recording_settings(
    s: &Session,
) -> Result<Vec<(&'static str, &'static str)>, tokio_postgres::Error> {
    let names: Vec<&str> = STATEMENT_RECORDING.iter().map(|(name, _)| *name).collect();
    let rows = s
        .query(
            "SELECT s.name::text, \
                    (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user), \
                    pg_catalog.current_setting('server_version_num')::int \
               FROM pg_catalog.pg_settings s WHERE s.name = ANY($1::text[])",
            &[&names],
        )
        .await?;
    let superuser = rows
        .first()
        .is_some_and(|r| r.get::<_, Option<bool>>(1) == Some(true));
    let version: i32 = rows.first().map_or(0, |r| r.get(2));
    let mut existing: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    if !superuser {
        existing = if version >= 150000 {
            // GRANT SET ON PARAMETER (PostgreSQL 15+): only what was granted.
            s.query(
                "SELECT n FROM pg_catalog.unnest($1::text[]) AS n \
                  WHERE pg_catalog.has_parameter_privilege(n, 'SET')",
                &[&existing],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect()
        } else {
            Vec::new()
        };
    }
    Ok(STATEMENT_RECORDING
        .iter()
        .copied()
        .filter(|(name, _)| existing.iter().any(|e| e == name))
        .collect())
}

/// `SET name = value; ...` (or `SET LOCAL`) of the settings; `None` for none.
pub(super) fn set_statements(set: &str, settings: &[(&str, &str)]) -> Option<String> {
    (!settings.is_empty()).then(|| {
        settings
            .iter()
            .map(|(name, value)| format!("{set} {name} = {}", quote_literal(value)))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// The session of an [`Unlogged::Alone`] statement while its settings are changed: dropped
/// with the `RESET` still to send (the caller's future dropped half-way), it queues the
/// `RESET` on the connection without waiting for the answer, so the session never serves
/// anyone with statement logging off.
struct ResetOnDrop<'a> {
    client: &'a Session,
    reset: Option<String>,
}

impl Drop for ResetOnDrop<'_> {
    fn drop(&mut self) {
        let Some(reset) = self.reset.take() else {
            return;
        };
        // tokio-postgres hands a request to its connection on the future's first poll.
        let client: &tokio_postgres::Client = self.client;
        let queued = std::pin::pin!(client.batch_execute(&reset));
        let _ = std::future::Future::poll(
            queued,
            &mut std::task::Context::from_waker(std::task::Waker::noop()),
        );
    }
}
