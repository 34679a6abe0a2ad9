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
//! | `console` | [`Console`]: the admin console of one instance (PAUSE, RELOAD, RESUME) |
//! | `forward` | [`can_forward`]: whether a server's pooler can serve a database moved away |

mod console;
mod forward;
mod ini;
mod userlist;

/// The port of every pooler's Pods and Service.
pub const PORT: u16 = 6432;
/// The pooler Secret's key with its serving certificate (self-signed: also the CA the
/// connection Secrets carry as `pooler-ca.crt`).
pub const TLS_CERT_KEY: &str = "tls.crt";
/// The pooler Secret's key with what clients verify the pooler's certificate against
/// (the connection Secrets' `pooler-ca.crt`): the named certificate Secret's `ca.crt`, or
/// the certificate itself. A pooler Secret without it (made before) gives `tls.crt`.
pub const CLIENT_CA_KEY: &str = "client-ca.crt";
/// The pooler Secret's key with the admin console's password (the login is
/// [`ADMIN_USER`]).
pub const ADMIN_PASSWORD_KEY: &str = "admin-password";
/// The pooler Secret's key with the certificate's private key.
pub const TLS_KEY_KEY: &str = "tls.key";
/// The annotation naming the DatabaseServer a pooler object serves.
pub const SERVER_ANNOTATION: &str = dbops_api::names::annotation::SERVER;

/// `dbops-pooler-<server>`: the name of a server's pooler objects, a valid Service name
/// (a DNS label: dots become dashes, and a name too long keeps a prefix and a digest of
/// the whole).
pub fn object_name(server: &str) -> String {
    let plain = format!("dbops-pooler-{}", server.replace('.', "-"));
    if plain.len() <= 63 {
        return plain;
    }
    let digest = crate::checksum::sha256_hex(server.as_bytes());
    format!("{}-{}", plain[..54].trim_end_matches('-'), &digest[..8])
}

/// Whether `meta` is of a pooler object dbops made for `server`: dbops's label and the
/// server's name in [`SERVER_ANNOTATION`].
pub fn is_ours(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    server: &str,
) -> bool {
    let (key, value) = dbops_api::names::label::MANAGED_BY;
    meta.labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
        == Some(value)
        && meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(SERVER_ANNOTATION))
            .map(String::as_str)
            == Some(server)
}

/// How applications reach a server's pooler: the Service's cluster name, its port and
/// the certificate to verify it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub host: String,
    pub port: u16,
    pub ca_pem: Vec<u8>,
}

/// The pooler of `server` as its Secret in `namespace` (the controllers') shows it, once
/// dbops has made it for that server: `None` without `spec.pooler` or before.
pub fn access(
    server: &dbops_api::DatabaseServer,
    namespace: &str,
    secret: impl FnOnce(&str) -> Option<std::sync::Arc<k8s_openapi::api::core::v1::Secret>>,
) -> Option<Access> {
    server.spec.pooler.as_ref()?;
    let server_name = server.metadata.name.as_deref()?;
    let name = object_name(server_name);
    let secret = secret(&name)?;
    let (key, value) = dbops_api::names::label::MANAGED_BY;
    let ours = secret
        .metadata
        .labels
        .as_ref()?
        .get(key)
        .map(String::as_str)
        == Some(value)
        && secret
            .metadata
            .annotations
            .as_ref()?
            .get(SERVER_ANNOTATION)
            .map(String::as_str)
            == Some(server_name);
    let data = secret.data.as_ref()?;
    let ca_pem = data
        .get(CLIENT_CA_KEY)
        .or_else(|| data.get(TLS_CERT_KEY))?
        .0
        .clone();
    (ours && !ca_pem.is_empty()).then(|| Access {
        host: format!("{name}.{namespace}.svc"),
        port: PORT,
        ca_pem,
    })
}

pub use console::{ADMIN_USER, Console, ConsoleError, Instance, RouteState};
pub use forward::can_forward;
pub use ini::{ClientTls, IniError, PoolMode, Route, ServerTls, Settings, render};
pub use userlist::{Userlist, UserlistError};
