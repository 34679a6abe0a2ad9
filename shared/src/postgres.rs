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
//!
//! The map (everything public is re-exported here; use these paths):
//!
//! | module | holds |
//! |---|---|
//! | [`tls`] | rustls connectors and the TLS failures |
//! | `endpoint` | [`ServerKey`], [`Endpoint`], [`TlsSettings`], [`CaBundle`] |
//! | `credentials` | [`Credentials`] from a Secret, [`password_verifier`], [`generate_password`] |
//! | [`scram`] | SCRAM-SHA-256 verifiers with the login's salt ([`scram::salt_for`], [`scram::verifier`]) |
//! | `error` | [`PgError`] and its condition reasons; how a driver error is classified |
//! | `quote` | [`quote_ident`], [`quote_literal`] |
//! | `breaker` | the per-server circuit breaker: closed, open, half-open with one trial |
//! | `connect` | opening one connection: TLS, the startup settings, [`ADMIN_SEARCH_PATH`] |
//! | `redact` | [`statement_kind`], [`redact_statement`]: what a trace may show of a statement |
//! | `trace` | the `sql` and `pg.connect` spans and the counter around each statement and connection |
//! | `pool` | [`Servers`]: per server the session limit, the breaker and the idle clients; a lease of one |
//! | `session` | [`Servers::connect`], [`Servers::probe`], [`Session`] and [`Transaction`] |
//! | [`derived`] | the role names dbops derives (rotation logins, DatabaseUser groups), none a tenant can give |
//! | [`ddl`] | the statements both the database- and the migration-controller run |
//! | [`extensions`] | what extensions a server offers, and creating them |
//!
//! Each module imports only the ones above it in this table (never this file's
//! re-exports), so there is no circle among them.

mod breaker;
mod connect;
mod credentials;
pub mod ddl;
pub mod derived;
mod endpoint;
mod error;
pub mod extensions;
mod pool;
mod quote;
mod redact;
pub mod scram;
mod session;
pub mod tls;
mod trace;

pub use connect::ADMIN_SEARCH_PATH;
pub use credentials::{Credentials, CredentialsError, generate_password, password_verifier};
pub use endpoint::{CaBundle, Endpoint, ServerKey, TlsSettings};
pub use error::PgError;
pub(crate) use error::error_chain;
pub use pool::Servers;
pub use quote::{quote_ident, quote_literal};
pub use redact::{redact_statement, statement_kind};
pub use session::{Session, Transaction};
