//! The CRDs evolve without breaking what a release stored or accepted (docs/development.md,
//! "CRD evolution"): each CRD of this checkout against the same file at the previous
//! release's tag (`git show <tag>:deploy/crds/<file>`), through `dbops_e2e::crd_compat`.

use dbops_e2e::crd_compat::{Change, changes};
use dbops_e2e::paths;

/// The release this checkout must stay compatible with: `e2e/previous-release`, the tag
/// the upgrade test starts from too (docs/development.md, "Releases and CRD evolution").
fn previous_release() -> String {
    std::fs::read_to_string(paths::repo_root().join("e2e/previous-release"))
        .unwrap()
        .trim()
        .to_string()
}

fn git(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("git")
        .args(args)
        .current_dir(paths::repo_root())
        .output()
        .map_err(|e| format!("git: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn the_crds_make_no_breaking_change_since_the_previous_release() {
    let previous = previous_release();
    let previous_release = previous.as_str();
    let listing = git(&["ls-tree", "--name-only", previous_release, "deploy/crds/"])
        .unwrap_or_else(|e| {
            panic!("the tag {previous_release} is missing from this clone (git fetch --tags): {e}")
        });
    let files: Vec<&str> = listing.lines().filter(|f| f.ends_with(".yaml")).collect();
    assert!(!files.is_empty(), "{previous_release} has no deploy/crds/");
    let mut breaking = Vec::new();
    for file in files {
        let old: serde_json::Value =
            serde_norway::from_str(&git(&["show", &format!("{previous_release}:{file}")]).unwrap())
                .unwrap();
        let path = paths::repo_root().join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{file} of {previous_release} is gone: {e}"));
        let new: serde_json::Value = serde_norway::from_str(&text).unwrap();
        for change in changes(&old, &new) {
            match change {
                Change::Breaking(_) => breaking.push(change.to_string()),
                Change::Note(_) => eprintln!("{file}: {change}"),
            }
        }
    }
    assert!(
        breaking.is_empty(),
        "breaking CRD changes since {previous_release}:\n{}",
        breaking.join("\n")
    );
}
