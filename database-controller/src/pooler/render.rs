//! What the pooler of a server holds, from the Databases on it and their connection
//! Secrets (pure): one route per database, one userlist entry per login.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use dbops_api::{Database, DatabaseServer, DatabaseUser, Migration, MigrationPhase, PoolMode};
use dbops_shared::pooler::{self, Route, Settings, Userlist};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;

use crate::secret;

/// Where the pooler's files are in its Pods.
pub const CONFIG_DIR: &str = "/etc/pgbouncer";
/// The file of `pgbouncer.ini` in the pooler's Secret and Pods.
pub const INI_KEY: &str = "pgbouncer.ini";
/// The userlist's key.
pub const USERLIST_KEY: &str = "userlist.txt";
pub use dbops_shared::pooler::PORT;
pub use dbops_shared::pooler::{ADMIN_PASSWORD_KEY, ADMIN_USER};
/// Where a server CA Secret's `ca.crt` is mounted.
pub const SERVER_CA_DIR: &str = "/etc/pgbouncer-server-ca";
/// The system's roots in the pooler's image (Debian's ca-certificates).
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The verifiers made so far, by login and the SHA-256 of its password: a verifier costs
/// 4096 rounds of HMAC-SHA-256, and a server reconcile renders every login of the server.
#[derive(Default)]
pub struct Verifiers {
    made: Mutex<HashMap<(String, String), String>>,
}

impl Verifiers {
    fn of(&self, login: &str, password: &str, digest: &str) -> String {
        let key = (login.to_string(), digest.to_string());
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        made.entry(key)
            .or_insert_with(|| dbops_shared::postgres::password_verifier(login, password))
            .clone()
    }

    /// Forgets the verifiers of logins no longer rendered.
    fn retain(&self, used: &Userlist) {
        self.made
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(login, _), v| used.verifier(login) == Some(v.as_str()));
    }
}

/// The pooler's routes and logins, and what it could not serve.
#[derive(Debug, Default, PartialEq)]
pub struct Served {
    pub routes: Vec<Route>,
    pub userlist: Userlist,
    /// Databases provisioned on the server whose connection Secret is not (yet) in the
    /// cache: routed, without a login until it is.
    pub waiting: Vec<String>,
}

/// What a pooler may serve: the Databases and DatabaseUsers (of every server: those of
/// `server` are picked) and the Databases moved away whose clients it still serves.
#[derive(Clone, Copy)]
pub struct Tenants<'a> {
    pub databases: &'a [Arc<Database>],
    pub users: &'a [Arc<DatabaseUser>],
    pub forwards: &'a Forwards,
}

/// Where a Database moved away from a pooled server is now: its route in that server's
/// pooler points there while the Migration that moved it is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    pub host: String,
    pub port: u16,
}

/// Forwards by the Database's namespace and name.
pub type Forwards = HashMap<(String, String), Forward>;

/// The Databases moved away from `server` by a Migration whose cutover its pooler held
/// (`status.pooler.held`), once the switch is made and the Database is on the target:
/// the pooler's clients stay connected to it, so it routes them to the target for as
/// long as the Migration is kept (and the target can be reached with the pooler's server
/// TLS settings: `dbops_shared::pooler::can_forward`).
pub fn forwards(
    server: &DatabaseServer,
    migrations: &[Arc<Migration>],
    databases: &[Arc<Database>],
    server_of: impl Fn(&str) -> Option<Arc<DatabaseServer>>,
) -> Forwards {
    let name = server.name_any();
    let mut out = Forwards::new();
    for m in migrations {
        let Some(status) = m.status.as_ref() else {
            continue;
        };
        let held = status
            .pooler
            .as_ref()
            .is_some_and(|p| p.held && p.server == name);
        if !held
            || status.switched_generation.is_none()
            || status.phase == Some(MigrationPhase::RolledBack)
            || status.source_server.as_ref().map(|s| s.name.as_str()) != Some(name.as_str())
        {
            continue;
        }
        let namespace = m.namespace().unwrap_or_default();
        let target = &m.spec.target.server_ref.name;
        let moved = databases.iter().find(|db| {
            db.namespace().as_deref() == Some(namespace.as_str())
                && db.name_any() == m.spec.database_ref.name
                && db.uid() == status.database_uid
                && db.status.as_ref().and_then(|s| s.server.as_ref()) == Some(target)
        });
        let Some(db) = moved else {
            continue;
        };
        let Some(t) = server_of(target) else {
            continue;
        };
        if pooler::can_forward(server, &t).is_err() {
            continue;
        }
        out.insert(
            (namespace, db.name_any()),
            Forward {
                host: t.spec.host.clone(),
                port: u16::try_from(t.spec.port).unwrap_or(5432),
            },
        );
    }
    out
}

/// The routes and logins of the Databases provisioned on `server`: each database's own
/// route to the server, its connection Secret's login with the verifier of its password,
/// and the login before the last rotation while the previous userlist still has it; and
/// the same for each DatabaseUser on the server (its route is its Database's). A
/// Database in `forwards` is served the same way, its route to where it is now.
pub fn served(
    server: &DatabaseServer,
    tenants: Tenants<'_>,
    secret_of: impl Fn(&str, &str) -> Option<Arc<Secret>>,
    previous: &Userlist,
    verifiers: &Verifiers,
    extra: &[(&str, &str)],
) -> Served {
    let name = server.name_any();
    let mut out = Served::default();
    let Tenants {
        databases,
        users,
        forwards,
    } = tenants;
    let forward_of = |namespace: Option<String>, database: &str| {
        forwards.get(&(namespace.unwrap_or_default(), database.to_string()))
    };
    for db in databases {
        let forward = forward_of(db.namespace(), &db.name_any());
        let (Some(route), Some(status)) = (route_of(server, db, forward), db.status.as_ref())
        else {
            continue;
        };
        out.routes.push(route);
        let login = Login {
            namespace: db.namespace().unwrap_or_default(),
            owner: format!("Database {}", db.name_any()),
            secret: status.connection_secret.as_deref(),
            previous: status.previous_login.as_deref(),
        };
        out.serve(login, &secret_of, previous, verifiers);
    }
    for user in users {
        let Some(status) = user.status.as_ref() else {
            continue;
        };
        let forwarded = forward_of(user.namespace(), &user.spec.database_ref.name).is_some();
        if (!forwarded && status.server.as_deref() != Some(name.as_str()))
            || user.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let login = Login {
            namespace: user.namespace().unwrap_or_default(),
            owner: format!("DatabaseUser {}", user.name_any()),
            secret: status.connection_secret.as_deref(),
            previous: status.previous_role.as_deref(),
        };
        out.serve(login, &secret_of, previous, verifiers);
    }
    for (login, password) in extra {
        let digest = dbops_shared::checksum::sha256_hex(password.as_bytes());
        let _ = out
            .userlist
            .insert(login, &verifiers.of(login, password, &digest));
    }
    out.routes.sort_by(|a, b| a.name.cmp(&b.name));
    out.routes.dedup_by(|a, b| a.name == b.name);
    verifiers.retain(&out.userlist);
    out
}

/// The route of `db` in `server`'s pooler: to `server`, or where `forward` says; `None`
/// when it is not provisioned there (nor forwarded) or is being deleted.
fn route_of(server: &DatabaseServer, db: &Database, forward: Option<&Forward>) -> Option<Route> {
    let status = db.status.as_ref()?;
    let (Some(dbname), Some(_)) = (&status.database_name, &status.provider_id) else {
        return None;
    };
    let on_server = status.server.as_deref() == server.metadata.name.as_deref();
    if (forward.is_none() && !on_server) || db.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let (host, port) = match forward {
        Some(f) => (f.host.clone(), f.port),
        None => (
            server.spec.host.clone(),
            u16::try_from(server.spec.port).unwrap_or(5432),
        ),
    };
    Some(Route {
        name: dbname.clone(),
        host,
        port,
        dbname: dbname.clone(),
    })
}

/// The login of a Database's owner or of a DatabaseUser: where its connection Secret is,
/// and its login before the last rotation.
struct Login<'a> {
    namespace: String,
    owner: String,
    secret: Option<&'a str>,
    previous: Option<&'a str>,
}

impl Served {
    /// Lets `login` in with the verifier of its Secret's password (or notes it waits for
    /// its Secret), and its previous login while the last userlist has it. A login that
    /// cannot be written is left out.
    fn serve(
        &mut self,
        login: Login<'_>,
        secret_of: &impl Fn(&str, &str) -> Option<Arc<Secret>>,
        previous: &Userlist,
        verifiers: &Verifiers,
    ) {
        let found = login
            .secret
            .and_then(|s| secret_of(&login.namespace, s))
            .and_then(|s| login_of(&s, verifiers));
        match found {
            Some((name, verifier)) => {
                let _ = self.userlist.insert(&name, &verifier);
            }
            None => self
                .waiting
                .push(format!("{} in {}", login.owner, login.namespace)),
        }
        if let Some(before) = login.previous
            && let Some(v) = previous.verifier(before)
        {
            let _ = self.userlist.insert(before, v);
        }
    }
}

/// The login a connection Secret names and the verifier of its password.
fn login_of(secret: &Secret, verifiers: &Verifiers) -> Option<(String, String)> {
    let password = secret::kept_password(secret)?;
    let login = secret::username(secret)?;
    let digest = dbops_shared::checksum::sha256_hex(password.as_bytes());
    let verifier = verifiers.of(&login, &password, &digest);
    Some((login, verifier))
}

/// The pooler Pods `spec.pooler` asks for (its default when absent).
pub fn replicas(server: &DatabaseServer) -> i32 {
    server.spec.pooler.as_ref().map_or(2, |p| p.replicas)
}

/// The pooler's settings in its Pods, from `spec.pooler` and the server's TLS.
pub fn settings(server: &DatabaseServer) -> Option<Settings> {
    let p = server.spec.pooler.as_ref()?;
    let tls = &server.spec.tls;
    let ca_file = match (&tls.ca_secret_ref, tls.mode.verifies()) {
        (Some(_), _) => Some(format!("{SERVER_CA_DIR}/ca.crt").into()),
        (None, true) => Some(SYSTEM_ROOTS.into()),
        (None, false) => None,
    };
    Some(Settings {
        listen_addr: "*".into(),
        listen_port: PORT,
        pool_mode: match p.pool_mode {
            PoolMode::Transaction => pooler::PoolMode::Transaction,
            PoolMode::Session => pooler::PoolMode::Session,
        },
        max_client_conn: u32::try_from(p.max_client_connections).unwrap_or(2000),
        default_pool_size: u32::try_from(p.default_pool_size).unwrap_or(10),
        max_db_connections: 0,
        auth_file: format!("{CONFIG_DIR}/{USERLIST_KEY}").into(),
        admin_user: ADMIN_USER.into(),
        server_tls: pooler::ServerTls {
            sslmode: tls.mode.as_str().into(),
            ca_file,
        },
        // Clients must use TLS: the Pods hold a certificate for the Service's names.
        client_tls: Some(pooler::ClientTls {
            sslmode: "require".into(),
            cert_file: format!("{CONFIG_DIR}/{}", pooler::TLS_CERT_KEY).into(),
            key_file: format!("{CONFIG_DIR}/{}", pooler::TLS_KEY_KEY).into(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn server() -> DatabaseServer {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": "pg-main", "uid": "s-1"},
            "spec": {"host": "pg.example", "port": 5433, "adminSecretRef": {"name": "a"},
                     "pooler": {}}
        }))
        .unwrap()
    }

    fn db(ns: &str, name: &str, server: &str, previous: Option<&str>) -> Arc<Database> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
                "metadata": {"name": name, "namespace": ns, "uid": format!("u-{name}")},
                "spec": {"serverRef": {"name": server}},
                "status": {"server": server, "databaseName": format!("{ns}_{name}"),
                           "providerID": "pg.example:5433/1",
                           "connectionSecret": format!("{name}-connection"),
                           "login": format!("{name}_owner"),
                           "previousLogin": previous}
            }))
            .unwrap(),
        )
    }

    fn secret(login: &str, password: &str) -> Arc<Secret> {
        let bytes = |v: &str| ByteString(v.as_bytes().to_vec());
        Arc::new(Secret {
            data: Some(
                [
                    ("username".to_string(), bytes(login)),
                    ("password".to_string(), bytes(password)),
                ]
                .into(),
            ),
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                annotations: Some(
                    [(
                        dbops_api::names::annotation::PASSWORD_SHA256.to_string(),
                        dbops_shared::checksum::sha256_hex(password.as_bytes()),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            ..Default::default()
        })
    }

    #[test]
    fn routes_and_logins_of_the_databases_on_the_server_only() {
        let dbs = [
            db("shop", "orders", "pg-main", None),
            db("shop", "billing", "pg-main", Some("billing_owner-1")),
            db("blog", "posts", "pg-other", None),
            db("blog", "drafts", "pg-main", None),
        ];
        let mut previous = Userlist::default();
        previous
            .insert("billing_owner-1", "SCRAM-SHA-256$4096:a$b:c")
            .unwrap();
        previous
            .insert("gone_owner", "SCRAM-SHA-256$4096:a$b:c")
            .unwrap();
        let verifiers = Verifiers::default();
        let secret_of = |ns: &str, name: &str| match (ns, name) {
            ("shop", "orders-connection") => Some(secret("orders_owner", "pw-1")),
            ("shop", "billing-connection") => Some(secret("billing_owner-2", "pw-2")),
            _ => None,
        };
        let tenants = Tenants {
            databases: &dbs,
            users: &[],
            forwards: &Forwards::new(),
        };
        let served = served(&server(), tenants, secret_of, &previous, &verifiers, &[]);
        let routes: Vec<_> = served
            .routes
            .iter()
            .map(|r| (r.name.as_str(), r.host.as_str(), r.port))
            .collect();
        assert_eq!(
            routes,
            [
                ("blog_drafts", "pg.example", 5433),
                ("shop_billing", "pg.example", 5433),
                ("shop_orders", "pg.example", 5433)
            ]
        );
        assert_eq!(
            served.userlist.logins().collect::<Vec<_>>(),
            ["billing_owner-1", "billing_owner-2", "orders_owner"],
            "the previous login while the old list has it; a gone one leaves"
        );
        assert_eq!(
            served.userlist.verifier("orders_owner"),
            Some(dbops_shared::postgres::password_verifier("orders_owner", "pw-1").as_str())
        );
        assert_eq!(served.waiting, ["Database drafts in blog"]);
        // Made once: the memo holds exactly the logins served.
        assert_eq!(verifiers.made.lock().unwrap().len(), 2);
    }

    fn migration(phase: &str, held: bool) -> Arc<Migration> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
                "metadata": {"name": "move", "namespace": "shop"},
                "spec": {"databaseRef": {"name": "orders"},
                         "target": {"serverRef": {"name": "pg-new"}}},
                "status": {"phase": phase, "sourceServer": {"name": "pg-main"},
                           "databaseUid": "u-orders", "switchedGeneration": 2,
                           "pooler": {"server": "pg-main", "database": "shop_orders",
                                      "held": held}}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_database_moved_away_keeps_its_route_to_the_target_while_its_migration_is_kept() {
        let moved = db("shop", "orders", "pg-new", None);
        let dbs = [moved, db("shop", "billing", "pg-main", None)];
        let mut target = server();
        target.metadata.name = Some("pg-new".into());
        target.spec.host = "pg-new.example".into();
        target.spec.port = 5432;
        target.spec.pooler = None;
        let target = Arc::new(target);
        let server_of = |n: &str| (n == "pg-new").then(|| target.clone());
        let found = forwards(&server(), &[migration("Succeeded", true)], &dbs, server_of);
        assert_eq!(
            found.get(&("shop".to_string(), "orders".to_string())),
            Some(&Forward {
                host: "pg-new.example".into(),
                port: 5432
            })
        );
        let secret_of = |_: &str, name: &str| match name {
            "orders-connection" => Some(secret("orders_owner", "pw-1")),
            _ => Some(secret("billing_owner", "pw-2")),
        };
        let tenants = Tenants {
            databases: &dbs,
            users: &[],
            forwards: &found,
        };
        let verifiers = Verifiers::default();
        let served = served(
            &server(),
            tenants,
            secret_of,
            &Userlist::default(),
            &verifiers,
            &[],
        );
        let routes: Vec<_> = served
            .routes
            .iter()
            .map(|r| (r.name.as_str(), r.host.as_str(), r.port))
            .collect();
        assert_eq!(
            routes,
            [
                ("shop_billing", "pg.example", 5433),
                ("shop_orders", "pg-new.example", 5432)
            ]
        );
        assert!(
            served.userlist.verifier("orders_owner").is_some(),
            "its login stays"
        );

        // Not held, rolled back, or a target the pooler cannot reach: no forward.
        for m in [migration("Succeeded", false), migration("RolledBack", true)] {
            assert!(forwards(&server(), &[m], &dbs, server_of).is_empty());
        }
        let mut other_tls = (*target).clone();
        other_tls.spec.tls.mode = dbops_api::TlsMode::Require;
        let other_tls = Arc::new(other_tls);
        let found = forwards(&server(), &[migration("Succeeded", true)], &dbs, |_| {
            Some(other_tls.clone())
        });
        assert!(found.is_empty());
    }

    #[test]
    fn settings_follow_the_spec_and_the_servers_tls() {
        let mut s = server();
        let set = settings(&s).unwrap();
        assert_eq!(set.listen_port, PORT);
        assert_eq!(set.default_pool_size, 10);
        assert_eq!(set.server_tls.sslmode, "verify-full");
        assert_eq!(
            set.server_tls.ca_file.as_deref(),
            Some(std::path::Path::new(SYSTEM_ROOTS))
        );
        s.spec.tls.ca_secret_ref = Some(dbops_api::SecretReference { name: "ca".into() });
        assert_eq!(
            settings(&s).unwrap().server_tls.ca_file.as_deref(),
            Some(std::path::Path::new("/etc/pgbouncer-server-ca/ca.crt"))
        );
        s.spec.pooler = None;
        assert!(settings(&s).is_none());
    }
}
