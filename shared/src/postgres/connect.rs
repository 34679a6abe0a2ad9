//! Opening a connection: the TLS mode mapped to a connector, the session settings sent in
//! the startup packet (timeouts and [`ADMIN_SEARCH_PATH`]), and the failures sorted into
//! [`PgError`]s.

use std::time::Duration;

use dbops_api::TlsMode;
use tokio_postgres::{Client, NoTls};

use super::credentials::Credentials;
use super::endpoint::Endpoint;
use super::error::{PgError, classify, error_chain};
use super::tls;

/// The `search_path` of every admin session (see the module's documentation).
pub const ADMIN_SEARCH_PATH: &str = "pg_catalog,pg_temp";

/// How long a connection may take to answer, and the `statement_timeout` and
/// `lock_timeout` every session gets (zero: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    pub(super) connect: Duration,
    pub(super) statement: Duration,
    pub(super) lock: Duration,
}

impl Timeouts {
    /// A new connection as `credentials` to `dbname` on `server`.
    pub(super) async fn connect(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Client, PgError> {
        use tokio_postgres::config::SslMode;
        let key = &server.key;
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
                self.statement.as_millis(),
                self.lock.as_millis()
            ))
            .connect_timeout(self.connect);
        let timed_out = || PgError::Unreachable {
            server: key.clone(),
            message: format!("no answer within {:?}", self.connect),
        };
        let connected = match verify {
            None => connect_within(&config, NoTls, self.connect).await,
            Some(verify) => {
                let roots = server.tls.ca.as_ref().map(|ca| ca.roots.clone());
                let tls = tls::connector(verify, roots).map_err(|e| PgError::Tls {
                    server: key.clone(),
                    failure: tls::TlsFailure::CertificateNotTrusted,
                    message: e.to_string(),
                })?;
                connect_within(&config, tls, self.connect).await
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
