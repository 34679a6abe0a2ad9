//! The per-server pool: [`Servers`] keeps, for each server, a limit on concurrent
//! sessions, a circuit breaker and the idle sessions given back for reuse, and hands out
//! [`Session`]s through [`Servers::connect`] and [`Servers::probe`].

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::TlsMode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::Client;

use super::breaker::{Admission, Breaker};
use super::connect::Timeouts;
use super::credentials::Credentials;
use super::endpoint::{CaBundle, Endpoint, ServerKey, TlsSettings};
use super::error::PgError;
use super::trace::traced_connect;

/// Per-server state: a limit on concurrent sessions and a circuit breaker.
#[derive(Debug)]
pub struct Servers {
    max_sessions: usize,
    failure_threshold: u32,
    open_for: Duration,
    timeouts: Timeouts,
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
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

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

impl Servers {
    /// `max_sessions` concurrent sessions per server; the breaker opens for `open_for`
    /// after `failure_threshold` consecutive failures to connect.
    pub fn new(max_sessions: usize, failure_threshold: u32, open_for: Duration) -> Self {
        Self {
            max_sessions: max_sessions.max(1),
            failure_threshold: failure_threshold.max(1),
            open_for,
            timeouts: Timeouts {
                connect: Duration::from_secs(5),
                statement: Duration::from_secs(300),
                lock: Duration::from_secs(10),
            },
            inner: Mutex::new(HashMap::new()),
        }
    }

    /// Every session's `statement_timeout` and `lock_timeout` (set when it connects).
    pub fn with_timeouts(self, statement_timeout: Duration, lock_timeout: Duration) -> Self {
        Self {
            timeouts: Timeouts {
                statement: statement_timeout,
                lock: lock_timeout,
                ..self.timeouts
            },
            ..self
        }
    }

    /// The `lock_timeout` sessions get (for pg_dump's `--lock-wait-timeout` too).
    pub fn lock_timeout(&self) -> Duration {
        self.timeouts.lock
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

    /// A client for `credentials` on `dbname` at `server` and the session slot it holds:
    /// an idle one of the pool, or a new connection. Refuses at once while the server's
    /// breaker is open (unless `probe`), and lets one caller through as the trial once it
    /// is half-open.
    pub(super) async fn lease(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
        probe: bool,
    ) -> Result<Lease, PgError> {
        let key = server.key.clone();
        let state = self.state(&key);
        // Given back if this call ends (or is cancelled) before it connects.
        let trial = if probe {
            TrialGuard { state: None }
        } else {
            state.admit(&key)?
        };
        // Bounded by the caller's deadline (each reconcile's `--reconcile-timeout`):
        // dropped, the wait gives its place in the queue back.
        let waiting = Instant::now();
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
        crate::metrics::observe_queue_wait(
            crate::metrics::Queue::PostgresSession,
            waiting.elapsed(),
        );
        self.open(state, trial, permit, server, credentials, dbname)
            .await
    }

    /// [`Servers::lease`] for work that can be put off: a slot only if one is free now,
    /// `None` (nothing waited for, nothing connected) if every slot is taken. A slot is
    /// never free while callers wait in the queue (tokio's semaphore hands a returned
    /// permit to the first waiter), so this does not pass them.
    pub(super) async fn lease_if_free(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Option<Lease>, PgError> {
        let state = self.state(&server.key);
        let Ok(permit) = state.sessions.clone().try_acquire_owned() else {
            return Ok(None);
        };
        let trial = state.admit(&server.key)?;
        self.open(state, trial, permit, server, credentials, dbname)
            .await
            .map(Some)
    }

    /// The lease of a granted slot: an idle client of the pool, or a new connection
    /// (whose outcome the breaker records).
    async fn open(
        &self,
        state: Arc<ServerState>,
        mut trial: TrialGuard,
        permit: OwnedSemaphorePermit,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Lease, PgError> {
        let key = server.key.clone();
        let granted = Instant::now();
        let pool_key = PoolKey::new(credentials, dbname, &server.tls);
        let client = match state.take_idle(&pool_key) {
            Some(client) => client,
            None => {
                let connecting = self.timeouts.connect(server, credentials, dbname);
                // On the heap: a new connection (TLS, authentication) is a 14 KB future,
                // which every caller's future would otherwise carry, connecting or not.
                let result = Box::pin(traced_connect(&key, dbname, connecting)).await;
                let failure = match &result {
                    Err(PgError::Unreachable { message, .. }) => Some(message.clone()),
                    _ => None,
                };
                let mut breaker = state.breaker.lock().unwrap_or_else(|e| e.into_inner());
                breaker.record(failure, self.failure_threshold, self.open_for);
                drop(breaker);
                trial.state = None;
                result?
            }
        };
        Ok(Lease {
            client: Some(client),
            key: pool_key,
            server: key,
            state,
            _permit: permit,
            granted,
        })
    }
}

impl ServerState {
    /// What the breaker lets a caller (not a probe) do: go ahead, go ahead as the one
    /// half-open trial (held by the guard returned), or be refused at once.
    fn admit(self: &Arc<Self>, key: &ServerKey) -> Result<TrialGuard, PgError> {
        let mut breaker = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        match breaker.admit(Instant::now()) {
            Admission::Go => Ok(TrialGuard { state: None }),
            Admission::Trial => Ok(TrialGuard {
                state: Some(self.clone()),
            }),
            Admission::Refuse(retry_in) => Err(PgError::CircuitOpen {
                server: key.clone(),
                retry_in,
                last_error: breaker.last_error.clone(),
            }),
        }
    }

    /// An idle session of `key` taken from the pool (closed and expired ones dropped).
    fn take_idle(&self, key: &PoolKey) -> Option<Client> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|i| i.since.elapsed() < IDLE_TIMEOUT && !i.client.is_closed());
        idle.iter()
            .position(|i| i.key == *key)
            .map(|at| idle.swap_remove(at).client)
    }
}

/// A client lent by the pool and the session slot it holds. Dropped, a healthy client
/// goes back to its server's pool.
pub(super) struct Lease {
    client: Option<Client>,
    key: PoolKey,
    server: ServerKey,
    state: Arc<ServerState>,
    _permit: OwnedSemaphorePermit,
    /// When the slot was granted (its connect, when new, counts as held).
    granted: Instant,
}

impl Lease {
    pub(super) fn client(&self) -> &Client {
        self.client
            .as_ref()
            .unwrap_or_else(|| unreachable!("the client is taken only on drop"))
    }

    pub(super) fn client_mut(&mut self) -> &mut Client {
        self.client
            .as_mut()
            .unwrap_or_else(|| unreachable!("the client is taken only on drop"))
    }

    pub(super) fn server(&self) -> &ServerKey {
        &self.server
    }

    pub(super) fn dbname(&self) -> &str {
        &self.key.dbname
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        crate::metrics::observe_session_held(self.granted.elapsed());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Port 1 on loopback, which refuses at once: a real, immediate connection failure.
    fn refusing() -> (Endpoint, Credentials) {
        let creds = Credentials {
            username: "u".into(),
            password: "p".into(),
        };
        (Endpoint::new("127.0.0.1", 1, TlsMode::Disable), creds)
    }

    #[tokio::test]
    async fn the_breaker_opens_after_repeated_connection_failures() {
        let servers = Servers::new(2, 3, Duration::from_secs(60));
        let (server, creds) = refusing();
        for _ in 0..3 {
            let e = servers
                .lease(&server, &creds, "postgres", false)
                .await
                .unwrap_err();
            assert!(matches!(e, PgError::Unreachable { .. }), "{e}");
        }
        let e = servers
            .lease(&server, &creds, "postgres", false)
            .await
            .unwrap_err();
        assert!(matches!(e, PgError::CircuitOpen { .. }), "{e}");
        assert_eq!(e.reason(), "ServerUnreachable");
        // Shown as the failure that opened it: a status written in an outage stays put.
        let again = servers
            .lease(&server, &creds, "postgres", false)
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
            .lease(&server, &creds, "postgres", true)
            .await
            .unwrap_err();
        assert!(matches!(probed, PgError::Unreachable { .. }), "{probed}");
    }

    #[tokio::test]
    async fn a_lease_if_free_neither_waits_nor_connects_while_every_slot_is_taken() {
        let servers = Servers::new(1, 3, Duration::from_secs(60));
        let (server, creds) = refusing();
        let held = servers
            .state(&server.key)
            .sessions
            .clone()
            .try_acquire_owned()
            .expect("the one slot");
        let none = tokio::time::timeout(
            Duration::from_secs(5),
            servers.lease_if_free(&server, &creds, "postgres"),
        )
        .await
        .expect("returns at once");
        assert!(matches!(none, Ok(None)), "{none:?}");
        drop(held);
        // With the slot free it does connect (and port 1 refuses).
        let tried = servers.lease_if_free(&server, &creds, "postgres").await;
        assert!(
            matches!(tried, Err(PgError::Unreachable { .. })),
            "{tried:?}"
        );
    }
}
