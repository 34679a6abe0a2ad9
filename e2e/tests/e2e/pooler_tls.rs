//! The pooler's certificate as the platform names it (`spec.pooler.certificateSecretRef`,
//! issue 36): a real PgBouncer (Debian's) on the files dbops keeps serves the named
//! certificate, clients verify it against the named CA that the connection Secrets carry
//! as `pooler-ca.crt`; a renewed certificate (the Secret changed, as cert-manager does)
//! reaches the pooler's Secret and, on a reload, the clients, with no change to what they
//! trust; a Secret that is missing is refused in `PoolerReady`.

use dbops_e2e::harness::database::{ADMIN_SECRET, READY, Setup, value};
use dbops_e2e::pgbouncer::PgBouncer;
use dbops_e2e::tls::TestCa;
use dbops_e2e::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

#[tokio::test]
async fn a_named_certificate_is_served_renewed_and_refused_when_missing() {
    dbops_e2e::init_test_logging();
    let s = Setup::new("pooler-named-cert").await;
    let ns = s.ns().to_string();
    let server = s.server(ADMIN_SECRET);
    let name = dbops_shared::pooler::object_name(&server);
    let service = format!("{name}.{ns}.svc");
    let ca = TestCa::new("platform pooler CA").unwrap();
    let issue = || ca.server_cert(&[service.as_str()], &[]).unwrap();
    let first = issue();
    dbops_e2e::fixtures::create_secret(
        &s.b.client,
        &ns,
        "pooler-cert",
        &[
            ("tls.crt", &first.cert_pem),
            ("tls.key", &first.key_pem),
            ("ca.crt", ca.pem()),
        ],
    )
    .await
    .unwrap();
    let servers: Api<dbops_api::DatabaseServer> = Api::all(s.b.client.clone());
    servers
        .patch(
            &server,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"pooler": {"replicas": 1,
                "certificateSecretRef": {"name": "pooler-cert"}}}})),
        )
        .await
        .unwrap();
    s.create_ready("orders", json!({})).await;

    // The pooler's Secret serves the named certificate; the connection Secret trusts the
    // named CA.
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), &ns);
    let pooler = eventually(
        "the pooler's Secret with the named certificate and orders' route",
        READY,
        || async { Ok(secrets.get_opt(&name).await?) },
        |p| {
            p.as_ref().is_some_and(|p| {
                value(p, "tls.crt") == first.cert_pem
                    && value(p, "pgbouncer.ini").contains("\norders = ")
            })
        },
    )
    .await
    .unwrap();
    let connection = eventually(
        "orders' connection Secret to trust the named CA",
        READY,
        || async { Ok(s.connection_secret("orders").await) },
        |c| {
            c.data
                .as_ref()
                .and_then(|d| d.get("pooler-ca.crt"))
                .is_some_and(|v| v.0 == ca.pem().as_bytes())
        },
    )
    .await;
    let (login, password) = (
        value(&connection, "username"),
        value(&connection, "password"),
    );
    let dbname = value(&connection, "dbname");
    let files = ["pgbouncer.ini", "userlist.txt", "tls.crt", "tls.key"]
        .into_iter()
        .map(|k| (k.to_string(), value(&pooler, k)))
        .collect();
    let dir = dbops_e2e::harness::bed::test_dir("pooler-named-cert", "pgbouncer");
    let bouncer =
        PgBouncer::start_from_rendered(dir.path(), &files, dbops_shared::pooler::ADMIN_USER)
            .await
            .unwrap();
    let follower = bouncer.follow_secret(secrets.clone(), &name);
    let trusted = ca.pem().as_bytes().to_vec();
    bouncer
        .connect_tls(&login, &password, &dbname, &trusted)
        .await
        .expect("the named certificate, verified against the named CA");
    let stranger = TestCa::new("another CA").unwrap();
    bouncer
        .connect_tls(&login, &password, &dbname, stranger.pem().as_bytes())
        .await
        .map(drop)
        .expect_err("not trusted by another CA");

    // Renewed: a new certificate and key in the same Secret reach the pooler's Secret and,
    // reloaded, the clients; they trust the same CA.
    let renewed = issue();
    secrets
        .patch(
            "pooler-cert",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"stringData": {"tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem}}),
            ),
        )
        .await
        .unwrap();
    eventually(
        "the pooler's Secret with the renewed certificate",
        READY,
        || async { Ok(secrets.get(&name).await?) },
        |p| value(p, "tls.crt") == renewed.cert_pem,
    )
    .await;
    let served = eventually(
        "the pooler to serve the renewed certificate",
        READY,
        || async {
            let cert = std::fs::read_to_string(dir.path().join("tls.crt")).unwrap_or_default();
            Ok(cert)
        },
        |cert| *cert == renewed.cert_pem,
    )
    .await;
    assert_eq!(served, renewed.cert_pem);
    bouncer
        .connect_tls(&login, &password, &dbname, &trusted)
        .await
        .expect("the renewed certificate, trusted as before");
    follower.abort();

    // A name with no Secret: refused, saying which.
    servers
        .patch(
            &server,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"pooler": {"certificateSecretRef": {"name": "no-such-cert"}}}}),
            ),
        )
        .await
        .unwrap();
    let refused = eventually(
        "PoolerReady False PoolerConfigInvalid",
        READY,
        || async { Ok(servers.get(&server).await?.status) },
        |st| {
            st.as_ref()
                .and_then(|st| dbops_shared::conditions::get(&st.conditions, "PoolerReady"))
                .is_some_and(|c| c.reason == "PoolerConfigInvalid")
        },
    )
    .await
    .unwrap();
    let c = dbops_shared::conditions::get(&refused.conditions, "PoolerReady")
        .cloned()
        .unwrap();
    assert!(c.message.contains("no-such-cert"), "{}", c.message);
}
