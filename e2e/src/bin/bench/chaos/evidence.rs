//! Evidence about an object: its controller's log lines about it and the faults and
//! leadership changes around it, printed and kept in the run directory.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::faults::Fleet;
use super::settle::controller_of;
use super::world::{World, strip_ansi};

/// Log lines of the object's controller about it, and from `from` (when the user asked)
/// to `to`: the faults, the controllers' leadership changes and failing watches.
pub(crate) fn evidence(
    world: &World,
    fleet: &Fleet,
    kind: &str,
    name: &str,
    window: Option<(Timestamp, Timestamp)>,
) -> String {
    let mut out = format!("----- evidence: {kind} {name} -----\n");
    let window = window.map(|(from, to)| {
        (
            from - SignedDuration::from_secs(60),
            to + SignedDuration::from_secs(10),
        )
    });
    if let Some((from, to)) = window {
        out.push_str(&format!("faults from {from} to {to}:\n"));
        for (when, what) in world.journal.faults_between(from, to) {
            out.push_str(&format!("  {when:.3} {what}\n"));
        }
    }
    for r in fleet.of(controller_of(kind)) {
        let text = std::fs::read(r.log_path()).unwrap_or_default();
        let text = strip_ansi(&String::from_utf8_lossy(&text));
        let in_window = |l: &str| {
            window.is_none_or(|(from, to)| line_time(l).is_some_and(|t| t >= from && t <= to))
        };
        let about: Vec<&str> = text
            .lines()
            .filter(|l| mentions(l, name) && in_window(l))
            .collect();
        out.push_str(&format!(
            "{} ({}): {} log lines mention {name}{}; the last 40:\n",
            r.slot,
            r.log_path().display(),
            about.len(),
            if window.is_some() {
                " in that window"
            } else {
                ""
            },
        ));
        for l in about.iter().rev().take(40).rev() {
            out.push_str(&format!("  {l}\n"));
        }
        if window.is_some() {
            out.push_str(&format!(
                "{}: leadership, starts, stops and failing watches in that window:\n",
                r.slot
            ));
            for l in text.lines().filter(|l| {
                in_window(l)
                    && line_time(l).is_some()
                    && [
                        "lead",
                        "Lease",
                        "=====",
                        "stopp",
                        "synced",
                        "starting",
                        "watch failed",
                    ]
                    .iter()
                    .any(|k| l.contains(k))
            }) {
                out.push_str(&format!("  {}\n", shorten(l, 300)));
            }
        }
    }
    out
}

fn shorten(l: &str, max: usize) -> &str {
    match l.char_indices().nth(max) {
        Some((i, _)) => &l[..i],
        None => l,
    }
}

/// Prints `text` and writes it to `<run>/evidence/<file>`.
pub(crate) fn keep_evidence(world: &World, file: &str, text: &str) {
    println!("{text}");
    let path = world.dir.join("evidence").join(file);
    if let Some(parent) = path.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let _ = std::fs::write(&path, text);
}

/// Whether a log line names `name` as a whole (not `db-1` in `db-12`).
fn mentions(line: &str, name: &str) -> bool {
    line.match_indices(name).any(|(i, _)| {
        let after = line[i + name.len()..].chars().next();
        !after.is_some_and(|c| c.is_ascii_alphanumeric())
    })
}

fn line_time(line: &str) -> Option<Timestamp> {
    line.split_whitespace().next()?.parse().ok()
}
