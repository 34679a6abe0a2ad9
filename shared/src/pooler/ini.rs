//! `pgbouncer.ini`: the pooler's settings and one route per database.

use std::fmt::Write as _;
use std::path::PathBuf;

/// Why a configuration was not rendered: a value PgBouncer would read as something else.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IniError {
    #[error(
        "database name {0:?} cannot be a pooler route (expected ^[a-z_][a-z0-9_]{{0,62}}$, not \"pgbouncer\")"
    )]
    BadRoute(String),
    #[error("host {0:?} cannot be a pooler route's host")]
    BadHost(String),
    #[error("{0} {1:?} cannot be written to pgbouncer.ini")]
    BadValue(&'static str, String),
    #[error("database {0:?} has two routes")]
    DuplicateRoute(String),
}

/// When a server connection goes back to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// After each transaction: the most clients per server connection; session state
    /// (SET, LISTEN, advisory locks, WITH HOLD cursors) does not carry over.
    Transaction,
    /// When the client disconnects: every feature, one server connection per client.
    Session,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Transaction => "transaction",
            Self::Session => "session",
        }
    }
}

/// TLS from the pooler to the server: the server's mode (libpq meanings) and CA file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    pub sslmode: String,
    pub ca_file: Option<PathBuf>,
}

/// TLS from clients to the pooler: its certificate and key files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTls {
    /// `require` refuses clients without TLS; `allow` takes both.
    pub sslmode: String,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Everything but the routes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub listen_addr: String,
    pub listen_port: u16,
    pub pool_mode: PoolMode,
    pub max_client_conn: u32,
    /// Server connections per database and login.
    pub default_pool_size: u32,
    /// Server connections per database in all (0: no limit but the pools').
    pub max_db_connections: u32,
    pub auth_file: PathBuf,
    /// The login of PgBouncer's admin console (PAUSE, RESUME, RELOAD), in the auth_file.
    pub admin_user: String,
    pub server_tls: ServerTls,
    pub client_tls: Option<ClientTls>,
}

/// A database clients name, and where the pooler takes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub name: String,
    pub host: String,
    pub port: u16,
    /// The database's name on the server (the same as `name` but during a move).
    pub dbname: String,
}

const SSLMODES_SERVER: [&str; 6] = [
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
];
const SSLMODES_CLIENT: [&str; 2] = ["allow", "require"];

pub(crate) fn database_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 63
        && name != "pgbouncer"
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn host(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
}

/// A value with no whitespace, quote, `;`, `#` or `=`: one token to PgBouncer's parser.
fn token(what: &'static str, value: &str) -> Result<String, IniError> {
    if value.is_empty()
        || value.chars().any(|c| {
            c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | ';' | '#' | '=')
        })
    {
        return Err(IniError::BadValue(what, value.to_string()));
    }
    Ok(value.to_string())
}

fn path(what: &'static str, value: &std::path::Path) -> Result<String, IniError> {
    token(what, &value.display().to_string())
}

fn one_of(what: &'static str, value: &str, allowed: &[&str]) -> Result<String, IniError> {
    if allowed.contains(&value) {
        Ok(value.to_string())
    } else {
        Err(IniError::BadValue(what, value.to_string()))
    }
}

/// The `pgbouncer.ini` of `settings` with `routes`, sorted by name: the same input
/// always renders the same bytes.
pub fn render(settings: &Settings, routes: &[Route]) -> Result<String, IniError> {
    let mut sorted: Vec<&Route> = routes.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = String::from("[databases]\n");
    for pair in sorted.windows(2) {
        if pair[0].name == pair[1].name {
            return Err(IniError::DuplicateRoute(pair[0].name.clone()));
        }
    }
    for route in &sorted {
        if !database_name(&route.name) {
            return Err(IniError::BadRoute(route.name.clone()));
        }
        if !database_name(&route.dbname) {
            return Err(IniError::BadRoute(route.dbname.clone()));
        }
        if !host(&route.host) {
            return Err(IniError::BadHost(route.host.clone()));
        }
        let _ = writeln!(
            out,
            "{} = host={} port={} dbname={}",
            route.name, route.host, route.port, route.dbname
        );
    }
    let s = settings;
    out.push_str("\n[pgbouncer]\n");
    let mut set = |key: &str, value: String| {
        let _ = writeln!(out, "{key} = {value}");
    };
    set("listen_addr", token("listen_addr", &s.listen_addr)?);
    set("listen_port", s.listen_port.to_string());
    // No Unix socket: clients come over TCP only (a Pod's file system is not shared).
    set("unix_socket_dir", String::new());
    set("auth_type", "scram-sha-256".into());
    set("auth_file", path("auth_file", &s.auth_file)?);
    set("admin_users", token("admin_user", &s.admin_user)?);
    set("pool_mode", s.pool_mode.as_str().into());
    set("max_client_conn", s.max_client_conn.to_string());
    set("default_pool_size", s.default_pool_size.to_string());
    set("max_db_connections", s.max_db_connections.to_string());
    // pgjdbc sends it in every startup packet; PgBouncer refuses unknown parameters.
    set("ignore_startup_parameters", "extra_float_digits".into());
    set(
        "server_tls_sslmode",
        one_of("server sslmode", &s.server_tls.sslmode, &SSLMODES_SERVER)?,
    );
    if let Some(ca) = &s.server_tls.ca_file {
        set("server_tls_ca_file", path("server CA file", ca)?);
    }
    if let Some(tls) = &s.client_tls {
        set(
            "client_tls_sslmode",
            one_of("client sslmode", &tls.sslmode, &SSLMODES_CLIENT)?,
        );
        set(
            "client_tls_cert_file",
            path("client certificate file", &tls.cert_file)?,
        );
        set(
            "client_tls_key_file",
            path("client key file", &tls.key_file)?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            listen_addr: "0.0.0.0".into(),
            listen_port: 6432,
            pool_mode: PoolMode::Transaction,
            max_client_conn: 2000,
            default_pool_size: 10,
            max_db_connections: 0,
            auth_file: "/etc/pgbouncer/userlist.txt".into(),
            admin_user: "dbops_pooler_admin".into(),
            server_tls: ServerTls {
                sslmode: "verify-full".into(),
                ca_file: Some("/etc/pgbouncer/server-ca.crt".into()),
            },
            client_tls: Some(ClientTls {
                sslmode: "require".into(),
                cert_file: "/etc/pgbouncer/tls/tls.crt".into(),
                key_file: "/etc/pgbouncer/tls/tls.key".into(),
            }),
        }
    }

    fn route(name: &str, host: &str) -> Route {
        Route {
            name: name.into(),
            host: host.into(),
            port: 5432,
            dbname: name.into(),
        }
    }

    #[test]
    fn renders_routes_sorted_then_the_settings() {
        let text = render(
            &settings(),
            &[route("orders", "pg-main.db"), route("billing", "10.0.0.7")],
        )
        .unwrap();
        assert!(text.starts_with(
            "[databases]\nbilling = host=10.0.0.7 port=5432 dbname=billing\n\
             orders = host=pg-main.db port=5432 dbname=orders\n\n[pgbouncer]\n"
        ));
        for line in [
            "auth_type = scram-sha-256",
            "auth_file = /etc/pgbouncer/userlist.txt",
            "admin_users = dbops_pooler_admin",
            "pool_mode = transaction",
            "max_client_conn = 2000",
            "default_pool_size = 10",
            "server_tls_sslmode = verify-full",
            "server_tls_ca_file = /etc/pgbouncer/server-ca.crt",
            "client_tls_sslmode = require",
            "ignore_startup_parameters = extra_float_digits",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert_eq!(
            text,
            render(
                &settings(),
                &[route("billing", "10.0.0.7"), route("orders", "pg-main.db")]
            )
            .unwrap()
        );
    }

    #[test]
    fn refuses_values_that_would_change_the_file() {
        let bad = |routes: &[Route], s: &Settings| render(s, routes).unwrap_err();
        assert_eq!(
            bad(&[route("pgbouncer", "h")], &settings()),
            IniError::BadRoute("pgbouncer".into())
        );
        assert_eq!(
            bad(&[route("a b", "h")], &settings()),
            IniError::BadRoute("a b".into())
        );
        assert_eq!(
            bad(&[route("a", "h dbname=other")], &settings()),
            IniError::BadHost("h dbname=other".into())
        );
        assert_eq!(
            bad(&[route("a", "h"), route("a", "g")], &settings()),
            IniError::DuplicateRoute("a".into())
        );
        let mut s = settings();
        s.server_tls.sslmode = "verify-full\nauth_type = trust".into();
        assert!(matches!(
            bad(&[], &s),
            IniError::BadValue("server sslmode", _)
        ));
        let mut s = settings();
        s.auth_file = "/tmp/x ;".into();
        assert!(matches!(bad(&[], &s), IniError::BadValue("auth_file", _)));
    }
}
