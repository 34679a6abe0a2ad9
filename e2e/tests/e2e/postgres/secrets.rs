//! Statements that carry a password are neither logged nor tracked, and leave the pooled
//! sessions as they were.

use std::time::Duration;

use dbops_e2e::PgServer;

/// The statements that carry a password or a verifier (`ddl::create_role`,
/// `ddl::set_password`, and one run `Alone` as CREATE SUBSCRIPTION is) reach neither the
/// log nor `pg_stat_statements` of a server recording every statement, every duration and
/// every error's statement, while `CREATE ROLE` and its mark stay in the log; the pooled
/// session comes back with its settings as they were, also when the caller gives up
/// half-way; an admin that is no superuser runs them all the same, unlogged as far as it
/// was granted (`GRANT SET ON PARAMETER`).
#[tokio::test]
async fn secret_statements_are_neither_logged_nor_tracked_and_leave_sessions_as_they_were() {
    use dbops_api::TlsMode;
    use dbops_e2e::secret_audit::{Known, VERIFIER_PREFIX, pg_stat_statements_texts};
    use dbops_shared::postgres::ddl::{self, Unlogged};
    use dbops_shared::postgres::{Credentials, Endpoint, Servers};

    dbops_e2e::init_test_logging();
    let bin = dbops_e2e::paths::postgres_bin_dir().unwrap();
    let mut settings = dbops_e2e::postgres::statement_recording(&bin);
    assert!(
        settings.contains(&("shared_preload_libraries", "pg_stat_statements")),
        "Debian's PostgreSQL ships pg_stat_statements"
    );
    settings.push(("log_min_duration_statement", "0"));
    let pg = PgServer::start_with_settings("unlogged", &settings)
        .await
        .unwrap();
    let su = pg.connect_as_superuser().await.unwrap();
    su.batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();

    let servers = Servers::new(4, 3, Duration::from_secs(30));
    let endpoint = Endpoint::new("127.0.0.1", pg.port(), TlsMode::Disable);
    let admin = pg.superuser_credentials();
    let session = || servers.connect(&endpoint, &admin, "postgres");
    let as_configured = [
        ("log_statement", "all"),
        ("log_min_duration_statement", "0"),
        ("log_min_error_statement", "error"),
        ("pg_stat_statements.track_utility", "on"),
    ];

    let passwords = [
        "first-Password-0f-the-owner",
        "second-Password-0f-the-owner",
        "Password-for-a-missing-role",
        "Password-in-an-alone-statement",
        "Password-in-a-failing-alone-one",
        "Control-password-sent-plainly",
    ];
    let mut s = session().await.unwrap();
    let first_pid = pid(&s).await;
    ddl::create_role(&mut s, "app_owner", passwords[0], "dbops.dev/uid=u1")
        .await
        .unwrap();
    ddl::set_password(&mut s, "app_owner", passwords[1])
        .await
        .unwrap();
    let missing = format!(
        "{:#}",
        anyhow::Error::from(
            ddl::set_password(&mut s, "no_such_role", passwords[2])
                .await
                .unwrap_err()
        )
    );
    assert!(missing.contains("does not exist"), "{missing}");
    assert!(!missing.contains("SCRAM"), "{missing}");
    ddl::execute_unlogged(
        &mut s,
        Unlogged::Alone,
        &format!("SELECT '{}'", passwords[3]),
        "an alone statement".into(),
    )
    .await
    .unwrap();
    let failed = format!(
        "{:#}",
        anyhow::Error::from(
            ddl::execute_unlogged(
                &mut s,
                Unlogged::Alone,
                &format!("SELECT '{}' FROM no_such_table", passwords[4]),
                "a failing alone statement".into(),
            )
            .await
            .unwrap_err()
        )
    );
    assert!(!failed.contains(passwords[4]), "{failed}");
    for (name, value) in as_configured {
        assert_eq!(show(&s, name).await, value, "{name} after the statements");
    }
    // A control, sent as it is: it is recorded (a comment is no constant that
    // pg_stat_statements would replace), so the search below can find one.
    s.batch_execute(&format!(
        "COMMENT ON DATABASE postgres IS '{}'",
        passwords[5]
    ))
    .await
    .unwrap();

    // The password took, and the role is marked.
    pg.connect("app_owner", passwords[1], "postgres")
        .await
        .expect("the second password logs in");
    assert!(
        pg.connect("app_owner", passwords[0], "postgres")
            .await
            .is_err()
    );
    assert_eq!(
        pg.role_comment("app_owner").await.unwrap().as_deref(),
        Some("dbops.dev/uid=u1")
    );

    // Given up half-way, alone and in a transaction: the session goes back to the pool,
    // and its next user finds the settings as configured (after the RESET or ROLLBACK
    // that was queued before it).
    for how in [Unlogged::Alone, Unlogged::InTransactionAfter("SELECT 1")] {
        let gave_up = tokio::time::timeout(
            Duration::from_millis(300),
            ddl::execute_unlogged(&mut s, how, "SELECT pg_sleep(1.5)", "sleeping".into()),
        )
        .await;
        assert!(gave_up.is_err(), "{how:?}: it should still be sleeping");
        drop(s);
        s = session().await.unwrap();
        assert_eq!(pid(&s).await, first_pid, "{how:?}: the pooled session");
        for (name, value) in as_configured {
            assert_eq!(show(&s, name).await, value, "{how:?}: {name}");
        }
        // SAVEPOINT fails outside a transaction block.
        assert!(
            s.batch_execute("SAVEPOINT probe").await.is_err(),
            "{how:?}: no transaction left open"
        );
    }

    let mut known = Known::default();
    for (i, password) in passwords.iter().enumerate() {
        known.add(format!("password {i}"), password);
    }
    let expected_control = |found: Vec<dbops_e2e::secret_audit::Finding>| {
        let mut others: Vec<String> = found
            .iter()
            .filter(|f| f.what != "the password of password 5")
            .map(ToString::to_string)
            .collect();
        others.dedup();
        assert!(others.is_empty(), "{others:#?}");
        assert!(
            found.iter().any(|f| f.what == "the password of password 5"),
            "the control is recorded: {found:#?}"
        );
    };
    expected_control(known.search_file(&pg.log_path()).unwrap());
    let texts = pg_stat_statements_texts(&su).await.unwrap().unwrap();
    expected_control(known.search("pg_stat_statements", &texts.join("\n")));
    // What carries no secret is logged as ever.
    let log = std::fs::read_to_string(pg.log_path()).unwrap();
    assert!(
        log.contains("CREATE ROLE \"app_owner\" LOGIN; COMMENT ON ROLE \"app_owner\""),
        "{}",
        pg.log_tail(3000)
    );
    assert!(log.contains("role \"no_such_role\" does not exist"));

    // An admin that is no superuser: the statements run, logged (it may not turn that
    // off) but with a verifier only; granted the settings, unlogged.
    let verifier_lines = || {
        std::fs::read_to_string(pg.log_path())
            .unwrap()
            .lines()
            .filter(|l| l.contains(VERIFIER_PREFIX))
            .count()
    };
    su.batch_execute(&format!(
        "CREATE ROLE weak_admin LOGIN CREATEROLE PASSWORD {}",
        dbops_e2e::postgres::quote_literal(&dbops_shared::postgres::password_verifier(
            "weak_admin",
            "weak-admin-password"
        ))
    ))
    .await
    .unwrap();
    let weak = Credentials {
        username: "weak_admin".into(),
        password: "weak-admin-password".into(),
    };
    let before = verifier_lines();
    let mut w = servers.connect(&endpoint, &weak, "postgres").await.unwrap();
    ddl::create_role(
        &mut w,
        "weak_app",
        "weak-app-password-1",
        "dbops.dev/uid=u2",
    )
    .await
    .expect("best effort: it runs without the settings");
    assert!(
        verifier_lines() > before,
        "not granted: logged, as a verifier"
    );
    assert!(
        !std::fs::read_to_string(pg.log_path())
            .unwrap()
            .contains("weak-app-password-1")
    );
    su.batch_execute(
        "GRANT SET ON PARAMETER log_statement, log_min_duration_statement, \
         log_min_error_statement TO weak_admin",
    )
    .await
    .unwrap();
    let before = verifier_lines();
    ddl::set_password(&mut w, "weak_app", "weak-app-password-2")
        .await
        .unwrap();
    assert_eq!(verifier_lines(), before, "granted: not logged");
    pg.connect("weak_app", "weak-app-password-2", "postgres")
        .await
        .expect("the new password logs in");
    drop(w);
    let w = servers.connect(&endpoint, &weak, "postgres").await.unwrap();
    assert_eq!(show(&w, "log_statement").await, "all");
}

/// The session's server process.
async fn pid(session: &dbops_shared::postgres::Session) -> i32 {
    session
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// `SHOW name` in the session.
async fn show(session: &dbops_shared::postgres::Session, name: &str) -> String {
    session
        .query_one(&format!("SHOW {name}"), &[])
        .await
        .unwrap()
        .get(0)
}
