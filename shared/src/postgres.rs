//! PostgreSQL access shared by the controllers: admin credentials from a Secret,
//! connections per `ServerSpec`, identifier and literal quoting, a per-server limit on
//! concurrent sessions and a per-server circuit breaker, and errors sorted into what
//! the user must fix and what a retry may cure.
//!
//! Passwords never travel as plain text in SQL: [`password_verifier`] turns them into a
//! SCRAM-SHA-256 verifier before `CREATE/ALTER ROLE ... PASSWORD`, the same as psql's
//! `\password`, so neither the server log nor a trace can show them.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{ServerSpec, SslMode};
use k8s_openapi::api::core::v1::Secret;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

/// Which server: host and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerKey {
    pub host: String,
    pub port: u16,
}

impl ServerKey {
    pub fn of(server: &ServerSpec) -> Self {
        Self {
            host: server.host.clone(),
            port: u16::try_from(server.port).unwrap_or(5432),
        }
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
    #[error("server {server} is failing; not contacted again until {retry_in:?} from now")]
    CircuitOpen {
        server: ServerKey,
        retry_in: Duration,
    },
    #[error("sslMode {0} needs TLS, which this build does not support yet")]
    UnsupportedSslMode(&'static str),
    #[error("{context}: {source}")]
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
            PgError::UnsupportedSslMode(_) => "UnsupportedSslMode",
            PgError::Sql { .. } => "SqlError",
        }
    }

    /// Whether the server could not be reached at all (counts against the breaker).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            PgError::Unreachable { .. } | PgError::CircuitOpen { .. }
        )
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

/// Which role on which database a pooled session belongs to (the password as a hash:
/// a changed admin password never reuses an old session).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolKey {
    user: String,
    password_hash: u64,
    dbname: String,
}

impl PoolKey {
    fn new(credentials: &Credentials, dbname: &str) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        credentials.password.hash(&mut h);
        Self {
            user: credentials.username.clone(),
            password_hash: h.finish(),
            dbname: dbname.to_string(),
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
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Closed while the server answers; open (no attempts) for a while after
/// `failure_threshold` consecutive connection failures; then one trial (half-open).
#[derive(Debug, Default)]
struct Breaker {
    consecutive_failures: u32,
    open_until: Option<Instant>,
}

/// A session on a server: the client and the permit that counts it. Dropped, a healthy
/// session goes back to its server's pool.
pub struct Session {
    client: Option<Client>,
    key: PoolKey,
    state: Arc<ServerState>,
    _permit: OwnedSemaphorePermit,
}

impl Session {
    /// The client, for transactions.
    pub fn client_mut(&mut self) -> &mut Client {
        self.client
            .as_mut()
            .unwrap_or_else(|| unreachable!("the client is taken only on drop"))
    }
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
            inner: Mutex::new(HashMap::new()),
        }
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

    /// Whether the breaker of `key` is open now, and for how much longer.
    pub fn circuit_open(&self, key: &ServerKey) -> Option<Duration> {
        let state = self.state(key);
        let breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
        breaker
            .open_until
            .and_then(|until| until.checked_duration_since(Instant::now()))
    }

    /// Connects as `credentials` to database `dbname` on `server`, waiting for a session
    /// slot; refuses at once while the server's breaker is open.
    pub async fn connect(
        &self,
        server: &ServerSpec,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Session, PgError> {
        let key = ServerKey::of(server);
        if let Some(retry_in) = self.circuit_open(&key) {
            return Err(PgError::CircuitOpen {
                server: key,
                retry_in,
            });
        }
        let state = self.state(&key);
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
        let pool_key = PoolKey::new(credentials, dbname);
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
                state,
                _permit: permit,
            });
        }
        let result = self.connect_now(&key, server, credentials, dbname).await;
        let mut breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
        match &result {
            Err(e) if e.is_unreachable() => {
                breaker.consecutive_failures += 1;
                if breaker.consecutive_failures >= self.failure_threshold {
                    breaker.open_until = Some(Instant::now() + self.open_for);
                }
            }
            _ => {
                breaker.consecutive_failures = 0;
                breaker.open_until = None;
            }
        }
        drop(breaker);
        result.map(|client| Session {
            client: Some(client),
            key: pool_key,
            state: state.clone(),
            _permit: permit,
        })
    }

    async fn connect_now(
        &self,
        key: &ServerKey,
        server: &ServerSpec,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Client, PgError> {
        let ssl_mode = match server.ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            other @ (SslMode::Require | SslMode::VerifyFull) => {
                return Err(PgError::UnsupportedSslMode(other.as_str()));
            }
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
            .connect_timeout(self.connect_timeout);
        let connecting = config.connect(NoTls);
        let (client, connection) = tokio::time::timeout(self.connect_timeout, connecting)
            .await
            .map_err(|_| PgError::Unreachable {
                server: key.clone(),
                message: format!("no answer within {:?}", self.connect_timeout),
            })?
            .map_err(|e| {
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
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "PostgreSQL connection ended");
            }
        });
        Ok(client)
    }
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

    #[tokio::test]
    async fn the_breaker_opens_after_repeated_connection_failures() {
        // Port 1 on loopback refuses at once: a real, immediate connection failure.
        let servers = Servers::new(2, 3, Duration::from_secs(60));
        let server: ServerSpec = serde_json::from_value(serde_json::json!({
            "host": "127.0.0.1", "port": 1, "adminSecretRef": {"name": "x"}, "sslMode": "disable"
        }))
        .unwrap();
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
    }
}
