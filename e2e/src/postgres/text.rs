//! SQL as text: quoting identifiers and literals, and reading the statements of a server's
//! log (passwords redacted).

/// A PostgreSQL identifier in double quotes, safe to paste into SQL.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A string literal in single quotes, safe to paste into SQL (standard_conforming_strings
/// is on by default).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// Whether a server log line records a statement (`log_statement`).
pub(super) fn is_statement_line(line: &str) -> bool {
    if line.contains("statement: ") {
        return true;
    }
    // Extended protocol: "LOG:  execute s3: CREATE ..." or "execute <unnamed>: ...".
    line.split_once("LOG:  execute ")
        .is_some_and(|(_, rest)| rest.split_once(": ").is_some())
}

/// Replaces the string literal after each `PASSWORD` keyword (any case) with
/// `'<redacted>'`, so that statements such as `ALTER ROLE x PASSWORD '...'` can be printed.
/// A literal left open at the end of a line is redacted to the end of that line.
pub fn redact_passwords(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut pos = 0;
    while let Some(found) = lower[pos..].find("password") {
        let keyword_end = pos + found + "password".len();
        out.push_str(&text[pos..keyword_end]);
        pos = keyword_end;
        let after = &text[keyword_end..];
        let literal_start = after.len() - after.trim_start_matches([' ', '\t']).len();
        let rest = &after[literal_start..];
        let quote = match rest.as_bytes() {
            [b'\'', ..] => 1,
            [b'E' | b'e', b'\'', ..] => 2,
            _ => continue,
        };
        // The closing quote: the first ' not doubled ('' is an escaped quote).
        let body = &rest.as_bytes()[quote..];
        let mut i = 0;
        let end = loop {
            match body.get(i) {
                Some(b'\'') if body.get(i + 1) == Some(&b'\'') => i += 2,
                Some(b'\'') => break i + 1,
                Some(b'\n') | None => break i,
                Some(_) => i += 1,
            }
        };
        out.push_str(&after[..literal_start]);
        out.push_str("'<redacted>'");
        pos = keyword_end + literal_start + quote + end;
    }
    out.push_str(&text[pos..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted_from_statements() {
        assert_eq!(
            redact_passwords("ALTER ROLE a WITH LOGIN PASSWORD 'se''cret' VALID UNTIL 'x'"),
            "ALTER ROLE a WITH LOGIN PASSWORD '<redacted>' VALID UNTIL 'x'"
        );
        assert_eq!(
            redact_passwords("create role b password E'abc';\nnext password line"),
            "create role b password '<redacted>';\nnext password line"
        );
        assert_eq!(
            redact_passwords("x PASSWORD 'cut here\nnext"),
            "x PASSWORD '<redacted>'\nnext"
        );
        assert_eq!(redact_passwords("no secrets"), "no secrets");
    }

    #[test]
    fn statement_lines_are_recognised() {
        assert!(is_statement_line(
            "2025-01-01 [1] postgres@postgres app= LOG:  statement: CREATE DATABASE x"
        ));
        assert!(is_statement_line(
            "2025-01-01 [1] a@b app= LOG:  execute <unnamed>: DROP ROLE x"
        ));
        assert!(!is_statement_line(
            "2025-01-01 [1] LOG:  checkpoint starting: time"
        ));
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
