//! PgBouncer's `auth_file`: one `"login" "verifier"` line per login it lets in.

use std::collections::BTreeMap;

/// Why a userlist could not be made or read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UserlistError {
    #[error(
        "login {0:?} cannot be written to a PgBouncer auth_file (empty, or a control character)"
    )]
    BadLogin(String),
    #[error("only SCRAM-SHA-256 verifiers go into the pooler's auth_file (login {0:?})")]
    NotAVerifier(String),
    #[error("auth_file line {0} is not `\"login\" \"verifier\"`")]
    BadLine(usize),
}

/// The logins PgBouncer lets in, each with its SCRAM-SHA-256 verifier; sorted, so the
/// same logins always render the same bytes (no needless write, no needless reload).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Userlist {
    entries: BTreeMap<String, String>,
}

impl std::fmt::Debug for Userlist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.entries.keys()).finish()
    }
}

fn quote(value: &str) -> String {
    format!("\"{}\"", value.replace('"', "\"\""))
}

impl Userlist {
    /// Lets `login` in with `verifier` (replacing what it had).
    pub fn insert(&mut self, login: &str, verifier: &str) -> Result<(), UserlistError> {
        if login.is_empty() || login.chars().any(char::is_control) {
            return Err(UserlistError::BadLogin(login.to_string()));
        }
        if !verifier.starts_with("SCRAM-SHA-256$") || verifier.chars().any(char::is_whitespace) {
            return Err(UserlistError::NotAVerifier(login.to_string()));
        }
        self.entries.insert(login.to_string(), verifier.to_string());
        Ok(())
    }

    /// Stops letting `login` in; whether it was there.
    pub fn remove(&mut self, login: &str) -> bool {
        self.entries.remove(login).is_some()
    }

    pub fn verifier(&self, login: &str) -> Option<&str> {
        self.entries.get(login).map(String::as_str)
    }

    pub fn logins(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `auth_file` text.
    pub fn render(&self) -> String {
        self.entries
            .iter()
            .map(|(login, verifier)| format!("{} {}\n", quote(login), quote(verifier)))
            .collect()
    }

    /// Reads back what [`Userlist::render`] wrote.
    pub fn parse(text: &str) -> Result<Self, UserlistError> {
        let mut list = Self::default();
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let fields = quoted_fields(line).ok_or(UserlistError::BadLine(n + 1))?;
            let [login, verifier] = fields.as_slice() else {
                return Err(UserlistError::BadLine(n + 1));
            };
            list.insert(login, verifier)?;
        }
        Ok(list)
    }
}

/// The `"..."` fields of a line (`""` inside one is a quote), or `None` if it has
/// anything else.
fn quoted_fields(line: &str) -> Option<Vec<String>> {
    let mut fields = Vec::new();
    let mut chars = line.trim().chars().peekable();
    while let Some(c) = chars.next() {
        if c == ' ' {
            continue;
        }
        if c != '"' {
            return None;
        }
        let mut field = String::new();
        loop {
            match chars.next()? {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => break,
                other => field.push(other),
            }
        }
        fields.push(field);
    }
    Some(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: &str = "SCRAM-SHA-256$4096:c2FsdA==$c3RvcmVk:c2VydmVy";

    #[test]
    fn renders_sorted_quoted_lines_and_reads_them_back() {
        let mut list = Userlist::default();
        list.insert("orders_owner-2", V).unwrap();
        list.insert("app \"x\"", V).unwrap();
        let text = list.render();
        assert_eq!(
            text,
            format!("\"app \"\"x\"\"\" \"{V}\"\n\"orders_owner-2\" \"{V}\"\n")
        );
        assert_eq!(Userlist::parse(&text).unwrap(), list);
        assert!(list.remove("app \"x\""));
        assert!(!list.remove("app \"x\""));
        assert_eq!(list.logins().collect::<Vec<_>>(), ["orders_owner-2"]);
    }

    #[test]
    fn refuses_what_would_break_the_file_or_let_a_password_in() {
        let mut list = Userlist::default();
        assert_eq!(
            list.insert("a\nb", V),
            Err(UserlistError::BadLogin("a\nb".into()))
        );
        assert_eq!(
            list.insert("", V),
            Err(UserlistError::BadLogin(String::new()))
        );
        assert_eq!(
            list.insert("app", "plain-password"),
            Err(UserlistError::NotAVerifier("app".into()))
        );
        assert!(list.is_empty());
        assert_eq!(
            Userlist::parse("\"app\" plain"),
            Err(UserlistError::BadLine(1))
        );
        assert_eq!(
            Userlist::parse("\"app\" \"SCRAM-SHA-256$x\" \"extra\""),
            Err(UserlistError::BadLine(1))
        );
    }

    #[test]
    fn debug_names_logins_only() {
        let mut list = Userlist::default();
        list.insert("app", V).unwrap();
        let shown = format!("{list:?}");
        assert!(shown.contains("app") && !shown.contains("SCRAM"));
    }
}
