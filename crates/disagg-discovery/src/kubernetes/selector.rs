//! Kubernetes' label-selector syntax, checked at start so that a selector the API server
//! would refuse on every list cannot hold back the other roles' pods.

/// Checks `selector` against Kubernetes' label-selector syntax, as the API server
/// parses a `labelSelector` (apimachinery's `labels.Parse`): requirements separated
/// by `,`, each one of `KEY`, `!KEY`, `KEY=VALUE`, `KEY==VALUE`, `KEY!=VALUE`,
/// `KEY in (V1,V2...)`, `KEY notin (V1,V2...)`, `KEY>N` and `KEY<N` (N an integer),
/// with spaces allowed between the parts. A KEY is `[PREFIX/]NAME`: NAME 1 to 63
/// characters of letters, digits, `-`, `_` and `.`, beginning and ending with a letter
/// or digit; PREFIX a lowercase DNS subdomain of at most 253 characters. A VALUE is
/// empty or as a NAME. An empty selector selects every pod.
///
/// # Errors
///
/// What is wrong, naming the part.
pub(super) fn check_selector(selector: &str) -> Result<(), String> {
    let tokens = selector_tokens(selector)?;
    let mut tokens = tokens.iter().peekable();
    if tokens.peek().is_none() {
        return Ok(());
    }
    loop {
        match tokens.next() {
            Some(Token::Not) => match tokens.next() {
                Some(Token::Word(key)) => check_key(key)?,
                other => return Err(format!("expected a key after `!`, found {}", shown(other))),
            },
            Some(Token::Word(key)) => {
                check_key(key)?;
                match tokens.peek() {
                    None | Some(Token::Comma) => {}
                    Some(Token::Eq | Token::DoubleEq | Token::NotEq) => {
                        tokens.next();
                        match tokens.peek() {
                            None | Some(Token::Comma) => {}
                            Some(Token::Word(value)) => {
                                check_value(value)?;
                                tokens.next();
                            }
                            other => {
                                return Err(format!(
                                    "expected a value after the operator, found {}",
                                    shown(other.copied())
                                ));
                            }
                        }
                    }
                    Some(Token::Gt | Token::Lt) => {
                        tokens.next();
                        match tokens.next() {
                            Some(Token::Word(n)) if n.parse::<i64>().is_ok() => {}
                            other => {
                                return Err(format!(
                                    "expected an integer after `>` or `<`, found {}",
                                    shown(other)
                                ));
                            }
                        }
                    }
                    Some(Token::Word(op)) if *op == "in" || *op == "notin" => {
                        tokens.next();
                        values(&mut tokens, op)?;
                    }
                    other => {
                        return Err(format!(
                            "expected `=`, `==`, `!=`, `in`, `notin`, `>`, `<`, `,` or the end after key `{key}`, found {}",
                            shown(other.copied())
                        ));
                    }
                }
            }
            other => return Err(format!("expected a key or `!KEY`, found {}", shown(other))),
        }
        match tokens.next() {
            None => return Ok(()),
            Some(Token::Comma) if tokens.peek().is_some() => {}
            Some(Token::Comma) => return Err("a `,` ends the selector".into()),
            other => return Err(format!("expected `,` or the end, found {}", shown(other))),
        }
    }
}

/// `(V1, V2...)` after `in` or `notin`: values, possibly empty, separated by `,`.
fn values<'a>(
    tokens: &mut std::iter::Peekable<impl Iterator<Item = &'a Token<'a>>>,
    op: &str,
) -> Result<(), String> {
    match tokens.next() {
        Some(Token::Open) => {}
        other => return Err(format!("expected `(` after `{op}`, found {}", shown(other))),
    }
    // After `(` or `,`: a value or not, then `,` or `)`.
    loop {
        if let Some(Token::Word(value)) = tokens.peek() {
            check_value(value)?;
            tokens.next();
        }
        match tokens.next() {
            Some(Token::Comma) => {}
            Some(Token::Close) => return Ok(()),
            other => {
                return Err(format!(
                    "expected `,` or `)` in `{op} (...)`, found {}",
                    shown(other)
                ));
            }
        }
    }
}

/// One token of a label selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token<'a> {
    /// A key, a value, `in` or `notin`: a run of characters that are neither spaces nor
    /// one of `!=(),<>`.
    Word(&'a str),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

/// How a token (or the end) is named in an error.
fn shown(token: Option<&Token<'_>>) -> String {
    match token {
        None => "the end".into(),
        Some(Token::Word(w)) => format!("`{w}`"),
        Some(t) => format!(
            "`{}`",
            match t {
                Token::Not => "!",
                Token::Eq => "=",
                Token::DoubleEq => "==",
                Token::NotEq => "!=",
                Token::Gt => ">",
                Token::Lt => "<",
                Token::Open => "(",
                Token::Close => ")",
                _ => ",",
            }
        ),
    }
}

/// `selector`'s tokens, as apimachinery's lexer reads them.
fn selector_tokens(selector: &str) -> Result<Vec<Token<'_>>, String> {
    const SPECIAL: &[u8] = b"!=(),<>";
    let bytes = selector.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let next = bytes.get(i + 1).copied();
        let (token, len) = match b {
            b if b.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'!' if next == Some(b'=') => (Token::NotEq, 2),
            b'!' => (Token::Not, 1),
            b'=' if next == Some(b'=') => (Token::DoubleEq, 2),
            b'=' => (Token::Eq, 1),
            b'(' => (Token::Open, 1),
            b')' => (Token::Close, 1),
            b',' => (Token::Comma, 1),
            b'<' => (Token::Lt, 1),
            b'>' => (Token::Gt, 1),
            _ => {
                let len = bytes[i..]
                    .iter()
                    .position(|c| c.is_ascii_whitespace() || SPECIAL.contains(c))
                    .unwrap_or(bytes.len() - i);
                // Split at ASCII bytes only: `i..i + len` are character boundaries.
                let word = selector.get(i..i + len).ok_or("not UTF-8 boundaries")?;
                (Token::Word(word), len)
            }
        };
        tokens.push(token);
        i += len;
    }
    Ok(tokens)
}

/// A label key: `[PREFIX/]NAME`.
fn check_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let label = |l: &str| {
            (1..=63).contains(&l.len())
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if prefix.len() > 253 || !prefix.split('.').all(label) {
            return Err(format!(
                "key `{key}`: the prefix before `/` must be a lowercase DNS subdomain of at most 253 characters"
            ));
        }
    }
    if name.is_empty() || !is_label_name(name) {
        return Err(format!(
            "key `{key}`: a name is 1 to 63 letters, digits, `-`, `_` and `.`, beginning and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// A label value: empty, or as a name.
fn check_value(value: &str) -> Result<(), String> {
    if !value.is_empty() && !is_label_name(value) {
        return Err(format!(
            "value `{value}`: a value is at most 63 letters, digits, `-`, `_` and `.`, beginning and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// 1 to 63 characters of `[A-Za-z0-9_.-]`, beginning and ending with a letter or digit.
fn is_label_name(s: &str) -> bool {
    let ends = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && ends(s.bytes().next())
        && ends(s.bytes().last())
}
