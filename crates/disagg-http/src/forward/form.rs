//! The `model` field of a `multipart/form-data` body sent direct (vLLM's audio
//! transcriptions and translations take their model as a form field), so that it picks
//! the engine as a JSON body's `model` does.
//!
//! Hand-written, not a multipart crate: what is needed is one field's value from a body
//! already whole in memory, and a streaming parser (`multer`, the one well kept) would
//! copy the whole body (an audio file, up to the body limit) into a buffer of its own,
//! for a field that is a few bytes. This is a scan for the delimiters (`memchr`'s
//! substring search: linear in the body whatever its bytes), then of each part's own
//! header lines (never its data) for a `content-disposition` naming `model`, read as
//! the engines' form parser (Starlette over `python-multipart`) reads it: header and
//! parameter names in any case, the name quoted or not, a part with a `filename` a
//! file (no field), and the last of repeated fields winning. A body that does not
//! parse as a form names no model here; the engine answers it.

use std::borrow::Cow;

use http::HeaderValue;
use memchr::memmem;

/// The longest `model` field read: as discovery's model names
/// (`disagg_discovery::spec::MAX_MODEL_NAME_BYTES`); one longer is refused, not read as
/// naming no model.
pub(super) const MODEL_FIELD_MAX: usize = 512;

/// The longest boundary (RFC 2046, §5.1.1).
const BOUNDARY_MAX: usize = 70;

/// Why a form's `model` field is refused (400 `invalid_request_body`).
#[derive(Debug, thiserror::Error)]
pub(super) enum FormError {
    /// Longer than [`MODEL_FIELD_MAX`].
    #[error("the form's `model` field is longer than {MODEL_FIELD_MAX} bytes")]
    ModelTooLong,
    /// Not UTF-8.
    #[error("the form's `model` field is not UTF-8")]
    ModelNotUtf8,
}

/// The boundary of a `multipart/form-data` content type (its `boundary` parameter,
/// quoted or not, of 1 to 70 bytes); `None` for any other type.
pub(super) fn boundary(content_type: &HeaderValue) -> Option<Vec<u8>> {
    let value = content_type.as_bytes();
    let (kind, rest) = match memchr::memchr(b';', value) {
        Some(i) => (&value[..i], &value[i..]),
        None => return None,
    };
    if !kind
        .trim_ascii()
        .eq_ignore_ascii_case(b"multipart/form-data")
    {
        return None;
    }
    let b = params(rest)
        .find(|(k, _)| k.eq_ignore_ascii_case(b"boundary"))?
        .1;
    (!b.is_empty() && b.len() <= BOUNDARY_MAX).then(|| b.into_owned())
}

/// The value of the last `model` field of `body`, a form delimited by `boundary`.
///
/// # Errors
///
/// [`FormError`] when that field is longer than [`MODEL_FIELD_MAX`] or not UTF-8.
pub(super) fn model(body: &[u8], boundary: &[u8]) -> Result<Option<String>, FormError> {
    let delimiter = [b"\r\n--", boundary].concat();
    let finder = memmem::Finder::new(&delimiter);
    // The first delimiter opens the body, or ends a preamble.
    let mut at = if body.starts_with(&delimiter[2..]) {
        delimiter.len() - 2
    } else {
        match finder.find(body) {
            Some(i) => i + delimiter.len(),
            None => return Ok(None),
        }
    };
    let mut found = None;
    loop {
        let rest = &body[at..];
        // The close delimiter, or no line end after the delimiter (transport padding
        // only): the form ends.
        if rest.starts_with(b"--") {
            break;
        }
        let Some(eol) = memmem::find(rest, b"\r\n") else {
            break;
        };
        if !rest[..eol].iter().all(|b| *b == b' ' || *b == b'\t') {
            break;
        }
        let start = at + eol + 2;
        // A part without the delimiter after it is cut off: not read.
        let Some(len) = finder.find(&body[start..]) else {
            break;
        };
        let part = &body[start..start + len];
        at = start + len + delimiter.len();
        let (head, data) = if let Some(data) = part.strip_prefix(b"\r\n") {
            (&[][..], data)
        } else {
            match memmem::find(part, b"\r\n\r\n") {
                Some(i) => (&part[..i], &part[i + 4..]),
                None => continue,
            }
        };
        if names_model(head) {
            if data.len() > MODEL_FIELD_MAX {
                return Err(FormError::ModelTooLong);
            }
            let value = std::str::from_utf8(data).map_err(|_| FormError::ModelNotUtf8)?;
            found = Some(value.to_owned());
        }
    }
    Ok(found)
}

/// Whether the header lines `head` of a part name the field `model` in their
/// `content-disposition`, and not as a file.
fn names_model(head: &[u8]) -> bool {
    let lines = head.split(|b| *b == b'\n').map(|l| l.trim_ascii());
    let Some(value) = lines
        .filter_map(|l| {
            let colon = memchr::memchr(b':', l)?;
            let name = l[..colon].trim_ascii();
            name.eq_ignore_ascii_case(b"content-disposition")
                .then(|| &l[colon + 1..])
        })
        // The last, as the engines' form parser keeps it.
        .next_back()
    else {
        return false;
    };
    let rest = match memchr::memchr(b';', value) {
        Some(i) => &value[i..],
        None => return false,
    };
    let mut name = None;
    for (key, v) in params(rest) {
        if key.eq_ignore_ascii_case(b"filename") || key.eq_ignore_ascii_case(b"filename*") {
            return false;
        }
        if key.eq_ignore_ascii_case(b"name") {
            name = Some(v);
        }
    }
    name.is_some_and(|n| *n == *b"model")
}

/// The parameters of a header value's `rest` (from its first `;`): each name and its
/// value, unquoted (in a quoted value, `\"` and `\\` are the character escaped).
fn params(rest: &[u8]) -> impl Iterator<Item = (&[u8], Cow<'_, [u8]>)> {
    let mut i = 0;
    std::iter::from_fn(move || {
        loop {
            // At a `;`, or the end.
            if i >= rest.len() {
                return None;
            }
            i += 1;
            let key_start = i;
            while i < rest.len() && rest[i] != b'=' && rest[i] != b';' {
                i += 1;
            }
            let key = rest[key_start..i].trim_ascii();
            if i >= rest.len() || rest[i] == b';' {
                // A parameter without a value: skipped.
                continue;
            }
            i += 1;
            while i < rest.len() && (rest[i] == b' ' || rest[i] == b'\t') {
                i += 1;
            }
            let value = if rest.get(i) == Some(&b'"') {
                i += 1;
                let mut out = Vec::new();
                while i < rest.len() && rest[i] != b'"' {
                    // Only `\"` and `\\` are escapes (as Python's `email.utils.unquote`
                    // takes them): any other backslash is itself.
                    if rest[i] == b'\\' && matches!(rest.get(i + 1), Some(b'"' | b'\\')) {
                        i += 1;
                    }
                    out.push(rest[i]);
                    i += 1;
                }
                // Past the closing quote, to the next `;`.
                while i < rest.len() && rest[i] != b';' {
                    i += 1;
                }
                Cow::Owned(out)
            } else {
                let start = i;
                while i < rest.len() && rest[i] != b';' {
                    i += 1;
                }
                Cow::Borrowed(rest[start..i].trim_ascii())
            };
            return Some((key, value));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ct(v: &'static str) -> HeaderValue {
        HeaderValue::from_static(v)
    }

    #[test]
    fn the_boundary_is_read_from_a_form_type_only() {
        let b = |v| boundary(&ct(v));
        assert_eq!(b("multipart/form-data; boundary=abc").unwrap(), b"abc");
        assert_eq!(
            b(r#"Multipart/Form-Data;charset=utf-8; BOUNDARY="a b;c""#).unwrap(),
            b"a b;c"
        );
        assert_eq!(b("multipart/mixed; boundary=abc"), None);
        assert_eq!(b("application/json"), None);
        assert_eq!(b("multipart/form-data"), None);
        assert_eq!(b("multipart/form-data; boundary="), None);
        assert_eq!(b(r#"multipart/form-data; boundary="""#), None);
        let long = format!("multipart/form-data; boundary={}", "x".repeat(71));
        assert_eq!(boundary(&HeaderValue::from_str(&long).unwrap()), None);
    }

    #[test]
    fn the_last_model_field_of_the_parts_heads_is_read() {
        let body = b"preamble\r\n--xx\r\n\
            Content-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n\r\n\
            \r\n--x not a delimiter\r\nname=\"model\"\r\n\r\nno\r\n--xx  \r\n\
            content-disposition: form-data; name=model\r\n\r\nfirst\r\n--xx\r\n\
            CONTENT-DISPOSITION:form-data; NAME=\"model\"\r\ncontent-type: text/plain\r\n\r\nsecond\r\n\
            --xx--\r\nepilogue\r\n--xx\r\ncontent-disposition: form-data; name=model\r\n\r\nafter\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap().as_deref(), Some("second"));
        // A file named `model` is no field; a part cut off is not read.
        let file = b"--xx\r\ncontent-disposition: form-data; name=\"model\"; filename=\"a\"\r\n\r\nf\r\n--xx--";
        assert_eq!(model(file, b"xx").unwrap(), None);
        let cut = b"--xx\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nm";
        assert_eq!(model(cut, b"xx").unwrap(), None);
        // No headers, no delimiter at all: nothing.
        assert_eq!(model(b"--xx\r\n\r\nm\r\n--xx--", b"xx").unwrap(), None);
        assert_eq!(model(b"{\"model\":\"m\"}", b"xx").unwrap(), None);
        // An empty value is the field's.
        let empty = b"--xx\r\ncontent-disposition: form-data; name=model\r\n\r\n\r\n--xx--";
        assert_eq!(model(empty, b"xx").unwrap().as_deref(), Some(""));
    }

    #[test]
    fn a_model_field_past_the_ceiling_or_not_utf8_is_refused() {
        let field = |v: &[u8]| {
            let head = b"--b\r\ncontent-disposition: form-data; name=model\r\n\r\n";
            [&head[..], v, b"\r\n--b--"].concat()
        };
        let at = "m".repeat(MODEL_FIELD_MAX);
        assert_eq!(model(&field(at.as_bytes()), b"b").unwrap(), Some(at));
        let past = "m".repeat(MODEL_FIELD_MAX + 1);
        assert!(matches!(
            model(&field(past.as_bytes()), b"b"),
            Err(FormError::ModelTooLong)
        ));
        assert!(matches!(
            model(&field(b"\xff"), b"b"),
            Err(FormError::ModelNotUtf8)
        ));
    }

    #[test]
    fn quoted_parameters_unescape_as_python_does() {
        let got: Vec<_> = params(br#"; name="a\"b\\c\d;e" ; x ; filename = f.wav"#).collect();
        assert_eq!(got[0].0, b"name");
        assert_eq!(&*got[0].1, br#"a"b\c\d;e"#);
        assert_eq!((got[1].0, &*got[1].1), (&b"filename"[..], &b"f.wav"[..]));
        assert_eq!(got.len(), 2);
    }
}
