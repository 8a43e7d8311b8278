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
//! the engines' form parser (Starlette over `python-multipart`, whose parameters the
//! standard library's `email` package reads) reads it: the form opening with its first
//! delimiter, a delimiter followed by anything but CRLF or `--` part of the data,
//! header and parameter names in any case, the name quoted or not or spelled as RFC
//! 2231 has it (`name*=utf-8''model`), the last of a repeated parameter winning
//! (`boundary` included), a part with a `filename` a file (no field), and the last of
//! repeated fields winning. A body that does not parse as a form names no model here;
//! the engine answers it.

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

/// The boundary of a `multipart/form-data` content type (its `boundary` parameter as
/// [`param`] reads it, of 1 to 70 bytes); `None` for any other type.
pub(super) fn boundary(content_type: &HeaderValue) -> Option<Vec<u8>> {
    let value = content_type.as_bytes();
    let kind = &value[..memchr::memchr(b';', value)?];
    if !kind
        .trim_ascii()
        .eq_ignore_ascii_case(b"multipart/form-data")
    {
        return None;
    }
    let b = param(value, b"boundary").ok()??;
    (!b.is_empty() && b.len() <= BOUNDARY_MAX).then_some(b)
}

/// The value of the last `model` field of `body`, a form delimited by `boundary`.
///
/// # Errors
///
/// [`FormError`] when that field is longer than [`MODEL_FIELD_MAX`] or not UTF-8.
pub(super) fn model(body: &[u8], boundary: &[u8]) -> Result<Option<String>, FormError> {
    let delimiter = [b"\r\n--", boundary].concat();
    let finder = memmem::Finder::new(&delimiter);
    // The first delimiter opens the body, after any line breaks: no preamble (the
    // engines' parser refuses one).
    let open = body
        .iter()
        .position(|b| *b != b'\r' && *b != b'\n')
        .unwrap_or(body.len());
    if !body[open..].starts_with(&delimiter[2..]) {
        return Ok(None);
    }
    let mut at = open + delimiter.len() - 2;
    let mut found = None;
    // Past a delimiter: CRLF opens a part; `--` closes the form (anything else there is
    // refused by the engines' parser).
    while body[at..].starts_with(b"\r\n") {
        let start = at + 2;
        // A part without the delimiter after it is cut off: not read.
        let Some(end) = part_end(&finder, body, start) else {
            break;
        };
        let part = &body[start..end];
        at = end + delimiter.len();
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

/// Where the part starting at `start` of `body` ends: at the first delimiter `finder`
/// finds that is followed by CRLF (another part) or `--` (the form's end). A delimiter
/// followed by anything else (a space, a tab, a third dash) is the part's data, as the
/// engines' parser reads it. `None` when the part is cut off.
fn part_end(finder: &memmem::Finder<'_>, body: &[u8], start: usize) -> Option<usize> {
    let mut from = start;
    loop {
        let at = from + finder.find(&body[from..])?;
        let after = &body[at + finder.needle().len()..];
        if after.starts_with(b"\r\n") || after.starts_with(b"--") {
            return Some(at);
        }
        from = at + 1;
    }
}

/// Whether the header lines `head` of a part name the field `model` in their
/// `content-disposition`, and not as a file.
fn names_model(head: &[u8]) -> bool {
    // Lines end with CRLF, as the engines' parser reads them (a lone LF is within a
    // value); a header's value starts after its colon.
    let Some(value) = crlf_lines(head)
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
    // A `filename` (however spelled) makes the part a file; a header Python cannot
    // read names nothing.
    match (param(value, b"filename"), param(value, b"name")) {
        (Ok(None), Ok(Some(name))) => name == b"model",
        _ => false,
    }
}

/// The lines of `head`, each without the CRLF that ends it.
fn crlf_lines(head: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    let mut starts = vec![0];
    starts.extend(memmem::find_iter(head, b"\r\n").map(|i| i + 2));
    let ends: Vec<usize> = starts
        .iter()
        .skip(1)
        .map(|s| s - 2)
        .chain([head.len()])
        .collect();
    starts.into_iter().zip(ends).map(move |(s, e)| &head[s..e])
}

/// A header value Python's `email` package cannot read (RFC 2231 pieces numbered and
/// unnumbered under one name, which it fails to sort): the engine's form parser fails
/// on it, so it names nothing here.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Unreadable;

/// The value the engines' form parser gives the parameter `name` (lowercase ASCII) of
/// the header `value` (`python-multipart`'s `parse_options_header`, over
/// `email.message.Message.get_params`): `None` when the value has no `;` or no such
/// parameter.
///
/// As Python reads it: parameters split at each `;` outside a quoted run, a name
/// lowercased (one without `=` kept as it is, with an empty value), a value quoted
/// (`\"` and `\\` escapes) or in angle brackets unwrapped; the last of a name wins,
/// except that one spelled as RFC 2231 has it (`name*=utf-8''model`, or in pieces
/// `name*0`, `name*1*`: put in order, percent-decoded where marked, the charset and
/// language dropped) wins over the plain ones wherever it stands.
///
/// # Errors
///
/// [`Unreadable`] when Python would fail on the value.
pub(super) fn param(value: &[u8], name: &[u8]) -> Result<Option<Vec<u8>>, Unreadable> {
    if memchr::memchr(b';', value).is_none() {
        return Ok(None);
    }
    let mut plain = None;
    // Each group of RFC 2231 pieces by its name, in the order the names first came:
    // (its name, its pieces: number, value, percent-encoded).
    let mut pieces: Vec<(Vec<u8>, Vec<Piece>)> = Vec::new();
    // The first segment is the header's own value (`form-data`), no parameter.
    for (key, v) in segments(value).skip(1) {
        let encoded = key.ends_with(b"*");
        let v = unquote(&v);
        match rfc2231_name(&key) {
            Some((base, number)) => {
                let piece = Piece {
                    number,
                    value: v,
                    encoded,
                };
                match pieces.iter_mut().find(|(n, _)| *n == base) {
                    Some((_, group)) => group.push(piece),
                    None => pieces.push((base.to_vec(), vec![piece])),
                }
            }
            None if key == name => plain = Some(v),
            None => {}
        }
    }
    // Every group is put together (one Python cannot read fails the whole value); the
    // RFC 2231 ones come after the plain ones, so theirs win.
    let mut spelled = None;
    for (base, group) in pieces {
        let joined = join_pieces(group)?;
        if base == name {
            spelled = Some(joined);
        }
    }
    Ok(spelled.or(plain))
}

/// One piece of an RFC 2231 parameter: its number (`None` for `name*`; the digits
/// without leading zeros, compared as numbers), its value, and whether it is
/// percent-encoded (its name ends with `*`).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Piece {
    number: Option<Vec<u8>>,
    value: Vec<u8>,
    encoded: bool,
}

/// The pieces of one RFC 2231 parameter put together as Python's
/// `email.utils.decode_params` does: sorted (by number, then value), the encoded ones
/// percent-decoded, joined; when any was encoded, what follows the second `'` (past the
/// charset and language), if there are two.
fn join_pieces(mut group: Vec<Piece>) -> Result<Vec<u8>, Unreadable> {
    // Python compares a number with none, and fails.
    let numbered = group.iter().filter(|p| p.number.is_some()).count();
    if numbered != 0 && numbered != group.len() {
        return Err(Unreadable);
    }
    group.sort_by(|a, b| {
        let n = |p: &Piece| p.number.as_ref().map(|d| (d.len(), d.clone()));
        n(a).cmp(&n(b))
            .then_with(|| a.value.cmp(&b.value))
            .then_with(|| a.encoded.cmp(&b.encoded))
    });
    let extended = group.iter().any(|p| p.encoded);
    let mut joined = Vec::new();
    for p in group {
        if p.encoded {
            joined.extend(percent_decoded(&p.value));
        } else {
            joined.extend(p.value);
        }
    }
    // Python quotes the joined value, splits it, and unquotes the part it keeps: the
    // quoting leaves the `'` alone, so the kept part is as it was.
    if extended {
        let mut ticks = memchr::memchr_iter(b'\'', &joined);
        if let (Some(_), Some(second)) = (ticks.next(), ticks.next()) {
            joined.drain(..=second);
        }
    }
    Ok(joined)
}

/// The base name and number of an RFC 2231 parameter name (`name*`, `name*0`,
/// `name*0*`, the name of ASCII letters, digits and `_`); `None` for a plain name.
fn rfc2231_name(key: &[u8]) -> Option<(&[u8], Option<Vec<u8>>)> {
    let star = memchr::memchr(b'*', key)?;
    let (base, rest) = (&key[..star], &key[star + 1..]);
    if base.is_empty() || !base.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_') {
        return None;
    }
    if rest.is_empty() {
        return Some((base, None));
    }
    let digits = rest.strip_suffix(b"*").unwrap_or(rest);
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let first = digits
        .iter()
        .position(|d| *d != b'0')
        .unwrap_or(digits.len());
    Some((base, Some(digits[first..].to_vec())))
}

/// `%XX` (two hex digits) decoded to its byte; any other `%` left as it is.
fn percent_decoded(v: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i] == b'%'
            && let (Some(h), Some(l)) = (
                v.get(i + 1).and_then(|b| hex(*b)),
                v.get(i + 2).and_then(|b| hex(*b)),
            )
        {
            // Two hex digits: at most 0xff.
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'%'));
            i += 3;
        } else {
            out.push(v[i]);
            i += 1;
        }
    }
    out
}

/// Python's `email.utils.unquote`: a value in double quotes loses them, and `\\` then
/// `\"` become the character escaped (one replacement after the other, as Python's);
/// one in angle brackets loses them.
fn unquote(v: &[u8]) -> Vec<u8> {
    if v.len() > 1 && v.starts_with(b"\"") && v.ends_with(b"\"") {
        let inner = replace(&v[1..v.len() - 1], b"\\\\", b"\\");
        return replace(&inner, b"\\\"", b"\"");
    }
    if v.len() > 1 && v.starts_with(b"<") && v.ends_with(b">") {
        return v[1..v.len() - 1].to_vec();
    }
    v.to_vec()
}

/// `v` with each `from` (two bytes), left to right and not overlapping, replaced by
/// `to` (Python's `str.replace`).
fn replace(v: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(v[i]);
            i += 1;
        }
    }
    out
}

/// Python's whitespace among the bytes of a header value read as Latin-1 (what
/// `str.strip` removes).
fn py_space(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c | 0x1c..=0x1f | 0x85 | 0xa0
    )
}

/// `v` without Python's whitespace at either end.
fn py_strip(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| !py_space(*b)).unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !py_space(*b))
        .map_or(start, |e| e + 1);
    &v[start..end.max(start)]
}

/// The segments of a header value as Python's `email.message._parseparam` splits them:
/// at each `;` after which the `"` not preceded by `\\` so far are even; each its name
/// (lowercased when it has a `=`, kept as it is otherwise) and its value (empty without
/// `=`), both stripped. The first is the header's own value.
fn segments(value: &[u8]) -> impl Iterator<Item = (Vec<u8>, Vec<u8>)> + '_ {
    let mut rest = Some(value);
    std::iter::from_fn(move || {
        let s = rest?;
        // The quotes counted so far, from the segment's start: linear, however many
        // `;` are quoted.
        let mut quotes: usize = 0;
        let mut from = 0;
        let end = loop {
            let Some(i) = memchr::memchr(b';', &s[from..]).map(|i| from + i) else {
                break s.len();
            };
            let run = &s[from..i];
            quotes += memchr::memchr_iter(b'"', run).count();
            quotes -= memmem::find_iter(run, b"\\\"").count();
            if i == 0 || quotes.is_multiple_of(2) {
                break i;
            }
            from = i + 1;
        };
        rest = s.get(end + 1..).filter(|_| end < s.len());
        let seg = &s[..end];
        Some(match memchr::memchr(b'=', seg) {
            Some(eq) => (
                py_strip(&seg[..eq]).to_ascii_lowercase(),
                py_strip(&seg[eq + 1..]).to_vec(),
            ),
            None => (py_strip(seg).to_vec(), Vec::new()),
        })
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
    fn the_last_boundary_wins_and_rfc_2231_spells_one() {
        let b = |v| boundary(&ct(v));
        // Python keeps the last of a repeated parameter.
        assert_eq!(
            b("multipart/form-data; boundary=first; boundary=last").unwrap(),
            b"last"
        );
        // One spelled as RFC 2231 has it wins wherever it stands.
        assert_eq!(
            b("multipart/form-data; boundary*=utf-8''x%79z; boundary=plain").unwrap(),
            b"xyz"
        );
    }

    #[test]
    fn the_last_model_field_of_the_parts_heads_is_read() {
        // The real field, then a file whose bytes look like a part's head naming
        // another model: a scan of the data would read `llama`.
        let body = b"\r\n--xx\r\n\
            content-disposition: form-data; name=model\r\n\r\nfirst\r\n--xx\r\n\
            CONTENT-DISPOSITION:form-data; NAME=\"model\"\r\ncontent-type: text/plain\r\n\r\nwhisper\r\n\
            --xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n\r\n\
            RIFF\r\n--x not a delimiter\r\n\r\n--xx\tnor this\r\n\
            content-disposition: form-data; name=\"model\"\r\n\r\nllama\r\n--xx--\r\n\
            epilogue\r\n--xx\r\ncontent-disposition: form-data; name=model\r\n\r\nafter\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap().as_deref(), Some("whisper"));
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
    fn a_delimiter_not_followed_by_a_line_break_is_data() {
        // Spaces after a delimiter in the middle of the body: python-multipart takes
        // it, and the part after it, as the data of the part before (here, a field
        // that is no model).
        let body = b"--xx\r\ncontent-disposition: form-data; name=language\r\n\r\nen\r\n\
            --xx  \r\ncontent-disposition: form-data; name=model\r\n\r\nllama\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap(), None);
        let tab = b"--xx\r\ncontent-disposition: form-data; name=model\r\n\r\nwhisper\r\n\
            --xx\t\r\nx\r\n--xx--";
        let value = model(tab, b"xx").unwrap();
        assert_eq!(value.as_deref(), Some("whisper\r\n--xx\t\r\nx"));
        // So is a third dash, or anything else.
        let body = b"--xx\r\ncontent-disposition: form-data; name=language\r\n\r\nen\r\n\
            --xx-x\r\ncontent-disposition: form-data; name=model\r\n\r\nllama\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap(), None);
        // The first delimiter too must end its line at once, and the form open with it
        // (no preamble): the engines' parser refuses anything else.
        let body = b"--xx \r\ncontent-disposition: form-data; name=model\r\n\r\nm\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap(), None);
        let body =
            b"preamble\r\n--xx\r\ncontent-disposition: form-data; name=model\r\n\r\nm\r\n--xx--";
        assert_eq!(model(body, b"xx").unwrap(), None);
    }

    #[test]
    fn a_name_spelled_as_rfc_2231_has_it_is_read() {
        let one = |disposition: &str| {
            let body = format!("--b\r\ncontent-disposition: {disposition}\r\n\r\nwhisper\r\n--b--");
            model(body.as_bytes(), b"b").unwrap()
        };
        assert_eq!(
            one("form-data; name*=utf-8''model").as_deref(),
            Some("whisper")
        );
        // It wins over a plain name, before or after it; in pieces too.
        assert_eq!(
            one("form-data; name*=utf-8''%6Dodel; name=other").as_deref(),
            Some("whisper")
        );
        assert_eq!(
            one("form-data; name*0*=utf-8'en'mo; name*1=del").as_deref(),
            Some("whisper")
        );
        assert_eq!(one("form-data; name=model; name*=utf-8''other"), None);
        // A `filename` spelled so is a file.
        assert_eq!(one("form-data; name=model; filename*=utf-8''a.wav"), None);
    }

    #[test]
    fn parameters_read_as_pythons_email_package_reads_them() {
        // What Python 3's `email.message.Message.get_params`, as python-multipart's
        // `parse_options_header` keeps it, gives `name` for each value.
        type Want = Result<Option<&'static [u8]>, Unreadable>;
        let cases: &[(&[u8], Want)] = &[
            (b"form-data; name=model", Ok(Some(b"model"))),
            (b"form-data; name*=utf-8''model", Ok(Some(b"model"))),
            (
                b"form-data; name*=utf-8''%6Dodel; name=x",
                Ok(Some(b"model")),
            ),
            (b"form-data; name*0=mo; name*1=del", Ok(Some(b"model"))),
            (
                b"form-data; name*0*=utf-8''m%6F; name*1=del",
                Ok(Some(b"model")),
            ),
            (b"form-data; NAME*=utf-8'en'model", Ok(Some(b"model"))),
            (br#"form-data; name="model" x"#, Ok(Some(br#""model" x"#))),
            (b"form-data; name=<model>", Ok(Some(b"model"))),
            (b"form-data; name=model; name", Ok(Some(b""))),
            (b"form-data; name=model; NAME", Ok(Some(b"model"))),
            (br#"form-data; name=a"b;c""#, Ok(Some(br#"a"b;c""#))),
            (br#"form-data; name="a\\"b""#, Ok(Some(br#"a"b"#))),
            (br#"form-data; name="mo\del""#, Ok(Some(br#"mo\del"#))),
            (br#"form-data; x="a;b"; name=model"#, Ok(Some(b"model"))),
            (b"form-data; name*=a; name*=b", Ok(Some(b"ab"))),
            (b"form-data; name*=model; name*0=x", Err(Unreadable)),
            (b"form-data; x*=a; x*0=b; name=model", Err(Unreadable)),
            (b"form-data", Ok(None)),
            (b"form-data; filename=model", Ok(None)),
        ];
        for (value, want) in cases {
            let want = match want {
                Ok(w) => Ok(w.map(<[u8]>::to_vec)),
                Err(Unreadable) => Err(Unreadable),
            };
            let value_text = String::from_utf8_lossy(value);
            assert_eq!(param(value, b"name"), want, "{value_text}");
        }
        // A bare `filename` is a file's.
        assert_eq!(
            param(b"form-data; name=model; filename", b"filename"),
            Ok(Some(Vec::new()))
        );
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
}
