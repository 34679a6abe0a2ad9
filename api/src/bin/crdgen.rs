//! Writes the CustomResourceDefinitions of dbops.dev.
//!
//! `crdgen` prints every CRD as one multi-document YAML stream on stdout;
//! `crdgen --out-dir deploy/crds` writes one file a CRD there (what is committed).

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let out_dir = match (args.next().as_deref(), args.next()) {
        (None, None) => None,
        (Some("--out-dir"), Some(dir)) => Some(PathBuf::from(dir)),
        _ => {
            eprintln!("usage: crdgen [--out-dir DIR]");
            return ExitCode::from(2);
        }
    };
    for crd in dbops_api::crds() {
        let yaml = match dbops_api::crd_yaml(&crd) {
            Ok(yaml) => yaml,
            Err(e) => {
                eprintln!(
                    "crdgen: cannot serialize {}: {e}",
                    dbops_api::crd_file_name(&crd)
                );
                return ExitCode::FAILURE;
            }
        };
        match &out_dir {
            None => print!("---\n{yaml}"),
            Some(dir) => {
                let path = dir.join(dbops_api::crd_file_name(&crd));
                if let Err(e) = std::fs::write(&path, yaml) {
                    eprintln!("crdgen: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}
