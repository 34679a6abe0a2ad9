//! The CRDs evolve without breaking what a release stored or accepted (docs/development.md,
//! "CRD evolution"): each CRD of this checkout against the same file at the previous
//! release's commit (`git show <commit>:deploy/crds/<file>`), through `dbops_e2e::crd_compat`.

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

/// The commit `e2e/releases` records for `release` (a clone without tags still has it).
fn recorded_commit(release: &str) -> Option<String> {
    let list = std::fs::read_to_string(paths::repo_root().join("e2e/releases")).unwrap();
    list.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        match l.split_whitespace().collect::<Vec<_>>()[..] {
            [tag, commit] if tag == release => Some(commit.to_string()),
            _ => None,
        }
    })
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

/// The previous release is listed in `e2e/releases`, and where this clone has its tag,
/// the tag names the recorded commit.
#[test]
fn the_previous_release_is_recorded_with_its_commit() {
    let release = previous_release();
    let commit =
        recorded_commit(&release).unwrap_or_else(|| panic!("e2e/releases does not list {release}"));
    if let Ok(tagged) = git(&[
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("{release}^{{commit}}"),
    ]) {
        assert_eq!(
            tagged.trim(),
            commit,
            "{release}'s tag and e2e/releases disagree"
        );
    }
}

#[test]
fn the_crds_make_no_breaking_change_since_the_previous_release() {
    let release = previous_release();
    let commit =
        recorded_commit(&release).unwrap_or_else(|| panic!("e2e/releases does not list {release}"));
    let previous_release = commit.as_str();
    let listing = git(&["ls-tree", "--name-only", previous_release, "deploy/crds/"])
        .unwrap_or_else(|e| {
            panic!(
                "{release} ({previous_release}) is not in this clone's history \
                 (a shallow clone? git fetch --unshallow): {e}"
            )
        });
    let files: Vec<&str> = listing.lines().filter(|f| f.ends_with(".yaml")).collect();
    assert!(!files.is_empty(), "{release} has no deploy/crds/");
    let mut breaking = Vec::new();
    for file in files {
        let old: serde_json::Value =
            serde_norway::from_str(&git(&["show", &format!("{previous_release}:{file}")]).unwrap())
                .unwrap();
        let path = paths::repo_root().join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{file} of {release} is gone: {e}"));
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
        "breaking CRD changes since {release}:\n{}",
        breaking.join("\n")
    );
}
