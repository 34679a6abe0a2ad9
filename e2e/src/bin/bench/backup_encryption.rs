//! `dbops-bench backup-encryption`: what client-side encryption (issue 37) costs a dump
//! and a restore through the controllers. One database of `--mb` MB of random bytes (a
//! table of `gen_random_bytes(1024)` rows: pg_dump's compression gains nothing, so the
//! artifact is as large as the data and every byte is encrypted), dumped by the
//! backup-controller without recipients (P) and with them (E), alternating P E E P per
//! round after a warm-up of each (the backup-controller restarted between modes, then a
//! small untimed dump); then restored from a P and an E Backup in the same order (the
//! database-controller holds the identity throughout and reads both).

use std::time::Instant;

use anyhow::Result;
use dbops_e2e::{ControllerProcess, PgServer};
use dbops_shared::sealing::Identities;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::backup::{
    World, controller_args, controller_dump, controller_restore, create_database, database_size,
    mb, median,
};
use crate::bed::{BenchServer, namespace};

#[derive(clap::Args, Debug)]
pub struct EncryptionArgs {
    /// Size of the database of random bytes, in MB.
    #[arg(long, default_value_t = 1000)]
    mb: u64,
    /// Rounds of P E E P per operation.
    #[arg(long, default_value_t = 2)]
    rounds: u32,
}

const RECIPIENTS: &str = "bench-backup-recipients";
const IDENTITIES: &str = "bench-backup-identities";

pub async fn run(args: EncryptionArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-encryption-").await?;
    let pg = PgServer::start("bench-encryption").await?;
    let ns = namespace(&client, "bench-enc").await?;
    let server = BenchServer::create(&client, &ns, &pg).await?;
    let (identity, public) = Identities::generate();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &server.controller_namespace);
    for (name, key, value) in [
        (RECIPIENTS, "recipients", public),
        (IDENTITIES, "identities", identity),
    ] {
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name}, "stringData": {key: value},
        }))?;
        secrets.create(&PostParams::default(), &secret).await?;
    }
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store)?;
    let logs = tmp.path().join("logs");
    std::fs::create_dir_all(&logs)?;
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let kubeconfig = cp.kubeconfig_for("dbops-bench-controllers", &["system:masters"])?;
    let start = |name: &str, extra: Vec<String>| {
        let args = controller_args(&ns, &store, &server, &extra);
        ControllerProcess::start(name, &kubeconfig, &logs, &args)
    };
    let _dbc = start(
        "database-controller",
        vec![
            format!("--pg-restore={}", bin.join("pg_restore").display()),
            format!("--backup-identities-secret={IDENTITIES}"),
        ],
    )?;
    let backup_controller = |encrypted: bool| {
        let mut extra = vec![format!("--pg-dump={}", bin.join("pg_dump").display())];
        if encrypted {
            extra.push(format!("--backup-recipients-secret={RECIPIENTS}"));
        }
        start("backup-controller", extra)
    };
    let w = World {
        client,
        ns: ns.clone(),
        server: server.name.clone(),
        pg,
        bin: bin.clone(),
        dir: tmp.path().to_path_buf(),
    };
    create_database(&w, "small", None).await?;
    create_database(&w, "big", None).await?;
    let t = Instant::now();
    random_bytes(&w, "big", args.mb).await?;
    let size = database_size(&w, "big").await?;
    eprintln!(
        "{:.0} MB of random bytes in {:.0} s",
        mb(size),
        t.elapsed().as_secs_f64()
    );

    // Dumps: P E E P per round, the backup-controller restarted when the mode changes and
    // warmed up by an untimed small dump.
    let (mut plain, mut sealed) = (Vec::new(), Vec::new());
    let (mut first_plain, mut first_sealed) = (None, None);
    let mut bkc: Option<(bool, ControllerProcess)> = None;
    let mut n = 0;
    for _ in 0..args.rounds {
        for encrypted in [false, true, true, false] {
            n += 1;
            if bkc.as_ref().is_none_or(|(mode, _)| *mode != encrypted) {
                drop(bkc.take());
                bkc = Some((encrypted, backup_controller(encrypted)?));
                controller_dump(&w, "small", &format!("warm-{n}")).await?;
            }
            let name = format!("big-{n}");
            let secs = controller_dump(&w, "big", &name).await?;
            if encrypted {
                sealed.push(secs);
                first_sealed.get_or_insert(name);
            } else {
                plain.push(secs);
                first_plain.get_or_insert(name);
            }
        }
    }
    drop(bkc);
    let (Some(first_plain), Some(first_sealed)) = (first_plain, first_sealed) else {
        anyhow::bail!("no dump was made");
    };
    let artifact = |name: &str| -> Result<u64> {
        let dir = store.join(&w.ns);
        let file = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok())
            .find(|e| {
                let f = e.file_name().to_string_lossy().into_owned();
                f.starts_with(&format!("{name}-")) && f.ends_with(".dump")
            })
            .ok_or_else(|| anyhow::anyhow!("no artifact of {name}"))?;
        Ok(file.metadata()?.len())
    };
    let (plain_size, sealed_size) = (artifact(&first_plain)?, artifact(&first_sealed)?);

    // Restores: from the first P and the first E Backup, P E E P per round.
    let (mut plain_restore, mut sealed_restore) = (Vec::new(), Vec::new());
    let mut m = 0;
    for _ in 0..args.rounds {
        for encrypted in [false, true, true, false] {
            m += 1;
            let from = if encrypted {
                &first_sealed
            } else {
                &first_plain
            };
            let secs = controller_restore(&w, &format!("copy-{m}"), from).await?;
            if encrypted {
                sealed_restore.push(secs);
            } else {
                plain_restore.push(secs);
            }
        }
    }

    let tp = |secs: f64| mb(size) / secs;
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "# backup encryption benchmark: {:.0} MB of random bytes (pg_database_size); artifact {:.0} MB plain, {:.0} MB encrypted\n",
        mb(size),
        mb(plain_size),
        mb(sealed_size)
    );
    println!(
        "| {} rounds of P E E P; seconds (median throughput) | plain (P) | encrypted (E) | E / P throughput, medians (target ≥ 0.9 for the dump) |",
        args.rounds
    );
    println!("|---|---|---|---|");
    for (what, p, e) in [
        ("dump (Backup created → Completed)", &plain, &sealed),
        (
            "restore (Database with restoreFrom created → Ready)",
            &plain_restore,
            &sealed_restore,
        ),
    ] {
        let (pm, em) = (median(p), median(e));
        println!(
            "| {what} | {} s ({:.0} MB/s) | {} s ({:.0} MB/s) | {:.2} |",
            list(p),
            tp(pm),
            list(e),
            tp(em),
            pm / em
        );
    }
    println!(
        "\nfile:// store on {}, release controllers as built, {} cores",
        tmp.path().display(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    Ok(())
}

/// Fills `db` with about `mb` MB of random bytes: 1 KiB rows, owned by its role.
async fn random_bytes(w: &World, db: &str, mb: u64) -> Result<()> {
    let c = w.pg.connect_as_superuser_to(db).await?;
    let rows = mb * 1000;
    c.batch_execute(&format!(
        "CREATE EXTENSION IF NOT EXISTS pgcrypto;
         CREATE TABLE blobs (n int PRIMARY KEY, b bytea);
         ALTER TABLE blobs ALTER COLUMN b SET STORAGE EXTERNAL;
         INSERT INTO blobs SELECT g, gen_random_bytes(1000) FROM generate_series(1, {rows}) g;
         ALTER TABLE blobs OWNER TO {db};"
    ))
    .await?;
    Ok(())
}
