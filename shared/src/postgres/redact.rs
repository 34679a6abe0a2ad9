//! What a trace may show of a statement: its kind, and its text with every literal masked
//! when it mentions a password.

use std::borrow::Cow;

/// What a statement does, for a span name: its first keyword, with the object type after
/// `CREATE`, `ALTER` and `DROP` (`CREATE ROLE`, `ALTER DATABASE`, `SELECT`).
pub fn statement_kind(statement: &str) -> String {
    let mut words = statement
        .split(|c: char| c.is_whitespace() || c == ';' || c == '(')
        .filter(|w| !w.is_empty());
    let first = words.next().unwrap_or("SQL").to_ascii_uppercase();
    match first.as_str() {
        "CREATE" | "ALTER" | "DROP" => match words.next() {
            Some(object) if object.chars().all(|c| c.is_ascii_alphabetic()) => {
                format!("{first} {}", object.to_ascii_uppercase())
            }
            _ => first,
        },
        _ => first,
    }
}

/// The statement as a trace may show it: unchanged unless it mentions a password (`CREATE
/// ROLE ... PASSWORD '<verifier>'`, `ALTER ROLE ... PASSWORD`, a connection string), in
/// which case every string literal becomes `'***'`; a statement whose literals cannot be
/// told apart is reduced to its kind.
pub fn redact_statement(statement: &str) -> Cow<'_, str> {
    if !statement.to_ascii_lowercase().contains("password") {
        return Cow::Borrowed(statement);
    }
    match mask_literals(statement) {
        Some(masked) => Cow::Owned(masked),
        None => Cow::Owned(format!("{} [redacted]", statement_kind(statement))),
    }
}

/// `statement` with every string literal (`'...'`, `E'...'`, `$tag$...$tag$`) replaced by
/// `'***'`; quoted identifiers are kept. `None` when a literal is not terminated.
fn mask_literals(statement: &str) -> Option<String> {
    let chars: Vec<char> = statement.chars().collect();
    let mut out = String::with_capacity(statement.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' => {
                // A quoted identifier: copied through, "" is an embedded quote.
                let start = i;
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return None,
                        Some('"') if chars.get(i + 1) == Some(&'"') => i += 2,
                        Some('"') => break,
                        Some(_) => i += 1,
                    }
                }
                out.extend(&chars[start..=i]);
                i += 1;
            }
            '\'' => {
                // E'...' takes backslash escapes; '' is an embedded quote in both forms.
                let escapes = out.ends_with(['E', 'e']);
                if escapes {
                    out.pop();
                }
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return None,
                        Some('\\') if escapes => i += 2,
                        Some('\'') if chars.get(i + 1) == Some(&'\'') => i += 2,
                        Some('\'') => break,
                        Some(_) => i += 1,
                    }
                }
                out.push_str("'***'");
                i += 1;
            }
            '$' => {
                // $tag$...$tag$ (tag empty or an identifier); anything else is a parameter.
                let tag_end = chars[i + 1..]
                    .iter()
                    .position(|c| !(c.is_alphanumeric() || *c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end {
                    Some(end) if chars[end] == '$' && !chars[i + 1].is_ascii_digit() => {
                        let tag: String = chars[i..=end].iter().collect();
                        let body: String = chars[end + 1..].iter().collect();
                        let close = body.find(&tag)?;
                        out.push_str("'***'");
                        i = end + 1 + body[..close].chars().count() + tag.chars().count();
                    }
                    _ => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::{password_verifier, quote_ident, quote_literal};

    #[test]
    fn statements_with_a_password_are_recorded_without_their_literals() {
        let verifier = password_verifier("app", "s3cret");
        let create = format!(
            "CREATE ROLE {} LOGIN PASSWORD {}; COMMENT ON ROLE {} IS {}",
            quote_ident("app\"x"),
            quote_literal(&verifier),
            quote_ident("app\"x"),
            quote_literal("dbops.dev/uid=1")
        );
        let recorded = redact_statement(&create);
        assert!(!recorded.contains(&verifier), "{recorded}");
        assert!(!recorded.contains("SCRAM"), "{recorded}");
        assert_eq!(
            recorded,
            "CREATE ROLE \"app\"\"x\" LOGIN PASSWORD '***'; COMMENT ON ROLE \"app\"\"x\" IS '***'"
        );
        let alter = "alter role r password E'it\\'s''x'";
        assert_eq!(redact_statement(alter), "alter role r password '***'");
        let dollar = "ALTER ROLE r PASSWORD $q$se'cret$q$";
        assert_eq!(redact_statement(dollar), "ALTER ROLE r PASSWORD '***'");
        assert_eq!(
            redact_statement("ALTER ROLE r PASSWORD 'unterminated"),
            "ALTER ROLE [redacted]"
        );
    }

    #[test]
    fn other_statements_are_recorded_as_written() {
        let select = "SELECT 1 FROM pg_roles WHERE rolname = $1";
        assert_eq!(redact_statement(select), select);
        assert_eq!(statement_kind(select), "SELECT");
        assert_eq!(statement_kind("  create database \"x\""), "CREATE DATABASE");
        assert_eq!(statement_kind("DROP ROLE x"), "DROP ROLE");
        assert_eq!(statement_kind("COMMENT ON DATABASE x IS 'y'"), "COMMENT");
        assert_eq!(statement_kind(""), "SQL");
    }
}
