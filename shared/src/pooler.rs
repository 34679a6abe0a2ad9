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
//!   server. So every password dbops sets has a salt it can derive again from the login
//!   (`crate::postgres::scram`), and the userlist entry of a login is made from the
//!   password dbops already keeps in its connection Secret
//!   (`crate::postgres::password_verifier`). A role whose password was set before (with
//!   a random salt) needs its password set once more before it can be pooled.
//! - **Each database is its own route** ([`Route`]) in `[databases]`, not a wildcard: its
//!   pool, its `PAUSE`/`RESUME`, and its host, which a Migration's cutover changes
//!   between a `PAUSE` and a `RESUME` so that clients see a wait and no error.
//!
//! | module | holds |
//! |---|---|
//! | `userlist` | [`Userlist`]: the `auth_file` |
//! | `ini` | [`Settings`], [`Route`], [`render`]: `pgbouncer.ini` |

mod ini;
mod userlist;

pub use ini::{ClientTls, IniError, PoolMode, Route, ServerTls, Settings, render};
pub use userlist::{Userlist, UserlistError};
