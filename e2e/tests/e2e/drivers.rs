//! Connecting from an application, exactly as docs/operations.md ("Connecting from an
//! application") says, with the drivers applications use, each installed from its own
//! registry by e2e/install (e2e/drivers/versions): libpq (psql), psycopg 3, pgx,
//! node-postgres and pgjdbc, against a server whose TLS is `verify-full` with a CA of its
//! own. Each program is given what a Pod gets: the connection Secret's keys as environment
//! variables (`envFrom`, plus `JDBC_URL` from the key `jdbc-url`) and the Secret mounted as
//! files at the Database's `spec.secretMountPath` (one file per key, as the kubelet writes
//! a Secret volume), and nothing else: no `~/.postgresql`, no extra option in code.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dbops_e2e::PgServer;
use dbops_e2e::paths::{self, Drivers};
use dbops_e2e::tls::TestCa;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

/// Provisioning on a busy 2-core machine.
const READY: Duration = Duration::from_secs(60);

/// One way to connect that the docs give: a name, the program and its arguments.
struct Way {
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
}

/// The ways docs/operations.md gives, for each driver.
fn ways(drivers: &Drivers, psql: &Path) -> Vec<Way> {
    let e2e = paths::repo_root().join("e2e/drivers");
    let file = |name: &str| e2e.join(name).display().to_string();
    let way = |name, program: &Path, args: &[&str]| Way {
        name,
        program: program.to_path_buf(),
        args: args.iter().map(|a| a.to_string()).collect(),
    };
    let java = PathBuf::from("java");
    let node = PathBuf::from("node");
    let jar = drivers.pgjdbc_jar.display().to_string();
    let connect_java = file("Connect.java");
    let connect_js = file("connect.js");
    let connect_py = file("connect.py");
    let sql = "SELECT 'driver=libpq user=' || current_user || ' ssl=' || CASE WHEN ssl THEN 'on' ELSE 'off' END FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    vec![
        way(
            "psql with uri",
            psql,
            &["-X", "-A", "-t", "-d", "$uri", "-c", sql],
        ),
        way(
            "psql with the PG* variables",
            psql,
            &["-X", "-A", "-t", "-c", sql],
        ),
        way("psycopg with uri", &drivers.python, &[&connect_py, "uri"]),
        way(
            "psycopg with the PG* variables",
            &drivers.python,
            &[&connect_py, "env"],
        ),
        way("pgx with uri", &drivers.pgx_connect, &["uri"]),
        way("pgx with the PG* variables", &drivers.pgx_connect, &["env"]),
        way("node-postgres with uri", &node, &[&connect_js, "uri"]),
        way(
            "node-postgres with DATABASE_URL (secretTemplate)",
            &node,
            &[&connect_js, "uri", "DATABASE_URL"],
        ),
        way(
            "pgjdbc with jdbc-url",
            &java,
            &["-cp", &jar, &connect_java, "JDBC_URL"],
        ),
        way(
            "pgjdbc with SPRING_DATASOURCE_URL (secretTemplate)",
            &java,
            &["-cp", &jar, &connect_java, "SPRING_DATASOURCE_URL"],
        ),
    ]
}

/// What a Pod with `envFrom: [{secretRef: <secret>}]` and `JDBC_URL` from the key
/// `jdbc-url` gets as its environment: every key that is a C identifier.
fn pod_env(data: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = data
        .iter()
        .filter(|(k, _)| {
            k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !k.starts_with(|c: char| c.is_ascii_digit())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.push(("JDBC_URL".into(), data["jdbc-url"].clone()));
    env
}

/// Runs `way` with only `env` (and PATH, and an empty HOME): its stdout, or its stderr as
/// the error.
fn run(
    way: &Way,
    env: &[(String, String)],
    home: &Path,
    node_modules: &Path,
) -> Result<String, String> {
    let args: Vec<String> = way
        .args
        .iter()
        .map(|a| match a.as_str() {
            "$uri" => env
                .iter()
                .find(|(k, _)| k == "uri")
                .map(|(_, v)| v.clone())
                .unwrap_or_default(),
            _ => a.clone(),
        })
        .collect();
    let mut command = Command::new(&way.program);
    command.env_clear().envs(env.iter().cloned()).args(&args);
    command
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("NODE_PATH", node_modules);
    let out = command
        .output()
        .map_err(|e| format!("{}: {e}", way.program.display()))?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{}: {stderr}{stdout}", out.status))
    }
}

/// Writes the Secret's keys as files under `dir`, as a Secret volume holds them.
fn mount(dir: &Path, data: &BTreeMap<String, String>) {
    std::fs::create_dir_all(dir).unwrap();
    for (key, value) in data {
        std::fs::write(dir.join(key), value).unwrap();
    }
}

/// Every driver connects with the Database's connection Secret as the docs say, over TLS
/// verified against the server's own CA: `spec.secretMountPath` makes `uri` and `jdbc-url`
/// name the mounted `ca.crt` and adds `PGSSLROOTCERT`, and the `ca_file` template value
/// does the same for a Spring and a DATABASE_URL template. With another CA in the mounted
/// `ca.crt` every one of them refuses the server: they really verify with that file.
#[tokio::test]
async fn every_driver_connects_with_the_secret_as_documented() {
    let drivers = paths::drivers().unwrap();
    let psql = dbops_e2e::paths::postgres_bin_dir().unwrap().join("psql");
    let b = crate::bed("drivers").await;
    let ns = b.ns.name().to_string();
    let ca = TestCa::new("dbops-e2e-drivers-ca").unwrap();
    let other_ca = TestCa::new("dbops-e2e-drivers-other-ca").unwrap();
    let cert = ca
        .server_cert(&["localhost"], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])
        .unwrap();
    let pg = PgServer::start_with_tls("drivers", Some(&cert))
        .await
        .unwrap();
    dbops_e2e::fixtures::create_tls_server(
        &b.client,
        &ns,
        "drivers",
        &pg,
        "localhost",
        "verify-full",
        Some(ca.pem()),
    )
    .await
    .unwrap();

    let pod = tempfile::Builder::new()
        .prefix("dbops-drivers-")
        .tempdir()
        .unwrap();
    let mount_path = pod.path().join("secrets/orders");
    let home = pod.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let spec = serde_json::json!({
        "secretMountPath": mount_path,
        "secretTemplate": {
            "DATABASE_URL": "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}{% if ca_file %}&sslrootcert={{ ca_file }}{% endif %}",
            "SPRING_DATASOURCE_URL": "jdbc:postgresql://{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}{% if ca_file %}&sslrootcert={{ ca_file }}{% endif %}",
            "SPRING_DATASOURCE_USERNAME": "{{ user }}",
            "SPRING_DATASOURCE_PASSWORD": "{{ password }}",
        },
    });
    let kubeconfig = crate::controller_kubeconfig(b.cp, "database-controller").await;
    let logs = crate::test_dir("drivers", "logs");
    let controller = dbops_e2e::ControllerProcess::start(
        "database-controller",
        &kubeconfig,
        logs.path(),
        &crate::watch_args(&ns, "3s"),
    )
    .unwrap();
    let log = || dbops_e2e::postgres::redact_passwords(&controller.process.log_tail(6000));
    let db = dbops_e2e::fixtures::create_provisioned_database(
        &b.client, &ns, "orders", "drivers", spec, READY, log,
    )
    .await;

    let secret = Api::<Secret>::namespaced(b.client.clone(), &ns)
        .get("orders-connection")
        .await
        .unwrap();
    let data: BTreeMap<String, String> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8(v.0).unwrap()))
        .collect();
    let ca_file = mount_path.join("ca.crt").display().to_string();
    assert_eq!(data["PGSSLROOTCERT"], ca_file);
    assert_eq!(data["PGSSLMODE"], "verify-full");
    assert!(
        data["uri"].ends_with(&format!("&sslrootcert={ca_file}")),
        "{}",
        data["uri"]
    );
    mount(&mount_path, &data);
    let env = pod_env(&data);
    let owner = db.owner_role();

    let ways = ways(&drivers, &psql);
    let mut failed = Vec::new();
    for way in &ways {
        match run(way, &env, &home, &drivers.node_modules) {
            Ok(out) if out.contains(&format!("user={owner} ssl=on")) => {
                eprintln!("{}: {}", way.name, out.trim());
            }
            Ok(out) => failed.push(format!("{}: printed {out:?}", way.name)),
            Err(e) => failed.push(format!("{}: {e}", way.name)),
        }
    }
    assert!(
        failed.is_empty(),
        "ways the docs give that did not connect:\n{}",
        failed.join("\n")
    );

    // Another CA in the mounted ca.crt: each refuses the server.
    std::fs::write(mount_path.join("ca.crt"), other_ca.pem()).unwrap();
    let connected: Vec<&str> = ways
        .iter()
        .filter(|way| run(way, &env, &home, &drivers.node_modules).is_ok())
        .map(|way| way.name)
        .collect();
    assert!(
        connected.is_empty(),
        "connected although the mounted ca.crt is another CA's: {connected:?}"
    );
    drop(controller);
}
