//! The PostgreSQL harness: real servers from Debian's packages, several at once.

use dbops_e2e::PgServer;

#[tokio::test]
async fn two_servers_run_side_by_side_and_survive_a_restart() {
    dbops_e2e::init_test_logging();
    let (source, target) = tokio::join!(PgServer::start("source"), PgServer::start("target"));
    let (source, mut target) = (source.unwrap(), target.unwrap());
    assert_ne!(source.port(), target.port());

    let s = source.connect_as_superuser().await.unwrap();
    s.batch_execute("CREATE TABLE marks (n int); INSERT INTO marks VALUES (1), (2)")
        .await
        .unwrap();
    let row = s
        .query_one("SELECT count(*) FROM marks", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2);

    // A wrong password is refused: TCP connections use scram-sha-256.
    let wrong = target
        .connect("postgres", "not-the-password", "postgres")
        .await;
    assert!(wrong.is_err(), "a wrong password must be refused");

    let t = target.connect_as_superuser().await.unwrap();
    t.batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();
    drop(t);
    target.stop().unwrap();
    assert!(
        target.connect_as_superuser().await.is_err(),
        "a stopped server refuses connections"
    );
    target.start_again().await.unwrap();
    let t = target.connect_as_superuser().await.unwrap();
    let row = t.query_one("SELECT n FROM kept", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 7, "data survives a restart");

    // The superuser is not the OS user: the server does not run as root.
    let user = s
        .query_one("SELECT current_setting('data_directory')", &[])
        .await
        .unwrap();
    let data_dir: String = user.get(0);
    let owner = std::process::Command::new("stat")
        .args(["-c", "%U", &data_dir])
        .output()
        .unwrap();
    assert_ne!(String::from_utf8_lossy(&owner.stdout).trim(), "root");
}
