//! Identifier and literal quoting: every name and string the controllers put in SQL goes
//! through [`quote_ident`] or [`quote_literal`] (or a bind parameter).

/// `"ident"` with embedded quotes doubled: safe for any identifier.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// `'literal'` with embedded quotes doubled (standard_conforming_strings, on since 9.1).
pub fn quote_literal(literal: &str) -> String {
    format!("'{}'", literal.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_doubles_embedded_quotes() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(
            quote_literal("x'; DROP TABLE t; --"),
            "'x''; DROP TABLE t; --'"
        );
    }
}
