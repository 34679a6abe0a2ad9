//! The admin a DatabaseServer's Secret names in a test: the harness's superuser, or a role
//! with exactly what a managed service gives its customer's admin (nobody is a superuser
//! on Amazon RDS/Aurora, Google Cloud SQL or Azure Database for PostgreSQL).
//!
//! What is emulated, and from which public document (docs/operations.md, "Managed
//! PostgreSQL", says the same for users):
//! - *base*, all three services: `LOGIN CREATEDB CREATEROLE`, members of
//!   `pg_signal_backend`, `pg_monitor` and, from PostgreSQL 14, `pg_read_all_data`. RDS's
//!   master user is a member of `rds_superuser` ("Understanding PostgreSQL roles and
//!   permissions", RDS User Guide); Cloud SQL's `cloudsqlsuperuser` ("About PostgreSQL
//!   users", Cloud SQL docs); Azure's `azure_pg_admin` ("Users and roles", Azure Database
//!   for PostgreSQL flexible server docs). Each has CREATEROLE and CREATEDB, none has
//!   SUPERUSER or BYPASSRLS, none may read `pg_authid`.
//! - *with replication*: base, plus `REPLICATION` (RDS `rds_replication` with
//!   `rds.logical_replication=1`; Cloud SQL `ALTER USER ... WITH REPLICATION` with
//!   `cloudsql.logical_decoding=on`; Azure's replication flag with `wal_level=logical`) and,
//!   from PostgreSQL 16, `pg_create_subscription`.
//!
//! Which one the suite's DatabaseServers use is [`AdminKind::for_tests`]: the *with
//! replication* admin unless `DBOPS_TEST_ADMIN` says otherwise, since that is what most
//! platform teams hold. The role is made on first use; its password is derived from the
//! server's superuser password, so every caller finds the same one without shared state.

use anyhow::{Context, Result};

use super::text::{quote_ident, quote_literal};
use super::{PgServer, SUPERUSER};

/// Who a DatabaseServer's admin Secret names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminKind {
    /// The harness's own superuser, `postgres`.
    Superuser,
    /// A managed service's admin without replication rights.
    Base,
    /// A managed service's admin with replication rights (the suite's default).
    Replication,
}

impl AdminKind {
    /// The kind the suite's DatabaseServers use: `DBOPS_TEST_ADMIN` (`superuser`, `base`
    /// or `replication`), else [`AdminKind::Replication`].
    pub fn for_tests() -> Self {
        match std::env::var("DBOPS_TEST_ADMIN").as_deref() {
            Ok("superuser") => Self::Superuser,
            Ok("base") => Self::Base,
            _ => Self::Replication,
        }
    }

    /// The role's name.
    pub fn role(self) -> &'static str {
        match self {
            Self::Superuser => SUPERUSER,
            Self::Base => "managed_admin",
            Self::Replication => "managed_admin_repl",
        }
    }

    /// Every kind, for what must know all their passwords (redaction).
    pub const ALL: [AdminKind; 3] = [Self::Superuser, Self::Base, Self::Replication];

    /// What a Migration's freeze runs on a source with this admin: `CONNECTION LIMIT 0`
    /// for a superuser; an admin that is not one (whom the limit would shut out too)
    /// revokes CONNECT from the database's roles instead.
    pub fn freeze_statement(self) -> &'static str {
        match self {
            Self::Superuser => "CONNECTION LIMIT 0",
            _ => "REVOKE CONNECT ON DATABASE",
        }
    }

    /// Whether a Logical Migration makes a replication role `dbops_mig_*` on a source of
    /// `major` with this admin (a superuser; a CREATEROLE admin with REPLICATION from 16),
    /// or the subscription logs in as the admin itself.
    pub fn makes_replication_role(self, major: u32) -> bool {
        match self {
            Self::Superuser => true,
            Self::Replication => major >= 16,
            Self::Base => false,
        }
    }

    /// Whether Verify's counts can be taken before a Logical Migration's freeze with this
    /// admin on the target: they need `pg_replication_origin_status`, which PostgreSQL
    /// shows to superusers only.
    pub fn counts_before_the_freeze(self) -> bool {
        self == Self::Superuser
    }

    /// The statements that make the role on a server of `version_num`
    /// (`server_version_num`), run as the superuser.
    pub fn statements(self, version_num: i32, password: &str) -> Vec<String> {
        let r = quote_ident(self.role());
        let replication = self == Self::Replication;
        let mut out = vec![format!(
            "CREATE ROLE {r} LOGIN CREATEDB CREATEROLE{} PASSWORD {}",
            if replication { " REPLICATION" } else { "" },
            quote_literal(password)
        )];
        let mut groups = vec!["pg_signal_backend", "pg_monitor"];
        if version_num >= 140000 {
            groups.push("pg_read_all_data");
        }
        if replication && version_num >= 160000 {
            groups.push("pg_create_subscription");
        }
        out.push(format!("GRANT {} TO {r}", groups.join(", ")));
        out
    }
}

impl PgServer {
    /// The password of the admin `kind` on this server (derived, never stored).
    pub fn admin_password(&self, kind: AdminKind) -> String {
        match kind {
            AdminKind::Superuser => self.superuser_password().to_string(),
            _ => {
                let seed = format!("{}/{}", self.superuser_password(), kind.role());
                dbops_shared::checksum::sha256_hex(seed.as_bytes())[..32].to_string()
            }
        }
    }

    /// The password of the suite's admin ([`AdminKind::for_tests`]): what a test checks is
    /// nowhere it must not be.
    pub fn test_admin_password(&self) -> String {
        self.admin_password(AdminKind::for_tests())
    }

    /// The login (user, password) of the admin `kind`, made on first use.
    pub async fn admin_login(&self, kind: AdminKind) -> Result<(String, String)> {
        let password = self.admin_password(kind);
        if kind != AdminKind::Superuser {
            let admin = self.connect_as_superuser().await?;
            let exists = admin
                .query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&kind.role()])
                .await?
                .is_some();
            if !exists {
                let version: i32 = admin
                    .query_one("SELECT current_setting('server_version_num')::int", &[])
                    .await?
                    .get(0);
                let statements = kind.statements(version, &password);
                admin
                    .batch_execute(&format!("BEGIN; {}; COMMIT", statements.join("; ")))
                    .await
                    .with_context(|| format!("creating the admin {}", kind.role()))?;
            }
        }
        Ok((kind.role().to_string(), password))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_emulated_admins_have_what_the_services_give_and_no_more() {
        let base = AdminKind::Base.statements(150000, "p").join("; ");
        assert!(
            base.contains("LOGIN CREATEDB CREATEROLE PASSWORD"),
            "{base}"
        );
        assert!(!base.contains("SUPERUSER") && !base.contains("REPLICATION"));
        assert!(base.contains("pg_signal_backend, pg_monitor, pg_read_all_data"));
        assert!(!AdminKind::Base.statements(130000, "p")[1].contains("pg_read_all_data"));
        let repl = AdminKind::Replication.statements(170000, "p").join("; ");
        assert!(repl.contains("CREATEROLE REPLICATION") && repl.contains("pg_create_subscription"));
        let repl15 = AdminKind::Replication.statements(150000, "p").join("; ");
        assert!(!repl15.contains("pg_create_subscription"));
    }
}
