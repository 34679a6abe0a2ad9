#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The feature round of issue 34, on the [`Majors`] world: everything a Database and a
//! DatabaseUser do, on one server, with whichever admin its Secret names (the suite's is a
//! managed service's admin, `crate::postgres::admin::AdminKind`): provisioning with an extension,
//! a connection limit and session settings; drift repaired; a ReadOnly DatabaseUser whose
//! default privileges reach a table made after it; the owner's and the user's password
//! rotated (the previous login retired after `keepPrevious`); a Backup and a restore on the
//! same server; deletion with each policy. Migrations across majors are the majors tests'
//! own.

use std::time::Duration;

use dbops_api::{BackupPhase, DatabaseUser};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::fixtures::{Connection, delete_for_final_snapshot, manifest, merge_patch};
use crate::harness::majors::Majors;
use crate::harness::migration::READY;
use crate::postgres::scalar;
use crate::wait::{Want, deleted, eventually, wait_for};

/// How long a drift repair, a rotation or a deletion may take (resync 5 s).
const SETTLED: Duration = Duration::from_secs(90);

impl Majors {
    pub fn users(&self) -> Api<DatabaseUser> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// The feature round on the server of `major` (see the module's documentation); its
    /// objects are named after the major, so rounds on several servers run side by side.
    pub async fn features(&self, major: u32) {
        let (db, keep, snap) = (
            format!("feat{major}"),
            format!("keep{major}"),
            format!("snap{major}"),
        );
        let login = json!({
            "extensions": ["pgcrypto"],
            "connectionLimit": 7,
            "settings": {"statementTimeout": "20s"},
            "passwordRotation": {"every": "720h", "keepPrevious": "3s"},
            "deletionPolicy": "Delete",
        });
        let (_, _, snapped) = tokio::join!(
            self.create_database(&db, major, login),
            self.create_database(&keep, major, json!({"deletionPolicy": "Retain"})),
            self.create_database(&snap, major, json!({"deletionPolicy": "Snapshot"})),
        );
        let pg = self.pg(major);
        let su = pg.connect_as_superuser_to(&db).await.unwrap();
        let limit = format!("SELECT datconnlimit::bigint FROM pg_database WHERE datname = '{db}'");
        let has_pgcrypto =
            "SELECT count(*) FROM pg_extension WHERE extname = 'pgcrypto'".to_string();
        assert_eq!(
            scalar::<i64>(&su, &limit).await,
            7,
            "{db}: connection limit"
        );
        assert_eq!(scalar::<i64>(&su, &has_pgcrypto).await, 1, "{db}: pgcrypto");
        let owner = self.connect_as_app(&db).await;
        assert_eq!(
            scalar::<String>(&owner, "SHOW statement_timeout").await,
            "20s",
            "{db}: the owner's session setting"
        );

        // Drift: the platform team (a superuser) changes what the spec says.
        su.batch_execute(&format!(
            "DROP EXTENSION pgcrypto; ALTER DATABASE {db} CONNECTION LIMIT 99"
        ))
        .await
        .unwrap();
        eventually(
            &format!("{db}'s drift repaired on {major}"),
            SETTLED,
            || async {
                Ok((
                    scalar::<i64>(&su, &limit).await,
                    scalar::<i64>(&su, &has_pgcrypto).await,
                ))
            },
            |found| *found == (7, 1),
        )
        .await;

        // A ReadOnly DatabaseUser, and a table the owner makes after it.
        let reader = format!("{db}-ro");
        let spec = json!({"databaseRef": {"name": db}, "access": "ReadOnly",
                          "connectionLimit": 3, "settings": {"statementTimeout": "10s"},
                          "passwordRotation": {"every": "720h", "keepPrevious": "3s"}});
        let user: DatabaseUser = manifest(&reader, spec).unwrap();
        self.users()
            .create(&PostParams::default(), &user)
            .await
            .unwrap();
        let ready = self.user_ready(&reader).await;
        let group = ready.status.as_ref().and_then(|s| s.group_role.clone());
        assert_eq!(group.as_deref(), Some(format!("{db}.{db}_ro").as_str()));
        owner
            .batch_execute("CREATE TABLE later (id int); INSERT INTO later VALUES (1), (2)")
            .await
            .unwrap();
        let ro = self.connect_user(&reader).await;
        assert_eq!(scalar::<i64>(&ro, "SELECT count(*) FROM later").await, 2);
        assert_eq!(scalar::<String>(&ro, "SHOW statement_timeout").await, "10s");
        let write = ro.batch_execute("INSERT INTO later VALUES (3)").await;
        assert!(write.is_err(), "{reader} is read-only on {major}");

        // The owner's rotation, then the user's.
        self.rotate_database(&db, "1", &format!("{db}-1")).await;
        let rotated = self.connect_as_app(&db).await;
        assert_eq!(
            scalar::<String>(&rotated, "SELECT current_user::text").await,
            db,
            "the rotation login acts as the owner"
        );
        rotated
            .batch_execute("CREATE TABLE after_rotation (id int)")
            .await
            .unwrap();
        self.wait_retired(major, &db).await;
        let previous_login = self.user_login(&reader).await;
        let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": "1"}}});
        merge_patch(&self.users(), &reader, rotate).await.unwrap();
        let next = if previous_login.ends_with("-1") {
            previous_login.replace("-1", "-2")
        } else {
            format!("{}-1", previous_login.trim_end_matches("-2"))
        };
        eventually(
            &format!("{reader}'s rotation to {next}"),
            SETTLED,
            || async { Ok(self.user_login(&reader).await) },
            |now| *now == next,
        )
        .await;
        let ro = self.connect_user(&reader).await;
        assert_eq!(
            scalar::<i64>(&ro, "SELECT count(*) FROM after_rotation").await,
            0
        );
        self.wait_retired(major, &previous_login).await;

        // A Backup of it, and a Database restored from it on the same server.
        let (backup, copy) = (format!("{db}-1"), format!("{db}copy"));
        self.create_backup(&backup, &db).await;
        self.wait_backup(&backup, BackupPhase::Completed).await;
        self.create_database(
            &copy,
            major,
            json!({"restoreFrom": {"backupRef": {"name": backup}}, "deletionPolicy": "Delete"}),
        )
        .await;
        let restored = pg.connect_as_superuser_to(&copy).await.unwrap();
        assert_eq!(
            scalar::<i64>(&restored, "SELECT count(*) FROM later").await,
            2,
            "{copy}: the rows of the Backup"
        );
        drop(restored);

        // Deletion with each policy: the user first (its roles go), then the Databases.
        let gone = self.users().get(&reader).await.unwrap();
        self.users()
            .delete(&reader, &DeleteParams::default())
            .await
            .unwrap();
        deleted(self.users(), &reader, &gone.uid().unwrap(), SETTLED)
            .await
            .unwrap();
        let group = group.unwrap();
        assert!(!pg.role_exists(&group).await.unwrap(), "{group} dropped");
        drop((su, owner, rotated, ro));
        // The superuser session above ends a moment after its client is dropped; until
        // then a managed admin cannot end it (DROP DATABASE ... WITH (FORCE): "must be a
        // superuser to terminate superuser process"), and the deletion would wait on it.
        pg.wait_no_superuser_session(&db).await.unwrap();
        for name in [&db, &keep, &copy] {
            let d = self.databases().get(name).await.unwrap();
            self.databases()
                .delete(name, &DeleteParams::default())
                .await
                .unwrap();
            deleted(self.databases(), name, &d.uid().unwrap(), SETTLED)
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", self.log("database-controller", 4000)));
        }
        assert!(
            !pg.database_exists(&db).await.unwrap(),
            "Delete dropped {db}"
        );
        assert!(
            !pg.role_exists(&db).await.unwrap(),
            "Delete dropped role {db}"
        );
        assert!(
            pg.database_exists(&keep).await.unwrap(),
            "Retain kept {keep}"
        );
        let snapshot = delete_for_final_snapshot(&self.b.client, &snapped, SETTLED)
            .await
            .unwrap();
        let backup = self.wait_backup(&snapshot, BackupPhase::Completed).await;
        assert!(backup.status.unwrap().size_bytes.unwrap_or(0) > 0);
        deleted(self.databases(), &snap, &snapped.uid().unwrap(), SETTLED)
            .await
            .unwrap();
        assert!(
            !pg.database_exists(&snap).await.unwrap(),
            "Snapshot dropped {snap} after its final Backup"
        );
    }

    /// Waits until DatabaseUser `name` is Ready.
    pub async fn user_ready(&self, name: &str) -> DatabaseUser {
        let found = wait_for(
            &format!("DatabaseUser {name} Ready"),
            READY,
            || async { Ok(self.users().get(name).await?) },
            |u: &DatabaseUser| {
                u.status.as_ref().is_some_and(|s| {
                    Want::new("Ready", "True", Some("UserReady")).matches(&s.conditions)
                })
            },
        )
        .await;
        found.unwrap_or_else(|e| panic!("{e:#}\n{}", self.log("database-controller", 6000)))
    }

    /// The login DatabaseUser `name`'s connection Secret names now.
    async fn user_login(&self, name: &str) -> String {
        self.user_connection(name).await.user
    }

    async fn user_connection(&self, name: &str) -> Connection {
        Connection::read(
            &Api::namespaced(self.b.client.clone(), self.ns()),
            &format!("{name}-connection"),
        )
        .await
        .unwrap()
    }

    /// A session as DatabaseUser `name`, with what its Secret says now.
    pub async fn connect_user(&self, name: &str) -> tokio_postgres::Client {
        self.user_connection(name).await.connect().await.unwrap()
    }

    /// Asks for a rotation of Database `name`'s password (`dbops.dev/rotate: value`) and
    /// waits until its connection Secret names `login`.
    pub async fn rotate_database(&self, name: &str, value: &str, login: &str) {
        let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": value}}});
        merge_patch(&self.databases(), name, rotate).await.unwrap();
        let found = wait_for(
            &format!("{name}'s Secret naming {login}"),
            SETTLED,
            || async {
                Ok(Connection::of_database(&self.b.client, self.ns(), name)
                    .await?
                    .user)
            },
            |user| user == login,
        )
        .await;
        if let Err(e) = found {
            panic!("{e:#}\n{}", self.log("database-controller", 6000));
        }
    }

    /// Waits until `login` on the server of `major` can no longer log in (retired after
    /// `keepPrevious`).
    async fn wait_retired(&self, major: u32, login: &str) {
        self.pg(major).wait_retired(login, SETTLED).await;
    }
}
