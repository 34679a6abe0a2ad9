//! A [`Session`] on a server and its [`Transaction`]s: every statement traced; dropped, a
//! healthy session goes back to its server's pool.

use std::fmt;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row};

use super::credentials::Credentials;
use super::endpoint::{Endpoint, ServerKey};
use super::error::PgError;
use super::pool::{Lease, Servers};
use super::trace::{StatementTarget, traced};

impl Servers {
    /// Connects as `credentials` to database `dbname` on `server`, waiting for a session
    /// slot; refuses at once while the server's breaker is open, and lets one caller
    /// through as the trial once it is half-open.
    pub async fn connect(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Session, PgError> {
        let lease = self.lease(server, credentials, dbname, false).await?;
        Ok(Session { lease })
    }

    /// [`Servers::connect`] for work that yields to the rest (a converged object's
    /// routine check): a session only if one of the server's slots is free now, `None`
    /// without waiting otherwise.
    pub async fn connect_if_free(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Option<Session>, PgError> {
        let lease = self.lease_if_free(server, credentials, dbname).await?;
        Ok(lease.map(|lease| Session { lease }))
    }

    /// [`Servers::connect`] for a server's health probe: tried even while the breaker is
    /// open (one probe per server and interval, not per object), and its outcome closes or
    /// opens the breaker like any other connection.
    pub async fn probe(
        &self,
        server: &Endpoint,
        credentials: &Credentials,
        dbname: &str,
    ) -> Result<Session, PgError> {
        let lease = self.lease(server, credentials, dbname, true).await?;
        Ok(Session { lease })
    }
}

/// A session on a server: the client and the permit that counts it. Dropped, a healthy
/// session goes back to its server's pool.
pub struct Session {
    lease: Lease,
}

impl Session {
    /// The client itself: what it sends is not traced (prefer the methods of `Session`
    /// and [`Session::transaction`]).
    pub fn client_mut(&mut self) -> &mut Client {
        self.lease.client_mut()
    }

    fn on(&self) -> StatementTarget<'_> {
        StatementTarget {
            server: self.lease.server(),
            dbname: self.lease.dbname(),
        }
    }

    /// [`Client::query`], traced.
    pub async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, Client::query(self, statement, params)).await
    }

    /// [`Client::query_one`], traced.
    pub async fn query_one(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::query_one(self, statement, params),
        )
        .await
    }

    /// [`Client::query_opt`], traced.
    pub async fn query_opt(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::query_opt(self, statement, params),
        )
        .await
    }

    /// [`Client::execute`], traced.
    pub async fn execute(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        traced(
            self.on(),
            statement,
            Client::execute(self, statement, params),
        )
        .await
    }

    /// [`Client::batch_execute`], traced (one span for the whole batch).
    pub async fn batch_execute(&self, statements: &str) -> Result<(), tokio_postgres::Error> {
        traced(
            self.on(),
            statements,
            Client::batch_execute(self, statements),
        )
        .await
    }

    /// A transaction whose statements, `COMMIT` and `ROLLBACK` are traced.
    pub async fn transaction(&mut self) -> Result<Transaction<'_>, tokio_postgres::Error> {
        let server = self.lease.server().clone();
        let dbname = self.lease.dbname().to_owned();
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        let tx = traced(on, "BEGIN", self.client_mut().transaction()).await?;
        Ok(Transaction { tx, server, dbname })
    }
}

/// A transaction of a [`Session`]; dropped without [`Transaction::commit`], it rolls back.
pub struct Transaction<'a> {
    tx: tokio_postgres::Transaction<'a>,
    server: ServerKey,
    dbname: String,
}

impl fmt::Debug for Transaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

impl<'a> Transaction<'a> {
    fn on(&self) -> StatementTarget<'_> {
        StatementTarget {
            server: &self.server,
            dbname: &self.dbname,
        }
    }

    /// The transaction itself: what it sends is not traced.
    pub fn inner(&self) -> &tokio_postgres::Transaction<'a> {
        &self.tx
    }

    /// `Transaction::query`, traced.
    pub async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query(statement, params)).await
    }

    /// `Transaction::query_one`, traced.
    pub async fn query_one(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query_one(statement, params)).await
    }

    /// `Transaction::query_opt`, traced.
    pub async fn query_opt(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.query_opt(statement, params)).await
    }

    /// `Transaction::execute`, traced.
    pub async fn execute(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        traced(self.on(), statement, self.tx.execute(statement, params)).await
    }

    /// `Transaction::batch_execute`, traced (one span for the whole batch).
    pub async fn batch_execute(&self, statements: &str) -> Result<(), tokio_postgres::Error> {
        traced(self.on(), statements, self.tx.batch_execute(statements)).await
    }

    /// `COMMIT`, traced.
    pub async fn commit(self) -> Result<(), tokio_postgres::Error> {
        let Self { tx, server, dbname } = self;
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        traced(on, "COMMIT", tx.commit()).await
    }

    /// `ROLLBACK`, traced.
    pub async fn rollback(self) -> Result<(), tokio_postgres::Error> {
        let Self { tx, server, dbname } = self;
        let on = StatementTarget {
            server: &server,
            dbname: &dbname,
        };
        traced(on, "ROLLBACK", tx.rollback()).await
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
        self.lease.client()
    }
}
