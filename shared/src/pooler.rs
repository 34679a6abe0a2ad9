//! PgBouncer in front of a DatabaseServer (issue 36): what dbops gives PgBouncer to run.
//!
//! The design, and why:
//! - **Authentication costs no query on the server.** PgBouncer reads an `auth_file` of
//!   SCRAM-SHA-256 verifiers ([`Userlist`]) and, with the client's proof, logs in to the
//!   server as that same login (SCRAM pass-through): the server checks the password
//!   itself, against the verifier it holds, so a login reaches only what its role may
//!   (its own database: CONNECT is revoked from PUBLIC). `auth_query` instead costs a
//!   query on the server per new client connection and needs a role that can read
//!   `pg_authid`, which no managed service grants.
//! - **The verifier must be the one the server holds**, byte for byte (pass-through needs
//!   the same salt and iterations), and dbops cannot read `pg_authid` on a managed
//!   server. So dbops sets every pooled login's password with a verifier whose salt it
//!   can derive again ([`salt_for`]: HMAC-SHA-256 of the login under a random key per
//!   server, [`SaltKey`]), and can always write the same verifier into the userlist from
//!   the password it already keeps in the connection Secret. The salt never comes from
//!   the password, is unique per server and login, and cannot be predicted without the
//!   key.
//! - **Each database is its own route** ([`Route`]) in `[databases]`, not a wildcard: its
//!   pool, its `PAUSE`/`RESUME`, and its host, which a Migration's cutover changes
//!   between a `PAUSE` and a `RESUME` so that clients see a wait and no error.
//!
//! | module | holds |
//! |---|---|
//! | `scram` | [`SaltKey`], [`salt_for`], [`verifier`] |
//! | `userlist` | [`Userlist`]: the `auth_file` |
//! | `ini` | [`Settings`], [`Route`], [`render`]: `pgbouncer.ini` |

mod ini;
mod scram;
mod userlist;

pub use ini::{ClientTls, IniError, PoolMode, Route, ServerTls, Settings, render};
pub use scram::{ITERATIONS, SALT_LEN, SaltKey, SaltKeyError, salt_for, verifier};
pub use userlist::{Userlist, UserlistError};
