//! ARCHITECTURE.md's table of who publishes and who consumes each subject, held to the
//! code: the publishers of a subject are exactly the roles `arl_schemas::permissions`
//! lets publish it, and every consumer may read the subject's stream. A table that drifts
//! from the permissions fails here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use arl_schemas::permissions::Role;
use arl_schemas::{Domain, Namespace};

/// The rows of the table: (subjects, publishers, consumers), each cell as written.
fn rows() -> Vec<(String, String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../ARCHITECTURE.md");
    let text = std::fs::read_to_string(path).unwrap();
    let table = text
        .split("## Who publishes and who consumes")
        .nth(1)
        .expect("ARCHITECTURE.md has the table");
    table
        .lines()
        .skip_while(|l| !l.starts_with("| subject"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 3, "{line}");
            (cells[0].into(), cells[1].into(), cells[2].into())
        })
        .collect()
}

/// `run.failed` → (Run, "failed"); `.released` continues the row's domain.
fn subjects(cell: &str) -> Vec<(Domain, String)> {
    let mut domain = None;
    cell.split(',')
        .map(|s| s.trim().trim_matches('`'))
        .map(|name| {
            let (d, event) = name.split_once('.').unwrap();
            let d = if d.is_empty() {
                domain.unwrap()
            } else {
                Domain::ALL.into_iter().find(|x| x.token() == d).unwrap()
            };
            domain = Some(d);
            (d, event.to_owned())
        })
        .collect()
}

/// The roles a cell names ("controller, and any service …: dataset, trainer", "rollout
/// join (the grader's)", "CLI (replays)"); "—" names none.
fn roles(cell: &str) -> Vec<Role> {
    let mut words = String::new();
    let mut depth = 0;
    for c in cell.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => words.push(c),
            _ => {}
        }
    }
    let mut found: Vec<Role> = words
        .split([',', ':'])
        .filter_map(|part| {
            let word = part.split_whitespace().next()?.to_lowercase();
            Role::ALL.into_iter().find(|r| r.name() == word)
        })
        .collect();
    found.sort_by_key(|r| r.name());
    found.dedup();
    found
}

#[test]
fn the_architecture_table_matches_the_permissions() {
    let ns = Namespace::default();
    let rows = rows();
    assert!(rows.len() >= 15, "{rows:?}");
    for (subject_cell, publishers, consumers) in rows {
        let publishers = roles(&publishers);
        let consumers = roles(&consumers);
        for (domain, event) in subjects(&subject_cell) {
            let filter = ns.event_filter(domain, &event);
            let allowed: Vec<Role> = Role::ALL
                .into_iter()
                .filter(|r| ns.permissions(*r).publish.contains(&filter))
                .collect();
            let mut allowed = allowed;
            allowed.sort_by_key(|r| r.name());
            assert_eq!(
                allowed, publishers,
                "{subject_cell}: may publish per the permissions vs the table"
            );
            let stream = format!("$JS.API.CONSUMER.*.{}", ns.stream(domain));
            for role in &consumers {
                assert!(
                    ns.permissions(*role).publish.contains(&stream),
                    "{subject_cell}: {role:?} consumes it but may not read {}",
                    ns.stream(domain)
                );
            }
        }
    }
}
