//! [`PgError`]: what went wrong talking to a server, sorted by what fixes it (the user, or
//! a retry), and the condition reason each error is shown as.

use std::time::Duration;

use dbops_api::SharedReason;
use tokio_postgres::error::SqlState;

use super::endpoint::ServerKey;
use super::tls;

/// What went wrong talking to a server, sorted by what fixes it.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("server {server} is unreachable: {message}")]
    Unreachable { server: ServerKey, message: String },
    #[error("authentication as {user} failed on {server}")]
    AuthenticationFailed { server: ServerKey, user: String },
    /// The breaker is open: no attempt was made. Shown exactly as the failure that opened
    /// it, so a status written during an outage does not change with every retry.
    #[error("server {server} is unreachable: {last_error}")]
    CircuitOpen {
        server: ServerKey,
        retry_in: Duration,
        last_error: String,
    },
    #[error("TLS to {server} failed: {}: {message}", failure.explain())]
    Tls {
        server: ServerKey,
        failure: tls::TlsFailure,
        message: String,
    },
    #[error("{context}: {}", sql_message(source))]
    Sql {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

impl PgError {
    /// The condition reason for this error.
    pub fn reason(&self) -> SharedReason {
        match self {
            PgError::Unreachable { .. } | PgError::CircuitOpen { .. } => {
                SharedReason::ServerUnreachable
            }
            PgError::AuthenticationFailed { .. } => SharedReason::AuthenticationFailed,
            PgError::Tls { failure, .. } => failure.reason(),
            PgError::Sql { source, .. } if source.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                SharedReason::LockTimeout
            }
            PgError::Sql { source, .. } if source.code() == Some(&SqlState::QUERY_CANCELED) => {
                SharedReason::StatementTimeout
            }
            // The admin is not allowed what it tried: no retry makes it so (an admin that is
            // not a superuser, on a managed server).
            PgError::Sql { source, .. }
                if source.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) =>
            {
                SharedReason::AdminLacksPrivilege
            }
            PgError::Sql { .. } => SharedReason::SqlError,
        }
    }

    /// A SQL error with what was being done.
    pub fn sql(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> PgError {
        let context = context.into();
        move |source| classify(None, None, context, source)
    }
}

pub(super) fn classify(
    server: Option<&ServerKey>,
    user: Option<&str>,
    context: String,
    source: tokio_postgres::Error,
) -> PgError {
    let code = source.code();
    if code == Some(&SqlState::INVALID_PASSWORD)
        || code == Some(&SqlState::INVALID_AUTHORIZATION_SPECIFICATION)
    {
        return PgError::AuthenticationFailed {
            server: server.cloned().unwrap_or(ServerKey {
                host: String::new(),
                port: 0,
            }),
            user: user.unwrap_or_default().to_string(),
        };
    }
    let lost = source.is_closed()
        || code == Some(&SqlState::ADMIN_SHUTDOWN)
        || code == Some(&SqlState::CANNOT_CONNECT_NOW)
        || code == Some(&SqlState::CRASH_SHUTDOWN)
        || code == Some(&SqlState::TOO_MANY_CONNECTIONS)
        || (code.is_none() && std::error::Error::source(&source).is_some());
    match (server, lost) {
        (Some(server), true) => PgError::Unreachable {
            server: server.clone(),
            message: error_chain(&source),
        },
        _ => PgError::Sql { context, source },
    }
}

/// What the server said (`ERROR: <message>`, never the DETAIL, which may quote values),
/// or the client's own error chain: tokio-postgres shows a server error as "db error".
fn sql_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        ),
        None => error_chain(e),
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}
