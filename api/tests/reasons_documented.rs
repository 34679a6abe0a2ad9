//! The "Condition reasons" tables of docs/operations.md against `dbops_api::reasons`,
//! both ways: every reason a table names is a variant of the kind its section is about,
//! every variant has a row, and where a row states a class (`(True)`, `[Failed]`,
//! `Progressing=True`, `(Failed False)`) the variant's class is that one.

use std::collections::{BTreeMap, BTreeSet};

use dbops_api::reasons::{
    BackupReason, DatabaseReason, DatabaseServerReason, DatabaseUserReason, MigrationReason,
    ProcessReason, Reason, ReasonClass,
};

/// One reason as a table row names it.
#[derive(Debug)]
struct Documented {
    line: usize,
    class: Option<ReasonClass>,
}

/// The reasons of each `###` section of "## Condition reasons", by section title.
fn documented(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<Documented>>> {
    let mut sections: BTreeMap<String, BTreeMap<String, Vec<Documented>>> = BTreeMap::new();
    let mut inside = false;
    let mut section: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some(title) = line.strip_prefix("## ") {
            inside = title.trim() == "Condition reasons";
            section = None;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some(title) = line.strip_prefix("### ") {
            section = Some(title.trim().to_string());
            continue;
        }
        let (Some(section), Some(row)) = (&section, line.strip_prefix('|')) else {
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let first = cells[0];
        if first == "reason" || first.starts_with("---") || first.starts_with("any ") {
            continue;
        }
        let class = stated_class(first, cells.get(1).copied().unwrap_or_default());
        let reasons = sections.entry(section.clone()).or_default();
        for name in backticked(first) {
            reasons
                .entry(name)
                .or_default()
                .push(Documented { line: i + 1, class });
        }
    }
    sections
}

/// The CamelCase words in backticks.
fn backticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.starts_with(|c: char| c.is_ascii_uppercase())
                && w.chars().all(|c| c.is_ascii_alphanumeric())
        })
        .map(str::to_string)
        .collect()
}

/// The class a row states, if it states one.
fn stated_class(reason: &str, cause: &str) -> Option<ReasonClass> {
    if reason.contains("[Failed]") {
        Some(ReasonClass::Failed)
    } else if reason.contains("(True)") || reason.contains("(Ready True)") {
        Some(ReasonClass::Ready)
    } else if reason.contains("(Failed False)") {
        Some(ReasonClass::Nominal)
    } else if cause.contains("Progressing=True") {
        Some(ReasonClass::Progressing)
    } else {
        None
    }
}

/// What is wrong between one kind's enum and the docs' section `title`.
fn compare<R: Reason>(
    sections: &BTreeMap<String, BTreeMap<String, Vec<Documented>>>,
    title: &str,
) -> Vec<String> {
    let empty = BTreeMap::new();
    let rows = sections.get(title).unwrap_or(&empty);
    let mut wrong = Vec::new();
    if rows.is_empty() {
        wrong.push(format!(
            "docs/operations.md has no reason table under `### {title}`"
        ));
    }
    for (name, places) in rows {
        let lines: Vec<usize> = places.iter().map(|p| p.line).collect();
        let Some(reason) = R::parse(name) else {
            wrong.push(format!(
                "{name} (docs/operations.md:{lines:?}, `### {title}`) is not a variant of the {} reasons",
                R::KIND
            ));
            continue;
        };
        for place in places {
            if let Some(class) = place.class
                && class != reason.class()
            {
                wrong.push(format!(
                    "{name} (docs/operations.md:{}): the table says {class}, {}::{name} is {}",
                    place.line,
                    R::KIND,
                    reason.class()
                ));
            }
        }
    }
    let named: BTreeSet<&str> = rows.keys().map(String::as_str).collect();
    for reason in R::ALL {
        if !named.contains(reason.as_str()) {
            wrong.push(format!(
                "{}::{reason} ({}) has no row under `### {title}` in docs/operations.md",
                R::KIND,
                reason.class()
            ));
        }
    }
    wrong
}

/// Every kind's section, found by its title's first word.
fn check(text: &str) -> Vec<String> {
    let sections = documented(text);
    let titled = |word: &str| {
        sections
            .keys()
            .find(|t| t.split_whitespace().next() == Some(word))
            .cloned()
            .unwrap_or_else(|| word.to_string())
    };
    let mut wrong = Vec::new();
    wrong.extend(compare::<DatabaseServerReason>(
        &sections,
        &titled("DatabaseServer"),
    ));
    wrong.extend(compare::<DatabaseReason>(&sections, &titled("Database")));
    wrong.extend(compare::<DatabaseUserReason>(
        &sections,
        &titled("DatabaseUser"),
    ));
    wrong.extend(compare::<BackupReason>(&sections, &titled("Backup")));
    wrong.extend(compare::<MigrationReason>(&sections, &titled("Migration")));
    wrong.extend(compare::<ProcessReason>(&sections, "Not in a condition"));
    let known = [
        "DatabaseServer",
        "Database",
        "DatabaseUser",
        "Backup",
        "Migration",
        "Not",
    ];
    for title in sections.keys() {
        if !known
            .iter()
            .any(|k| title.split_whitespace().next() == Some(*k))
        {
            wrong.push(format!("`### {title}` is a reason section of no kind"));
        }
    }
    wrong
}

fn operations_md() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

#[test]
fn the_reason_tables_of_operations_md_are_the_enums() {
    let wrong = check(&operations_md());
    assert!(
        wrong.is_empty(),
        "docs/operations.md's condition reasons and dbops_api::reasons differ:\n  {}",
        wrong.join("\n  ")
    );
}

/// The check can fail: without one row, or with a reason no enum has, it says so.
#[test]
fn a_missing_or_unknown_row_is_found() {
    let text = operations_md();
    let row = text
        .lines()
        .find(|l| l.starts_with("| `QuotaExceeded` |"))
        .expect("the Database's QuotaExceeded row");
    let without = text.replace(&format!("{row}\n"), "");
    let renamed = text.replace("| `QuotaExceeded` |", "| `QuotaExceded` |");
    let reclassed = text.replace("| `Reachable` (True) |", "| `Reachable` [Failed] |");
    // (the edited page, the reason the complaint starts with, what it says)
    for (edited, reason, says) in [
        (without, "Database::QuotaExceeded", "no row"),
        (renamed, "QuotaExceded", "not a variant"),
        (reclassed, "Reachable", "the table says Failed"),
    ] {
        let wrong = check(&edited);
        assert!(
            wrong
                .iter()
                .any(|w| w.starts_with(reason) && w.contains(says)),
            "{reason}: {wrong:?}"
        );
    }
}
