//! Traced statements and connections: each statement a `sql` span (`db.statement` redacted
//! by [`redact_statement`](super::redact_statement)), each new connection a `pg.connect`
//! span, and each one `dbops_external_requests_total{target="postgres"}`.

use std::future::Future;

use tracing::{Instrument, field};

use super::endpoint::ServerKey;
use super::error::PgError;
use super::redact::{redact_statement, statement_kind};
use crate::metrics::{Target, observe_external_request, record_external_request};

/// Where a statement is sent, for its span.
#[derive(Clone, Copy)]
pub(super) struct StatementTarget<'a> {
    pub(super) server: &'a ServerKey,
    pub(super) dbname: &'a str,
}

/// The longest `db.statement` recorded; longer statements are cut.
const MAX_STATEMENT_CHARS: usize = 2048;

/// Runs `work` (sending `statement`) inside a `sql` span and counts it.
pub(super) async fn traced<T>(
    on: StatementTarget<'_>,
    statement: &str,
    work: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    let recorded = redact_statement(statement);
    let recorded: String = recorded.chars().take(MAX_STATEMENT_CHARS).collect();
    let span = tracing::info_span!(
        "sql",
        otel.name = %statement_kind(statement),
        otel.kind = "client",
        otel.status_code = field::Empty,
        db.system = "postgresql",
        db.name = on.dbname,
        db.statement = recorded.as_str(),
        server.address = on.server.host.as_str(),
        server.port = on.server.port,
        error = field::Empty,
    );
    timed(span, work, |error| {
        error.code().map_or("none", |code| code.code()).to_string()
    })
    .await
}

/// Runs `connect` (a new connection to `dbname` on `server`) inside a `pg.connect` span
/// and counts it.
pub(super) async fn traced_connect<T>(
    server: &ServerKey,
    dbname: &str,
    connect: impl Future<Output = Result<T, PgError>>,
) -> Result<T, PgError> {
    let span = tracing::info_span!(
        "pg.connect",
        otel.kind = "client",
        otel.status_code = field::Empty,
        db.system = "postgresql",
        db.name = dbname,
        server.address = server.host.as_str(),
        server.port = server.port,
        error = field::Empty,
    );
    timed(span, connect, |error| error.reason().to_string()).await
}

/// Runs `work` in `span`, timed and counted as one PostgreSQL request; a failure marks the
/// span with `what` of its error (the SQLSTATE, or why a connection failed).
async fn timed<T, E>(
    span: tracing::Span,
    work: impl Future<Output = Result<T, E>>,
    what: impl FnOnce(&E) -> String,
) -> Result<T, E> {
    let started = std::time::Instant::now();
    let result = work.instrument(span.clone()).await;
    observe_external_request(Target::Postgres, started.elapsed());
    match &result {
        Ok(_) => record_external_request(Target::Postgres, "ok"),
        Err(error) => {
            record_external_request(Target::Postgres, "error");
            span.record("otel.status_code", "ERROR");
            span.record("error", what(error).as_str());
        }
    }
    result
}
