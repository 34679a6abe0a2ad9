//! PgBouncer's admin console, as a Migration's cutover uses it on each pooler instance:
//! `SHOW DATABASES` (where a route points, whether it is paused), `PAUSE <db>` (new
//! transactions of that database wait in the pooler; returns once no server connection
//! of it is in use), `RELOAD` (read the files again) and `RESUME <db>`.
//!
//! The console speaks only the simple query protocol. dbops reaches it over TLS, the
//! pooler's own certificate checked as `verify-ca` (an instance is reached by its Pod's
//! address, not by the Service's name the certificate is for), as the admin login of the
//! pooler's Secret.

use std::time::Duration;

use tokio_postgres::{Client, SimpleQueryMessage};

use super::ini::database_name;

/// The admin console's login in every pooler's `admin_users`.
pub const ADMIN_USER: &str = "dbops_pooler_admin";

/// One pooler instance (a ready endpoint of the pooler's Service): its address and port,
/// and its Pod when the endpoint names one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    pub address: String,
    pub port: u16,
    pub pod: Option<String>,
}

impl std::fmt::Display for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pod {
            Some(pod) => write!(f, "Pod {pod} ({}:{})", self.address, self.port),
            None => write!(f, "{}:{}", self.address, self.port),
        }
    }
}

/// What failed on the console, with the instance and the command.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("pooler {instance}: {what}")]
    Failed { instance: String, what: String },
    #[error("pooler {instance}: {command} did not answer within {within:?}")]
    TimedOut {
        instance: String,
        command: String,
        within: Duration,
    },
    #[error("{0:?} is not a database name the pooler routes")]
    BadName(String),
}

/// A route as `SHOW DATABASES` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteState {
    pub host: String,
    pub port: u16,
    pub database: String,
    pub paused: bool,
}

/// An open admin console on one instance.
pub struct Console {
    client: Client,
    instance: String,
    within: Duration,
}

impl Console {
    /// Connects to `instance`'s console as [`ADMIN_USER`] with `password`, trusting
    /// `ca_pem` (the pooler's certificate); every command is bounded by `within`.
    pub async fn connect(
        instance: &Instance,
        password: &str,
        ca_pem: &[u8],
        within: Duration,
    ) -> Result<Self, ConsoleError> {
        use crate::postgres::tls::{Verify, connector, roots_from_pem};
        let name = instance.to_string();
        let failed = |what: String| ConsoleError::Failed {
            instance: name.clone(),
            what,
        };
        let roots = roots_from_pem(ca_pem).map_err(&failed)?;
        let tls = connector(Verify::Chain, Some(roots)).map_err(|e| failed(e.to_string()))?;
        let mut config = tokio_postgres::Config::new();
        config
            .host(&instance.address)
            .port(instance.port)
            .user(ADMIN_USER)
            .password(password)
            .dbname("pgbouncer")
            .application_name("dbops")
            .ssl_mode(tokio_postgres::config::SslMode::Require)
            .connect_timeout(within);
        let connected = tokio::time::timeout(within, config.connect(tls))
            .await
            .map_err(|_| ConsoleError::TimedOut {
                instance: name.clone(),
                command: "connect".into(),
                within,
            })?;
        let (client, connection) =
            connected.map_err(|e| failed(crate::postgres::error_chain(&e)))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self {
            client,
            instance: name,
            within,
        })
    }

    async fn run(&self, command: &str) -> Result<Vec<SimpleQueryMessage>, ConsoleError> {
        self.run_within(command, self.within).await
    }

    async fn run_within(
        &self,
        command: &str,
        within: Duration,
    ) -> Result<Vec<SimpleQueryMessage>, ConsoleError> {
        match tokio::time::timeout(within, self.client.simple_query(command)).await {
            Err(_) => Err(ConsoleError::TimedOut {
                instance: self.instance.clone(),
                command: command.into(),
                within,
            }),
            Ok(Err(e)) => Err(ConsoleError::Failed {
                instance: self.instance.clone(),
                what: format!("{command}: {}", crate::postgres::error_chain(&e)),
            }),
            Ok(Ok(rows)) => Ok(rows),
        }
    }

    /// The route `db` as this instance serves it now (`None`: it has no such route).
    pub async fn route(&self, db: &str) -> Result<Option<RouteState>, ConsoleError> {
        checked(db)?;
        let rows = self.run("SHOW DATABASES").await?;
        Ok(rows.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(row) if row.get("name") == Some(db) => Some(RouteState {
                host: row.get("host").unwrap_or_default().to_string(),
                port: row
                    .get("port")
                    .and_then(|p| p.parse().ok())
                    .unwrap_or_default(),
                database: row.get("database").unwrap_or_default().to_string(),
                paused: row.get("paused").is_some_and(|p| p != "0"),
            }),
            _ => None,
        }))
    }

    /// `PAUSE db`: returns once no server connection of `db` is in use, or fails after
    /// `within` (the database stays paused on the instance either way: what was in flight
    /// is still running).
    pub async fn pause(&self, db: &str, within: Duration) -> Result<(), ConsoleError> {
        checked(db)?;
        match self.run_within(&format!("PAUSE {db}"), within).await {
            Err(ConsoleError::Failed { what, .. }) if what.contains("already") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// `RESUME db` (a database that is not paused is left as it is).
    pub async fn resume(&self, db: &str) -> Result<(), ConsoleError> {
        checked(db)?;
        match self.run(&format!("RESUME {db}")).await {
            Err(ConsoleError::Failed { what, .. }) if what.contains("not paused") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// `RELOAD`: the instance reads its configuration files again.
    pub async fn reload(&self) -> Result<(), ConsoleError> {
        self.run("RELOAD").await.map(|_| ())
    }
}

/// `db` if the console may be given it as a bare word (a route name dbops renders).
fn checked(db: &str) -> Result<&str, ConsoleError> {
    if database_name(db) {
        Ok(db)
    } else {
        Err(ConsoleError::BadName(db.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_route_names_reach_the_console() {
        assert!(checked("team_a_orders").is_ok());
        for bad in ["orders; SHUTDOWN", "Orders", "pgbouncer", "", "a b"] {
            assert!(checked(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_instance_names_its_pod() {
        let i = Instance {
            address: "10.0.0.7".into(),
            port: 6432,
            pod: Some("dbops-pooler-pg-1-abc".into()),
        };
        assert_eq!(i.to_string(), "Pod dbops-pooler-pg-1-abc (10.0.0.7:6432)");
    }
}
