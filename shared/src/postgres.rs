//! PostgreSQL access shared by the controllers: admin credentials from a Secret,
//! connections to an [`Endpoint`] (host, port, TLS), identifier and literal quoting, a per-server limit on
//! concurrent sessions and a per-server circuit breaker, and errors sorted into what
//! the user must fix and what a retry may cure.
//!
//! Passwords never travel as plain text in SQL: [`password_verifier`] turns them into a
//! SCRAM-SHA-256 verifier before `CREATE/ALTER ROLE ... PASSWORD`, the same as psql's
//! `\password`, so neither the server log nor a trace can show them.
//!
//! Every admin session starts with `search_path` pinned to [`ADMIN_SEARCH_PATH`]
//! (`pg_catalog, pg_temp`), in its startup packet, before any statement: no schema a
//! tenant can write is ever searched, so an unqualified function, operator, type or
//! table name in the controllers' SQL always means the system's, and a tenant's
//! `public.lower(varchar)` or `public.=` can never be picked instead (the class of bug
//! CloudNativePG fixed for database owners reaching superuser). `pg_temp` comes last
//! explicitly, so even the session's own temporary objects cannot shadow a system one.
//!
//! Every statement sent through a [`Session`] (or a [`Transaction`] of one) is a
//! `sql` span (`db.statement` with the text, never the parameters; string literals
//! masked in any statement that mentions a password) and one
//! `dbops_external_requests_total{target="postgres"}`, as is every new connection.
//! [`Session::client_mut`] is the untraced way around.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::TlsMode;
use k8s_openapi::api::core::v1::Secret;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row};
use tracing::{Instrument, field};

use crate::metrics::{Target, record_external_request};

pub mod ddl;
pub mod extensions;
pub mod tls;

/// Which server: host and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerKey {
    pub host: String,
    pub port: u16,
}

/// Where and how the controllers reach a server: its address and its TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub key: ServerKey,
    pub tls: TlsSettings,
}

impl Endpoint {
    /// `host:port` with `mode` and the system's roots (no CA of the server's own).
    pub fn new(host: impl Into<String>, port: u16, mode: TlsMode) -> Self {
        Self {
            key: ServerKey {
                host: host.into(),
                port,
            },
            tls: TlsSettings { mode, ca: None },
        }
    }
}

/// The TLS mode of a server and the CA its certificate must chain to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: TlsMode,
    /// The server's own CA (`ca.crt` of its CA Secret); the system's roots when `None`.
    pub ca: Option<CaBundle>,
}

/// A PEM CA bundle, checked to hold at least one usable certificate.
#[derive(Clone)]
pub struct CaBundle {
    pem: Arc<[u8]>,
    roots: Arc<rustls::RootCertStore>,
}

impl CaBundle {
    /// Parses `pem`; refuses data without a usable certificate.
    pub fn from_pem(pem: &[u8]) -> Result<Self, String> {
        let roots = tls::roots_from_pem(pem)?;
        Ok(Self {
            pem: Arc::from(pem),
            roots,
        })
    }

    /// The PEM bytes (for `ca.crt` in a connection Secret and for pg_dump's root file).
    pub fn pem(&self) -> &[u8] {
        &self.pem
    }

    fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.pem.hash(&mut h);
        h.finish()
    }
}

impl PartialEq for CaBundle {
    fn eq(&self, other: &Self) -> bool {
        self.pem == other.pem
    }
}

impl Eq for CaBundle {}

impl fmt::Debug for CaBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaBundle")
            .field("bytes", &self.pem.len())
            .finish_non_exhaustive()
    }
}

impl fmt::Display for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// A role name and password. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Why admin credentials could not be read from a Secret.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredentialsError {
    #[error("Secret {0} has no key {1:?}")]
    MissingKey(String, &'static str),
    #[error("Secret {0} key {1:?} is not UTF-8")]
    NotUtf8(String, &'static str),
}

impl Credentials {
    /// The keys `username` and `password` of an admin Secret.
    pub fn from_secret(secret: &Secret) -> Result<Self, CredentialsError> {
        let name = secret.metadata.name.clone().unwrap_or_default();
        let key = |k: &'static str| -> Result<String, CredentialsError> {
            let data = secret.data.as_ref().and_then(|d| d.get(k));
            let string = secret.string_data.as_ref().and_then(|d| d.get(k));
            match (data, string) {
                (_, Some(s)) => Ok(s.clone()),
                (Some(bytes), None) => String::from_utf8(bytes.0.clone())
                    .map_err(|_| CredentialsError::NotUtf8(name.clone(), k)),
                (None, None) => Err(CredentialsError::MissingKey(name.clone(), k)),
            }
        };
        let username = key("username")?;
        let password = key("password")?;
        if username.is_empty() {
            return Err(CredentialsError::MissingKey(name, "username"));
        }
        Ok(Self { username, password })
    }
}

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
    /// The CamelCase condition reason for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            PgError::Unreachable { .. } | PgError::CircuitOpen { .. } => "ServerUnreachable",
            PgError::AuthenticationFailed { .. } => "AuthenticationFailed",
            PgError::Tls { failure, .. } => failure.reason(),
            PgError::Sql { source, .. } if source.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                "LockTimeout"
            }
            PgError::Sql { source, .. } if source.code() == Some(&SqlState::QUERY_CANCELED) => {
                "StatementTimeout"
            }
            PgError::Sql { .. } => "SqlError",
        }
    }

    /// A SQL error with what was being done.
    pub fn sql(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> PgError {
        let context = context.into();
        move |source| classify(None, None, context, source)
    }
}

fn classify(
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

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// `"ident"` with embedded quotes doubled: safe for any identifier.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// `'literal'` with embedded quotes doubled (standard_conforming_strings, on since 9.1).
pub fn quote_literal(literal: &str) -> String {
    format!("'{}'", literal.replace('\'', "''"))
}

/// A SCRAM-SHA-256 verifier of `password` (random salt), for `PASSWORD '...'`.
pub fn password_verifier(password: &str) -> String {
    postgres_protocol::password::scram_sha_256(password.as_bytes())
}

/// A new random password: 32 characters from a CSPRNG.
pub fn generate_password() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}

/// Per-server state: a limit on concurrent sessions and a circuit breaker.
#[derive(Debug)]
pub struct Servers {
    max_sessions: usize,
    failure_threshold: u32,
    open_for: Duration,
    connect_timeout: Duration,
    /// `statement_timeout` and `lock_timeout` of every session (zero: none).
    statement_timeout: Duration,
    lock_timeout: Duration,
    inner: Mutex<HashMap<ServerKey, Arc<ServerState>>>,
}

#[derive(Debug)]
struct ServerState {
    sessions: Arc<Semaphore>,
    breaker: Mutex<Breaker>,
    /// Sessions given back, for reuse by the same role on the same database; at most as
    /// many as the session limit, so idle plus busy never exceed twice that.
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
}

/// Which role on which database, over which kind of TLS, a pooled session belongs to (the
/// password as a hash: a changed admin password never reuses an old session; a session
/// set up with less verification, or another CA, never serves a stricter mode).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolKey {
    user: String,
    password_hash: u64,
    dbname: String,
    ssl_mode: TlsMode,
    ca: Option<u64>,
}

impl PoolKey {
    fn new(credentials: &Credentials, dbname: &str, tls: &TlsSettings) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        credentials.password.hash(&mut h);
        Self {
            user: credentials.username.clone(),
            password_hash: h.finish(),
            dbname: dbname.to_string(),
            ssl_mode: tls.mode,
            ca: tls.ca.as_ref().map(CaBundle::fingerprint),
        }
    }
}

struct Idle {
    key: PoolKey,
    client: Client,
    since: Instant,
}

impl fmt::Debug for Idle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idle")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// How long a session may wait in the pool before it is closed.
/// The `search_path` of every admin session (see the module's documentation).
pub const ADMIN_SEARCH_PATH: &str = "pg_catalog,pg_temp";

const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Closed while the server answers; open (no attempts) for `open_for` after
/// `failure_threshold` consecutive connection failures; then half-open: one trial
/// connection while every other caller is still refused; its success closes the breaker,
/// its failure opens it again for `open_for`.
#[derive(Debug, Default)]
struct Breaker {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    /// A half-open trial is under way.
    trial: bool,
    /// What the last failure said (shown while open).
    last_error: String,
}

/// A half-open trial that has not recorded its outcome yet: dropped so (a pooled session
/// reused, the caller cancelled), the trial is given back for the next caller.
struct TrialGuard {
    state: Option<Arc<ServerState>>,
}

impl Drop for TrialGuard {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            let mut breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
            breaker.trial = false;
        }
    }
}

/// What the breaker lets a caller do now.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    /// Closed: go ahead.
    Go,
    /// Half-open: go ahead as the one trial.
    Trial,
    /// Open (or a trial is under way): do not connect.
    Refuse(Duration),
}

impl Breaker {
    fn admit(&mut self, now: Instant) -> Admission {
        match self.open_until {
            None => Admission::Go,
            Some(until) if until > now => Admission::Refuse(until - now),
            Some(_) if self.trial => Admission::Refuse(Duration::ZERO),
            Some(_) => {
                self.trial = true;
                Admission::Trial
            }
        }
    }

    /// Records a connection's outcome (`None`: success).
    fn record(&mut self, failure: Option<String>, threshold: u32, open_for: Duration) {
        self.trial = false;
        match failure {
            None => {
                self.consecutive_failures = 0;
                self.open_until = None;
            }
            Some(message) => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                self.last_error = message;
                if self.consecutive_failures >= threshold {
                    self.open_until = Some(Instant::now() + open_for);
                }
            }
        }
    }
}

/// A session on a server: the client and the permit that counts it. Dropped, a healthy
/// session goes back to its server's pool.
pub struct Session {
    client: Option<Client>,
    key: PoolKey,
    server: ServerKey,
    state: Arc<ServerState>,
    _permit: OwnedSemaphorePermit,
}

impl Session {
    /// The client itself: what it sends is not traced (prefer the methods of `Session`
    /// and [`Session::transaction`]).
    pub fn client_mut(&mut self) -> &mut Client {
        self.client
            .as_mut()
            .unwrap_or_else(|| unreachable!("the client is taken only on drop"))
    }

    fn on(&self) -> StatementTarget<'_> {
        StatementTarget {
            server: &self.server,
            dbname: &self.key.dbname,
        }
    }

    /// [`Client::query`], traced.
    pub async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, Client::query(self, statement, params)).await
    }

    /// [`Client::query_one`], traced.
    pub async fn query_one(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::query_one(self, statement, params),
        )
        .await
    }

    /// [`Client::query_opt`], traced.
    pub async fn query_opt(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::query_opt(self, statement, params),
        )
        .await
    }

    /// [`Client::execute`], traced.
    pub async fn execute(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::execute(self, statement, params),
        )
        .await
    }

    /// [`Client::batch_execute`], traced (one span for the whole batch).
    pub async fn batch_execute(&self, statements: &str) -> Result<(), tokio_postgres::Error> {
        traced(
            self.on(),
            statements,
            Client::batch_execute(self, statements),
        )
        .await
    }

    /// A transaction whose statements, `COMMIT` and `ROLLBACK` are traced.
    pub async fn transaction(&mut self) -> Result<Transaction<'_>, tokio_postgres::Error> {
        let server = self.server.clone();
        let dbname = self.key.dbname.clone();
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        let tx = traced(on, "BEGIN", self.client_mut().transaction()).await?;
        Ok(Transaction { tx, server, dbname })
    }
}

/// A transaction of a [`Session`]; dropped without [`Transaction::commit`], it rolls back.
pub struct Transaction<'a> {
    tx: tokio_postgres::Transaction<'a>,
    server: ServerKey,
    dbname: String,
}

impl fmt::Debug for Transaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

impl<'a> Transaction<'a> {
    fn on(&self) -> StatementTarget<'_> {
        StatementTarget {
            server: &self.server,
            dbname: &self.dbname,
        }
    }

    /// The transaction itself: what it sends is not traced.
    pub fn inner(&self) -> &tokio_postgres::Transaction<'a> {
        &self.tx
    }

    /// `Transaction::query`, traced.
    pub async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query(statement, params)).await
    }

    /// `Transaction::query_one`, traced.
    pub async fn query_one(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query_one(statement, params)).await
    }

    /// `Transaction::query_opt`, traced.
    pub async fn query_opt(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query_opt(statement, params)).await
    }

    /// `Transaction::execute`, traced.
    pub async fn execute(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.execute(statement, params)).await
    }

    /// `Transaction::batch_execute`, traced (one span for the whole batch).
    pub async fn batch_execute(&self, statements: &str) -> Result<(), tokio_postgres::Error> {
        traced(self.on(), statements, self.tx.batch_execute(statements)).await
    }

    /// `COMMIT`, traced.
    pub async fn commit(self) -> Result<(), tokio_postgres::Error> {
        let Self { tx, server, dbname } = self;
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        traced(on, "COMMIT", tx.commit()).await
    }

    /// `ROLLBACK`, traced.
    pub async fn rollback(self) -> Result<(), tokio_postgres::Error> {
        let Self { tx, server, dbname } = self;
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        traced(on, "ROLLBACK", tx.rollback()).await
    }
}

/// Where a statement is sent, for its span.
#[derive(Clone, Copy)]
struct StatementTarget<'a> {
    server: &'a ServerKey,
    dbname: &'a str,
}

/// The longest `db.statement` recorded; longer statements are cut.
const MAX_STATEMENT_CHARS: usize = 2048;

/// Runs `work` (sending `statement`) inside a `sql` span and counts it.
async fn traced<T>(
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
    let result = work.instrument(span.clone()).await;
    match &result {
        Ok(_) => record_external_request(Target::Postgres, "ok"),
        Err(error) => {
            record_external_request(Target::Postgres, "error");
            span.record("otel.status_code", "ERROR");
            let code = error.code().map_or("none", |code| code.code());
            span.record("error", code);
        }
    }
    result
}

/// What a statement does, for a span name: its first keyword, with the object type after
/// `CREATE`, `ALTER` and `DROP` (`CREATE ROLE`, `ALTER DATABASE`, `SELECT`).
pub fn statement_kind(statement: &str) -> String {
    let mut words = statement
        .split(|c: char| c.is_whitespace() || c == ';' || c == '(')
        .filter(|w| !w.is_empty());
    let first = words.next().unwrap_or("SQL").to_ascii_uppercase();
    match first.as_str() {
        "CREATE" | "ALTER" | "DROP" => match words.next() {
            Some(object) if object.chars().all(|c| c.is_ascii_alphabetic()) => {
                format!("{first} {}", object.to_ascii_uppercase())
            }
            _ => first,
        },
        _ => first,
    }
}

/// The statement as a trace may show it: unchanged unless it mentions a password (`CREATE
/// ROLE ... PASSWORD '<verifier>'`, `ALTER ROLE ... PASSWORD`, a connection string), in
/// which case every string literal becomes `'***'`; a statement whose literals cannot be
/// told apart is reduced to its kind.
pub fn redact_statement(statement: &str) -> Cow<'_, str> {
    if !statement.to_ascii_lowercase().contains("password") {
        return Cow::Borrowed(statement);
    }
    match mask_literals(statement) {
        Some(masked) => Cow::Owned(masked),
        None => Cow::Owned(format!("{} [redacted]", statement_kind(statement))),
    }
}

/// `statement` with every string literal (`'...'`, `E'...'`, `$tag$...$tag$`) replaced by
/// `'***'`; quoted identifiers are kept. `None` when a literal is not terminated.
fn mask_literals(statement: &str) -> Option<String> {
    let chars: Vec<char> = statement.chars().collect();
    let mut out = String::with_capacity(statement.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' => {
                // A quoted identifier: copied through, "" is an embedded quote.
                let start = i;
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return None,
                        Some('"') if chars.get(i + 1) == Some(&'"') => i += 2,
                        Some('"') => break,
                        Some(_) => i += 1,
                    }
                }
                out.extend(&chars[start..=i]);
                i += 1;
            }
            '\'' => {
                // E'...' takes backslash escapes; '' is an embedded quote in both forms.
                let escapes = out.ends_with(['E', 'e']);
                if escapes {
                    out.pop();
                }
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return None,
                        Some('\\') if escapes => i += 2,
                        Some('\'') if chars.get(i + 1) == Some(&'\'') => i += 2,
                        Some('\'') => break,
                        Some(_) => i += 1,
                    }
                }
                out.push_str("'***'");
                i += 1;
            }
            '$' => {
                // $tag$...$tag$ (tag empty or an identifier); anything else is a parameter.
                let tag_end = chars[i + 1..]
                    .iter()
                    .position(|c| !(c.is_alphanumeric() || *c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end {
                    Some(end) if chars[end] == '$' && !chars[i + 1].is_ascii_digit() => {
                        let tag: String = chars[i..=end].iter().collect();
                        let body: String = chars[end + 1..].iter().collect();
                        let close = body.find(&tag)?;
                        out.push_str("'***'");
                        i = end + 1 + body[..close].chars().count() + tag.chars().count();
                    }
                    _ => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    Some(out)
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

impl std::ops::Deref for Session {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.client
            .as_ref()
            .unwrap_or_else(|| unreachable!("the client is taken only on drop"))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(client) = self.client.take()
            && !client.is_closed()
        {
            let mut idle = self.state.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|i| i.since.elapsed() < IDLE_TIMEOUT && !i.client.is_closed());
            if idle.len() >= self.state.max_idle {
                idle.remove(0);
            }
            idle.push(Idle {
                key: self.key.clone(),
                client,
                since: Instant::now(),
            });
        }
    }
}

impl Servers {
    /// `max_sessions` concurrent sessions per server; the breaker opens for `open_for`
    /// after `failure_threshold` consecutive failures to connect.
    pub fn new(max_sessions: usize, failure_threshold: u32, open_for: Duration) -> Self {
        Self {
            max_sessions: max_sessions.max(1),
            failure_threshold: failure_threshold.max(1),
            open_for,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(300),
            lock_timeout: Duration::from_secs(10),
            inner: Mutex::new(HashMap::new()),
        }
    }

    /// Every session's `statement_timeout` and `lock_timeout` (set when it connects).
    pub fn with_timeouts(self, statement_timeout: Duration, lock_timeout: Duration) -> Self {
        Self {
            statement_timeout,
            lock_timeout,
            ..self
        }
    }

    /// The `lock_timeout` sessions get (for pg_dump's `--lock-wait-timeout` too).
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    fn state(&self, key: &ServerKey) -> Arc<ServerState> {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key.clone())
            .or_insert_with(|| {
                Arc::new(ServerState {
                    sessions: Arc::new(Semaphore::new(self.max_sessions)),
                    breaker: Mutex::new(Breaker::default()),
                    idle: Mutex::new(Vec::new()),
                    max_idle: self.max_sessions,
                })
            })
            .clone()
    }

    /// Connects as `credentials` to database `dbname` on `server`, waiting for a session
    /// slot; refuses at once while the server's breaker is open, and lets one caller
    /// through as the trial once it is half-open.
    pub async fn connect(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Session, PgError> {
        self.connect_as(server, credentials, dbname, false).await
    }

    /// [`Servers::connect`] for a server's health probe: tried even while the breaker is
    /// open (one probe per server and interval, not per object), and its outcome closes or
    /// opens the breaker like any other connection.
    pub async fn probe(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Session, PgError> {
        self.connect_as(server, credentials, dbname, true).await
    }

    async fn connect_as(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
        probe: bool,
    ) -> Result<Session, PgError> {
        let key = server.key.clone();
        let state = self.state(&key);
        let mut trial = TrialGuard { state: None };
        if !probe {
            let mut breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
            match breaker.admit(Instant::now()) {
                Admission::Go => {}
                // Given back if this call ends (or is cancelled) before it connects.
                Admission::Trial => trial.state = Some(state.clone()),
                Admission::Refuse(retry_in) => {
                    return Err(PgError::CircuitOpen {
                        server: key,
                        retry_in,
                        last_error: breaker.last_error.clone(),
                    });
                }
            }
        }
        let permit =
            state
                .sessions
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| PgError::Unreachable {
                    server: key.clone(),
                    message: "session limiter closed".into(),
                })?;
        let pool_key = PoolKey::new(credentials, dbname, &server.tls);
        let reused = {
            let mut idle = state.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|i| i.since.elapsed() < IDLE_TIMEOUT && !i.client.is_closed());
            idle.iter()
                .position(|i| i.key == pool_key)
                .map(|at| idle.swap_remove(at).client)
        };
        if let Some(client) = reused {
            return Ok(Session {
                client: Some(client),
                key: pool_key,
                server: key,
                state,
                _permit: permit,
            });
        }
        let span = tracing::info_span!(
            "pg.connect",
            otel.kind = "client",
            otel.status_code = field::Empty,
            db.system = "postgresql",
            db.name = dbname,
            server.address = key.host.as_str(),
            server.port = key.port,
            error = field::Empty,
        );
        let result = self
            .connect_now(&key, server, credentials, dbname)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(_) => record_external_request(Target::Postgres, "ok"),
            Err(error) => {
                record_external_request(Target::Postgres, "error");
                span.record("otel.status_code", "ERROR");
                span.record("error", error.reason());
            }
        }
        let mut breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let failure = match &result {
            Err(PgError::Unreachable { message, .. }) => Some(message.clone()),
            _ => None,
        };
        breaker.record(failure, self.failure_threshold, self.open_for);
        drop(breaker);
        trial.state = None;
        result.map(|client| Session {
            client: Some(client),
            key: pool_key,
            server: key,
            state: state.clone(),
            _permit: permit,
        })
    }

    async fn connect_now(
        &self,
        key: &ServerKey,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Client, PgError> {
        use tokio_postgres::config::SslMode;
        let (ssl_mode, verify) = match server.tls.mode {
            TlsMode::Disable => (SslMode::Disable, None),
            TlsMode::Require => (SslMode::Require, Some(tls::Verify::Nothing)),
            TlsMode::VerifyCa => (SslMode::Require, Some(tls::Verify::Chain)),
            TlsMode::VerifyFull => (SslMode::Require, Some(tls::Verify::ChainAndHost)),
        };
        let mut config = tokio_postgres::Config::new();
        config
            .host(&key.host)
            .port(key.port)
            .user(&credentials.username)
            .password(&credentials.password)
            .dbname(dbname)
            .ssl_mode(ssl_mode)
            .application_name("dbops")
            .options(format!(
                "-c statement_timeout={} -c lock_timeout={} -c search_path={ADMIN_SEARCH_PATH}",
                self.statement_timeout.as_millis(),
                self.lock_timeout.as_millis()
            ))
            .connect_timeout(self.connect_timeout);
        let timed_out = || PgError::Unreachable {
            server: key.clone(),
            message: format!("no answer within {:?}", self.connect_timeout),
        };
        let connected = match verify {
            None => connect_within(&config, NoTls, self.connect_timeout).await,
            Some(verify) => {
                let roots = server.tls.ca.as_ref().map(|ca| ca.roots.clone());
                let tls = tls::connector(verify, roots).map_err(|e| PgError::Tls {
                    server: key.clone(),
                    failure: tls::TlsFailure::CertificateNotTrusted,
                    message: e.to_string(),
                })?;
                connect_within(&config, tls, self.connect_timeout).await
            }
        };
        let client = connected.ok_or_else(timed_out)?.map_err(|e| {
            if let Some(failure) = tls::TlsFailure::of(&e) {
                return PgError::Tls {
                    server: key.clone(),
                    failure,
                    message: error_chain(&e),
                };
            }
            let e = classify(
                Some(key),
                Some(&credentials.username),
                format!("connecting to {key}"),
                e,
            );
            match e {
                // Any other failure before a session exists means no usable server.
                PgError::Sql { source, .. } => PgError::Unreachable {
                    server: key.clone(),
                    message: error_chain(&source),
                },
                e => e,
            }
        })?;
        Ok(client)
    }
}

/// Connects with `tls` within `within` (`None` when it took longer) and drives the
/// connection in the background until it ends.
async fn connect_within<T>(
    config: &tokio_postgres::Config,
    tls: T,
    within: Duration,
) -> Option<Result<Client, tokio_postgres::Error>>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    let (client, connection) = match tokio::time::timeout(within, config.connect(tls)).await {
        Err(_) => return None,
        Ok(Err(e)) => return Some(Err(e)),
        Ok(Ok(connected)) => connected,
    };
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "PostgreSQL connection ended");
        }
    });
    Some(Ok(client))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_doubles_embedded_quotes() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(
            quote_literal("x'; DROP TABLE t; --"),
            "'x''; DROP TABLE t; --'"
        );
    }

    #[test]
    fn verifiers_hide_the_password_and_differ_by_salt() {
        let a = password_verifier("s3cret");
        let b = password_verifier("s3cret");
        assert!(a.starts_with("SCRAM-SHA-256$4096:"));
        assert!(!a.contains("s3cret"));
        assert_ne!(a, b, "a random salt each time");
    }

    #[test]
    fn generated_passwords_are_long_and_distinct() {
        let a = generate_password();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, generate_password());
    }

    #[test]
    fn credentials_debug_redacts_the_password() {
        let c = Credentials {
            username: "admin".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn credentials_need_both_keys() {
        let mut secret = Secret::default();
        secret.metadata.name = Some("admin".into());
        secret.string_data = Some([("username".to_string(), "postgres".to_string())].into());
        assert_eq!(
            Credentials::from_secret(&secret),
            Err(CredentialsError::MissingKey("admin".into(), "password"))
        );
    }

    #[test]
    fn statements_with_a_password_are_recorded_without_their_literals() {
        let verifier = password_verifier("s3cret");
        let create = format!(
            "CREATE ROLE {} LOGIN PASSWORD {}; COMMENT ON ROLE {} IS {}",
            quote_ident("app\"x"),
            quote_literal(&verifier),
            quote_ident("app\"x"),
            quote_literal("dbops.dev/uid=1")
        );
        let recorded = redact_statement(&create);
        assert!(!recorded.contains(&verifier), "{recorded}");
        assert!(!recorded.contains("SCRAM"), "{recorded}");
        assert_eq!(
            recorded,
            "CREATE ROLE \"app\"\"x\" LOGIN PASSWORD '***'; COMMENT ON ROLE \"app\"\"x\" IS '***'"
        );
        let alter = "alter role r password E'it\\'s''x'";
        assert_eq!(redact_statement(alter), "alter role r password '***'");
        let dollar = "ALTER ROLE r PASSWORD $q$se'cret$q$";
        assert_eq!(redact_statement(dollar), "ALTER ROLE r PASSWORD '***'");
        assert_eq!(
            redact_statement("ALTER ROLE r PASSWORD 'unterminated"),
            "ALTER ROLE [redacted]"
        );
    }

    #[test]
    fn other_statements_are_recorded_as_written() {
        let select = "SELECT 1 FROM pg_roles WHERE rolname = $1";
        assert_eq!(redact_statement(select), select);
        assert_eq!(statement_kind(select), "SELECT");
        assert_eq!(statement_kind("  create database \"x\""), "CREATE DATABASE");
        assert_eq!(statement_kind("DROP ROLE x"), "DROP ROLE");
        assert_eq!(statement_kind("COMMENT ON DATABASE x IS 'y'"), "COMMENT");
        assert_eq!(statement_kind(""), "SQL");
    }

    #[test]
    fn a_half_open_breaker_lets_one_trial_through_and_its_outcome_decides() {
        let open_for = Duration::from_secs(30);
        let mut b = Breaker::default();
        let now = Instant::now();
        assert_eq!(b.admit(now), Admission::Go);
        b.record(Some("refused".into()), 2, open_for);
        assert_eq!(b.admit(now), Admission::Go, "below the threshold");
        b.record(Some("refused".into()), 2, open_for);
        assert!(matches!(b.admit(Instant::now()), Admission::Refuse(d) if d > Duration::ZERO));
        // Once the open time has passed: one trial, every other caller still refused.
        let later = Instant::now() + open_for + Duration::from_secs(1);
        assert_eq!(b.admit(later), Admission::Trial);
        assert_eq!(b.admit(later), Admission::Refuse(Duration::ZERO));
        // The trial fails: open again for the whole period, with its message.
        b.record(Some("still refused".into()), 2, open_for);
        assert!(
            matches!(b.admit(Instant::now()), Admission::Refuse(d) if d > Duration::from_secs(29))
        );
        assert_eq!(b.last_error, "still refused");
        // The next trial succeeds: closed.
        let later = Instant::now() + open_for + Duration::from_secs(1);
        assert_eq!(b.admit(later), Admission::Trial);
        b.record(None, 2, open_for);
        assert_eq!(b.admit(Instant::now()), Admission::Go);
        assert_eq!(b.consecutive_failures, 0);
    }

    #[tokio::test]
    async fn the_breaker_opens_after_repeated_connection_failures() {
        // Port 1 on loopback refuses at once: a real, immediate connection failure.
        let servers = Servers::new(2, 3, Duration::from_secs(60));
        let server = Endpoint::new("127.0.0.1", 1, TlsMode::Disable);
        let creds = Credentials {
            username: "u".into(),
            password: "p".into(),
        };
        for _ in 0..3 {
            let e = servers
                .connect(&server, &creds, "postgres")
                .await
                .unwrap_err();
            assert!(matches!(e, PgError::Unreachable { .. }), "{e}");
        }
        let e = servers
            .connect(&server, &creds, "postgres")
            .await
            .unwrap_err();
        assert!(matches!(e, PgError::CircuitOpen { .. }), "{e}");
        assert_eq!(e.reason(), "ServerUnreachable");
        // Shown as the failure that opened it: a status written in an outage stays put.
        let again = servers
            .connect(&server, &creds, "postgres")
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), again.to_string());
        assert!(
            e.to_string()
                .starts_with("server 127.0.0.1:1 is unreachable: "),
            "{e}"
        );
        // A probe is tried anyway (and fails the same way).
        let probed = servers
            .probe(&server, &creds, "postgres")
            .await
            .unwrap_err();
        assert!(matches!(probed, PgError::Unreachable { .. }), "{probed}");
    }
}
