//! What a test asks a server's catalog: databases, roles, their marks, owners and limits,
//! what a logical Migration may leave behind.

use anyhow::{Context, Result};

use super::PgServer;
use super::text::quote_ident;

impl PgServer {
    /// Whether a database of this name exists.
    pub async fn database_exists(&self, name: &str) -> Result<bool> {
        self.query_one_value(
            "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
            name,
        )
        .await
    }

    /// How many sessions of `application` are connected to `database` now (a restore's
    /// pg_restore, a clone's psql: whether the copy is under way).
    pub async fn sessions_of(&self, database: &str, application: &str) -> Result<i64> {
        let c = self.connect_as_superuser().await?;
        let row = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                &[&database, &application],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Waits (up to 30 s) until no superuser session is connected to `database`: a test's
    /// superuser client, once dropped, closes its connection a moment later, and a
    /// managed admin's `DROP DATABASE ... WITH (FORCE)` may not end a superuser's session.
    pub async fn wait_no_superuser_session(&self, database: &str) -> Result<()> {
        let admin = self.connect_as_superuser().await?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let n: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity a JOIN pg_roles r ON r.oid = a.usesysid \
                      WHERE a.datname = $1 AND r.rolsuper AND a.pid <> pg_backend_pid()",
                    &[&database],
                )
                .await?
                .get(0);
            if n == 0 {
                return Ok(());
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{n} superuser session(s) still on {database} after 30 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Whether `database` is frozen for new sessions of `role` (its owner): a connection
    /// limit of 0 (a superuser admin's freeze) or `role` without CONNECT on it (another
    /// admin's).
    pub async fn frozen_for(&self, database: &str, role: &str) -> Result<bool> {
        let admin = self.connect_as_superuser().await?;
        Ok(admin
            .query_one(
                "SELECT d.datconnlimit = 0 OR NOT has_database_privilege($2, d.oid, 'CONNECT') \
                   FROM pg_database d WHERE d.datname = $1",
                &[&database, &role],
            )
            .await?
            .get(0))
    }

    /// Waits up to `timeout` until `login` can no longer log in (retired after a rotation's
    /// `keepPrevious`); panics after it: for tests.
    pub async fn wait_retired(&self, login: &str, timeout: std::time::Duration) {
        crate::wait::eventually(
            &format!("login {login} retired after keepPrevious"),
            timeout,
            || async {
                let admin = self.connect_as_superuser().await?;
                Ok(admin
                    .query_one(
                        "SELECT rolcanlogin FROM pg_roles WHERE rolname = $1",
                        &[&login],
                    )
                    .await?
                    .get::<_, bool>(0))
            },
            |can| !*can,
        )
        .await;
    }

    /// Whether a role of this name exists.
    pub async fn role_exists(&self, name: &str) -> Result<bool> {
        self.query_one_value(
            "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)",
            name,
        )
        .await
    }

    /// What a Migration's replication might leave behind on this server, as (what, name):
    /// replication slots, subscriptions and roles named `dbops_mig_*`.
    pub async fn replication_leftovers(&self) -> Result<Vec<(&'static str, String)>> {
        let admin = self.connect_as_superuser().await?;
        let mut found = Vec::new();
        for (what, sql) in [
            ("slot", "SELECT slot_name::text FROM pg_replication_slots"),
            ("subscription", "SELECT subname::text FROM pg_subscription"),
            (
                "role",
                "SELECT rolname::text FROM pg_roles WHERE rolname LIKE 'dbops\\_mig\\_%'",
            ),
        ] {
            for row in admin.query(sql, &[]).await? {
                found.push((what, row.get::<_, String>(0)));
            }
        }
        Ok(found)
    }

    /// The publications in database `dbname`.
    pub async fn publications(&self, dbname: &str) -> Result<Vec<String>> {
        let client = self.connect_as_superuser_to(dbname).await?;
        let rows = client
            .query("SELECT pubname::text FROM pg_publication", &[])
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Panics unless both the database and the role `name` are gone: for tests.
    pub async fn assert_dropped(&self, name: &str) {
        assert!(
            !self.database_exists(name).await.expect("pg_database"),
            "database {name} still exists"
        );
        assert!(
            !self.role_exists(name).await.expect("pg_roles"),
            "role {name} still exists"
        );
    }

    /// How many roles have a name matching the SQL `LIKE` pattern (`_` and `%` are
    /// wildcards; a backslash escapes them).
    pub async fn count_roles_like(&self, pattern: &str) -> Result<i64> {
        self.query_one_value(
            "SELECT count(*) FROM pg_roles WHERE rolname LIKE $1",
            pattern,
        )
        .await
    }

    /// How many databases have a name matching the SQL `LIKE` pattern.
    pub async fn count_databases_like(&self, pattern: &str) -> Result<i64> {
        self.query_one_value(
            "SELECT count(*) FROM pg_database WHERE datname LIKE $1",
            pattern,
        )
        .await
    }

    /// The `COMMENT ON DATABASE` of a database; `None` when it has no comment or does not
    /// exist.
    pub async fn database_comment(&self, name: &str) -> Result<Option<String>> {
        self.query_opt_string(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1",
            name,
        )
        .await
    }

    /// The `COMMENT ON ROLE` of a role; `None` when it has no comment or does not exist.
    pub async fn role_comment(&self, name: &str) -> Result<Option<String>> {
        self.query_opt_string(
            "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1",
            name,
        )
        .await
    }

    /// The owner role of a database, `None` when it does not exist.
    pub async fn database_owner(&self, name: &str) -> Result<Option<String>> {
        self.query_opt_string(
            "SELECT pg_get_userbyid(datdba)::text FROM pg_database WHERE datname = $1",
            name,
        )
        .await
    }

    /// The OID of a database, `None` when it does not exist.
    pub async fn database_oid(&self, name: &str) -> Result<Option<u32>> {
        self.query_opt_value("SELECT oid FROM pg_database WHERE datname = $1", name)
            .await
    }

    /// `pg_database.datconnlimit` of a database (-1: no limit), `None` when it does not
    /// exist.
    pub async fn connlimit(&self, name: &str) -> Result<Option<i32>> {
        self.query_opt_value(
            "SELECT datconnlimit FROM pg_database WHERE datname = $1",
            name,
        )
        .await
    }

    /// `DROP DATABASE IF EXISTS <name> WITH (FORCE)`: drops it even with sessions open,
    /// the way an operator acting behind the controller's back would.
    pub async fn drop_database_force(&self, name: &str) -> Result<()> {
        let client = self.connect_as_superuser().await?;
        client
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                quote_ident(name)
            ))
            .await
            .with_context(|| format!("dropping database {name}"))?;
        Ok(())
    }

    async fn query_opt_string(&self, sql: &str, arg: &str) -> Result<Option<String>> {
        Ok(self
            .query_opt_value::<Option<String>>(sql, arg)
            .await?
            .flatten())
    }

    /// The first column of the one row `sql` returns for `$1 = arg`.
    async fn query_one_value<T: tokio_postgres::types::FromSqlOwned>(
        &self,
        sql: &str,
        arg: &str,
    ) -> Result<T> {
        self.query_opt_value(sql, arg)
            .await?
            .with_context(|| format!("{sql} [{arg}]: no row"))
    }

    /// The first column of the row `sql` returns for `$1 = arg`, `None` without a row.
    async fn query_opt_value<T: tokio_postgres::types::FromSqlOwned>(
        &self,
        sql: &str,
        arg: &str,
    ) -> Result<Option<T>> {
        let client = self.connect_as_superuser().await?;
        let row = client
            .query_opt(sql, &[&arg])
            .await
            .with_context(|| format!("{sql} [{arg}]"))?;
        Ok(row.map(|r| r.get::<_, T>(0)))
    }
}
