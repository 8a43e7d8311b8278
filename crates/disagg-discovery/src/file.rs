//! The endpoints file (`--endpoints-file PATH`): prefill, decode and encoder engines
//! listed in TOML, reloaded when the file changes.
//!
//! ```toml
//! [[prefill]]
//! url = "http://10.0.0.5:8100"
//! bootstrap_port = 8998                 # as the second value of --prefill
//! model = "llama-3-8b"                  # or a list: ["a", "b"] (--served-model), trimmed
//!                                       # (at most 256 names of at most 512 bytes)
//! ranks = "0-1"                         # data-parallel ranks: URL@0, URL@1
//! weight = 2.0                          # for weighted_random (--weight)
//! kv_profile = "NixlConnector,kv_producer,8"   # as --kv-profile, or a table:
//! # kv_profile = { connector = "NixlConnector", role = "kv_producer", tp = 8 }
//! kv_events = "tcp://10.0.0.5:5557"     # the engine's KV-events publisher (tcp://HOST:PORT)
//! facts = { my_engine_id = "p-0" }      # protocol facts for a connector (Endpoint::facts)
//!
//! [[decode]]
//! url = "http://10.0.0.7:8200"
//! lmcache_receiver = "10.0.0.7:7300:7400"      # as --lmcache-receiver (decode only;
//!                                               # an IPv6 host in brackets: [fd00::7]:7300:7400)
//!
//! [[encode]]                            # an encoder-only engine (E/P/D), as --encode
//! url = "http://10.0.0.9:8300"
//! ec_profile = "ECExampleConnector,ec_producer"   # as --ec-profile (any role's engine)
//! ```
//!
//! # Reloading
//!
//! The file is polled (every second by default): read whole and compared with what was
//! read before. A change is taken once the file reads the same again after
//! [`FileConfig::settle`] (100 ms by default): a file rewritten in place (`>`
//! redirection, `kubectl cp`: truncated, then written) can be read empty, or cut
//! between two entries, and such a read, valid as it may be, would remove engines for
//! a poll interval. A change is thus in force within about one interval and the settle
//! delay; a file that never reads the same twice in a row is not taken until it does.
//! The first read, at start, is taken as it is. Each poll is counted once its outcome
//! is taken ([`SourceStats::polls`](crate::SourceStats::polls)). Polling, rather than
//! inotify through the `notify` crate, because the ways such a file is replaced defeat a
//! watch on the file itself: a Kubernetes ConfigMap volume swaps a `..data` symlink to a
//! new directory, and editors save by renaming a new file over the old one; both leave
//! an inotify watch on the old inode. Reading a small file once a second costs nothing
//! measurable, needs no thread and no dependency, and compares content (not
//! modification times, whose granularity can hide two edits in one second).
//!
//! # Failures keep the last good list
//!
//! - An edit that does not parse, or names an engine that makes no endpoint (a bad URL,
//!   one longer than [`MAX_URL_BYTES`](crate::spec::MAX_URL_BYTES) (2 KiB: checked
//!   once, before anything is made per rank), a link-local or cloud metadata address, a decode with a bootstrap port, an LMCache
//!   receiver whose port lists differ, a `kv_events` that is not `tcp://HOST:PORT`, a
//!   connector name past [`MAX_CONNECTOR_NAME_BYTES`](crate::MAX_CONNECTOR_NAME_BYTES)
//!   bytes), or lists one engine twice, is refused whole: the last good list stays, the
//!   error is logged and counted ([`SourceStats::errors`](crate::SourceStats::errors))
//!   once per distinct content.
//! - So is an edit past a ceiling ([`FileConfig::bounds`]): an engine with more
//!   data-parallel ranks than `max_ranks` (1,024 by default), or more endpoints in all,
//!   ranks counted, than `max_endpoints` (4,096 by default), or an engine declaring
//!   more than 256 distinct models
//!   ([`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE)) or a model name
//!   longer than [`MAX_MODEL_NAME_BYTES`] (512 bytes). Ranks are counted from the range,
//!   never expanded first, model names checked as they are read, and such an edit is
//!   also counted in [`SourceStats::over_limit`](crate::SourceStats::over_limit).
//! - A deleted (or unreadable) file also keeps the last good list, logged and counted
//!   once: deletion is more often an accident or a step of a replacement than an intent
//!   to drain every engine. To remove every engine, write a file with no entries.
//! - The path must name a regular file (symlinks to one are followed): a FIFO, a socket
//!   or a device is refused without being opened for a blocking read, and a read that
//!   does not finish within [`FileConfig::read_timeout`] (5 s; a hung network volume) is
//!   an error; both are unreadable states, logged and counted as above, and the next
//!   poll tries again. No read can stop the polling, or hold the proxy at shutdown
//!   ([`disagg_files`]).
//! - A file larger than [`FileConfig::max_file_bytes`] (1 KiB for each endpoint
//!   allowed, at least [`MAX_FILE_BYTES`]: 4 MiB by default, about twice what 4,096
//!   engines written out in full take) is refused before it is parsed, as an unreadable
//!   one is ([`FileError::TooLarge`]); a file is parsed on a blocking thread, off the
//!   runtime's workers.
//! - At start, a missing, unreadable or invalid file is an error of [`spawn`]: the proxy
//!   should not start on a configuration it cannot read.

use std::path::PathBuf;
use std::time::Duration;

use disagg_core::Role;
use disagg_core::endpoint::Facts;
use disagg_files::TimedReader;
use serde::Deserialize;

use crate::source::{SpecPublisher, SpecSource};
use crate::spec::{
    Bounds, DistinctNames, EndpointSpec, MAX_MODEL_NAME_BYTES, ModelsError, Ranks, endpoint_count,
    identity_or_id, model_names, parse_kv_profile, parse_kv_role, parse_tp,
};

/// The default source name of the endpoints file (the `source` label of its metrics).
pub const SOURCE_NAME: &str = "file";

/// The largest endpoints file read by default, and the least ceiling
/// ([`FileConfig::max_file_bytes`]), 4 MiB: about twice what the most engines a source
/// may contribute by default (4,096) take written out in full (every key, long host
/// names, three models each: 2.2 MB), low enough that a wrong path (a log file, a
/// device) or a hostile edit cannot exhaust memory (the TOML parser holds a value for
/// each of the file's values before the file is checked: 4 MiB of empty arrays take
/// under 300 MB while parsed, on a blocking thread).
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// The bytes of file [`FileConfig::max_file_bytes`] allows for each endpoint: about
/// twice what an engine written out in full takes (540 bytes).
const FILE_BYTES_PER_ENDPOINT: u64 = 1024;

/// Where the endpoints file is and how often it is checked (`--endpoints-file`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FileConfig {
    /// The TOML file.
    pub path: PathBuf,
    /// How often the file is read and compared: 1 s by default, so that a change is in
    /// force within 2 s. Zero is refused ([`FileError::PollInterval`]).
    pub poll_interval: Duration,
    /// How long after a read that found the file changed it is read again, to be taken
    /// only if both reads are the same (a file caught mid-write is not): 100 ms by
    /// default. A writer pausing longer than this between truncating the file and
    /// finishing it can still be caught; an atomic replacement (a new file renamed over
    /// it, as editors and ConfigMap volumes do) never is.
    pub settle: Duration,
    /// The source's name in metrics and logs ([`SOURCE_NAME`] by default).
    pub name: String,
    /// The ceilings and the address rule the file's engines are held to (ranks per
    /// engine, endpoints in the file, link-local and metadata addresses refused).
    pub bounds: Bounds,
    /// How long one read of the file may take (5 s by default); past it the read is an
    /// error and the last good list stays.
    pub read_timeout: Duration,
}

impl FileConfig {
    /// The file at `path`, polled every second, within the default [`Bounds`].
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileConfig {
            path: path.into(),
            poll_interval: Duration::from_secs(1),
            settle: Duration::from_millis(100),
            name: SOURCE_NAME.to_owned(),
            bounds: Bounds::default(),
            read_timeout: Duration::from_secs(5),
        }
    }

    /// The largest file read: 1 KiB for each endpoint the bounds allow
    /// ([`Bounds::max_endpoints`]), at least [`MAX_FILE_BYTES`] (4 MiB, the ceiling for
    /// the default 4,096 endpoints), so that a file within a raised endpoint ceiling is
    /// not refused for its size. What parsing the file may take grows with it (about
    /// 70 bytes for each byte of a file of empty arrays).
    pub fn max_file_bytes(&self) -> u64 {
        u64::try_from(self.bounds.max_endpoints)
            .unwrap_or(u64::MAX)
            .saturating_mul(FILE_BYTES_PER_ENDPOINT)
            .max(MAX_FILE_BYTES)
    }
}

/// The endpoints file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The file could not be read.
    #[error("cannot read endpoints file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than any endpoints file should be
    /// ([`FileConfig::max_file_bytes`]).
    #[error("endpoints file {path} is larger than {max_bytes} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The ceiling it is past.
        max_bytes: u64,
    },
    /// The content is not a valid endpoints file.
    #[error("invalid endpoints file: {0}")]
    Invalid(String),
    /// The file makes more endpoints, or gives an engine more ranks, than its
    /// [`Bounds`] allow, or an engine declares more models, or a longer model name,
    /// than [`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE)
    /// and [`MAX_MODEL_NAME_BYTES`] allow.
    #[error("endpoints file over its ceiling: {0}")]
    OverLimit(String),
    /// [`FileConfig::poll_interval`] is zero.
    #[error("the endpoints file's poll interval must be longer than zero")]
    PollInterval,
}

/// Parses the text of an endpoints file into specs (prefill first, in file order),
/// within the default [`Bounds`].
///
/// Every entry is checked as an endpoint would be built from it, so that an invalid
/// entry refuses the whole file.
///
/// # Errors
///
/// [`FileError::Invalid`] naming the first problem: TOML syntax, an unknown key, a bad
/// URL (a link-local or cloud metadata address included, or one longer than
/// [`MAX_URL_BYTES`](crate::spec::MAX_URL_BYTES)), ranks, weight, KV profile or
/// LMCache receiver, KV-events endpoint or connector name, a bootstrap port on an engine
/// other than a prefill or an LMCache receiver on one other than a decode (as a named
/// key or in `facts`), or one engine listed twice for one role (its URL, however
/// spelled: `http://d:08200` is `http://d:8200`, or one of its ranks, in a range or
/// after an `@`); [`FileError::OverLimit`] for an engine with
/// more ranks, or a file with more endpoints, than the bounds allow, or an engine
/// declaring more models, or a longer model name, than
/// [`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE) and
/// [`MAX_MODEL_NAME_BYTES`] allow.
///
/// # Examples
///
/// ```
/// use disagg_discovery::file::parse;
///
/// let specs = parse(r#"
///     [[prefill]]
///     url = "http://10.0.0.5:8100"
///     bootstrap_port = 8998
///     [[decode]]
///     url = "http://10.0.0.7:8200"
///     model = ["llama", "llama-instruct"]
/// "#)?;
/// assert_eq!(specs[0].facts.get("bootstrap_port"), Some("8998"));
/// assert_eq!(specs[1].models, ["llama", "llama-instruct"]);
/// assert!(parse("[[decode]]\nurl = \"http://d:1\"\nbootstrap_port = 1\n").is_err());
/// # Ok::<(), disagg_discovery::file::FileError>(())
/// ```
pub fn parse(text: &str) -> Result<Vec<EndpointSpec>, FileError> {
    parse_within(text, &Bounds::default())
}

/// Like [`parse`], within `bounds`.
///
/// # Errors
///
/// As [`parse`].
pub fn parse_within(text: &str, bounds: &Bounds) -> Result<Vec<EndpointSpec>, FileError> {
    let file: FileModel = toml::from_str(text).map_err(|e| FileError::Invalid(e.to_string()))?;
    let mut specs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (role, entries) in [
        (Role::Prefill, file.prefill),
        (Role::Decode, file.decode),
        (Role::Encode, file.encode),
    ] {
        for (i, entry) in entries.into_iter().enumerate() {
            let table = role.as_str();
            let place = format!("[[{table}]] #{}", i + 1);
            let invalid = |what: String| FileError::Invalid(format!("{place}: {what}"));
            // The models are held to their ceilings as the ranks are, as an over-limit
            // edit.
            if let Some(ModelField(Err(e))) = &entry.model {
                return Err(FileError::OverLimit(format!("{place}: model: {e}")));
            }
            let spec = entry.into_spec(role).map_err(invalid)?;
            // The URL measured before any copy of it is made.
            spec.check_url_len().map_err(|e| invalid(e.to_string()))?;
            // The ranks are counted before an endpoint is made for each of them.
            if let Some(ranks) = spec.ranks {
                ranks
                    .within(bounds.max_ranks)
                    .map_err(|e| FileError::OverLimit(format!("{place}: {e}")))?;
            }
            // One URL twice, however spelled (its ranks are compared below, once the
            // endpoints are known to be few enough to list).
            if !seen.insert((table, identity_or_id(&spec.url))) {
                return Err(invalid(format!("{} is listed twice", spec.url)));
            }
            specs.push(spec);
        }
    }
    let n = endpoint_count(&specs);
    if n > bounds.max_endpoints as u64 {
        return Err(FileError::OverLimit(format!(
            "{n} endpoints (ranks counted), more than the {} allowed per source",
            bounds.max_endpoints
        )));
    }
    // Each entry checked as it will be built: every endpoint made is within bounds now.
    let mut places = [0usize; 3];
    // Each engine (role and identity) once, numbered; each endpoint as its engine's
    // number and its rank: no id is written out per rank.
    let mut engines = std::collections::HashMap::new();
    let mut endpoints = std::collections::HashSet::new();
    for spec in &specs {
        let (table, k) = (
            spec.role.as_str(),
            usize::from(crate::source::role_order(spec.role)),
        );
        places[k] += 1;
        let invalid =
            |what: String| FileError::Invalid(format!("[[{table}]] #{}: {what}", places[k]));
        // The URL checked once (its length, its address) before anything per rank.
        spec.check_url(bounds).map_err(|e| invalid(e.to_string()))?;
        // A rank in two entries (`ranks = "0-1"` beside `URL@1`) is listed twice too.
        let (engine, ranks) = spec.endpoint_keys();
        let next = engines.len();
        let engine = *engines.entry((table, engine)).or_insert(next);
        for rank in ranks {
            if !endpoints.insert((engine, rank)) {
                let id = match (spec.ranks, rank) {
                    (Some(_), Some(rank)) => {
                        format!("{}@{rank}", spec.url.trim_end_matches('/'))
                    }
                    _ => spec.url.clone(),
                };
                return Err(invalid(format!("{id} is listed twice")));
            }
        }
        spec.to_endpoints_within(bounds)
            .map_err(|e| invalid(e.to_string()))?;
    }
    Ok(specs)
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileModel {
    #[serde(default)]
    prefill: Vec<EntryModel>,
    #[serde(default)]
    decode: Vec<EntryModel>,
    /// Encoder-only engines (E/P/D).
    #[serde(default)]
    encode: Vec<EntryModel>,
}

/// One `[[prefill]]`, `[[decode]]` or `[[encode]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryModel {
    url: String,
    bootstrap_port: Option<u16>,
    model: Option<ModelField>,
    ranks: Option<String>,
    weight: Option<f64>,
    kv_profile: Option<ProfileModel>,
    ec_profile: Option<String>,
    lmcache_receiver: Option<String>,
    kv_events: Option<String>,
    facts: Option<std::collections::BTreeMap<String, String>>,
}

/// `model`: one name or a list of names, read within the ceilings on an engine's
/// models as the TOML is read: a name past [`MAX_MODEL_NAME_BYTES`] is measured, not
/// copied, duplicates are looked up, not kept, and past
/// [`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE) distinct
/// names the rest of the list is skipped unread. What was past a ceiling is
/// kept as the error, for [`parse_within`] to refuse the file naming the entry.
#[derive(Debug)]
struct ModelField(Result<Vec<String>, ModelsError>);

impl<'de> Deserialize<'de> for ModelField {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ModelFieldVisitor)
    }
}

struct ModelFieldVisitor;

impl<'de> serde::de::Visitor<'de> for ModelFieldVisitor {
    type Value = ModelField;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a model name or a list of model names")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ModelField, E> {
        Ok(ModelField(model_names([v.trim()])))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<ModelField, A::Error> {
        let mut names = DistinctNames::default();
        let refused = loop {
            match seq.next_element::<ModelName>()? {
                None => return Ok(ModelField(Ok(names.into_vec()))),
                Some(ModelName::TooLong(len)) => {
                    break ModelsError::TooLong {
                        len,
                        max: MAX_MODEL_NAME_BYTES,
                    };
                }
                Some(ModelName::Name(name)) => {
                    if let Err(e) = names.push(name) {
                        break e;
                    }
                }
            }
        };
        // The rest of the list, skipped without a copy.
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(ModelField(Err(refused)))
    }
}

/// One name of a `model` list, trimmed (as the `disagg.io/models` annotation and
/// `--served-model` are): copied only within [`MAX_MODEL_NAME_BYTES`].
enum ModelName {
    Name(String),
    TooLong(usize),
}

impl<'de> Deserialize<'de> for ModelName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl serde::de::Visitor<'_> for NameVisitor {
            type Value = ModelName;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a model name")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ModelName, E> {
                let v = v.trim();
                Ok(match v.len() {
                    len if len > MAX_MODEL_NAME_BYTES => ModelName::TooLong(len),
                    _ => ModelName::Name(v.to_owned()),
                })
            }

            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<ModelName, E> {
                let trimmed = v.trim();
                Ok(match trimmed.len() {
                    len if len > MAX_MODEL_NAME_BYTES => ModelName::TooLong(len),
                    len if len == v.len() => ModelName::Name(v),
                    _ => ModelName::Name(trimmed.to_owned()),
                })
            }
        }
        d.deserialize_str(NameVisitor)
    }
}

/// `kv_profile`: the command line's `CONNECTOR,ROLE,TP`, or a table.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ProfileModel {
    Text(String),
    Table(ProfileTable),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileTable {
    connector: Option<String>,
    role: Option<String>,
    tp: Option<u32>,
}

impl EntryModel {
    fn into_spec(self, role: Role) -> Result<EndpointSpec, String> {
        let mut spec = EndpointSpec::new(self.url, role);
        // Generic facts first: the named keys below win over the same key given here.
        for (key, value) in self.facts.into_iter().flatten() {
            spec.facts.insert(&key, value).map_err(|e| e.to_string())?;
        }
        if let Some(port) = self.bootstrap_port {
            if role != Role::Prefill {
                return Err("bootstrap_port applies to prefill engines only".into());
            }
            spec.facts
                .insert(Facts::BOOTSTRAP_PORT, port.to_string())
                .map_err(|e| e.to_string())?;
        }
        spec.models = match self.model {
            None => Vec::new(),
            Some(ModelField(Ok(ms))) => ms,
            // Refused by `parse_within` before an entry is made into a spec.
            Some(ModelField(Err(e))) => return Err(e.to_string()),
        };
        // Trimmed as they were read.
        if spec.models.iter().any(String::is_empty) {
            return Err("a model name is empty".into());
        }
        spec.ranks = self
            .ranks
            .map(|r| r.parse::<Ranks>())
            .transpose()
            .map_err(|e| e.to_string())?;
        spec.weight = self.weight;
        spec.kv_profile = match self.kv_profile {
            None => None,
            Some(ProfileModel::Text(t)) => Some(parse_kv_profile(&t).map_err(|e| e.to_string())?),
            Some(ProfileModel::Table(t)) => {
                let role = t
                    .role
                    .as_deref()
                    .map(parse_kv_role)
                    .transpose()
                    .map_err(|e| e.to_string())?;
                let tp_size =
                    t.tp.map(|tp| parse_tp(&tp.to_string()))
                        .transpose()
                        .map_err(|e| e.to_string())?;
                let profile = disagg_pairing::KvProfile {
                    connector: t.connector,
                    role,
                    tp_size,
                };
                Some(profile)
            }
        };
        spec.ec_profile = self
            .ec_profile
            .map(|p| p.parse::<disagg_pairing::EcProfile>())
            .transpose()
            .map_err(|e| e.to_string())?;
        if let Some(r) = self.lmcache_receiver {
            if role != Role::Decode {
                return Err("lmcache_receiver applies to decode engines only".into());
            }
            spec.facts
                .insert(Facts::KV_RECEIVER, r)
                .map_err(|e| e.to_string())?;
        }
        // Checked, with the profiles' connector names and the facts' roles, where every
        // source's specs are (`EndpointSpec::extensions`, from `parse_within`).
        spec.kv_events = self.kv_events;
        crate::spec::check_facts(&spec.facts).map_err(|e| e.to_string())?;
        Ok(spec)
    }
}

/// Reads and parses the file.
async fn load(
    config: &FileConfig,
    reader: &TimedReader,
) -> Result<(Vec<u8>, Vec<EndpointSpec>), FileError> {
    let bytes = read(config, reader).await?;
    let specs = parse_blocking(&bytes, config.bounds).await?;
    Ok((bytes, specs))
}

/// [`parse_bytes`] on a blocking thread, off the runtime's workers: parsing up to
/// [`FileConfig::max_file_bytes`] of TOML takes a while.
async fn parse_blocking(bytes: &[u8], bounds: Bounds) -> Result<Vec<EndpointSpec>, FileError> {
    let bytes = bytes.to_vec();
    tokio::task::spawn_blocking(move || parse_bytes(&bytes, &bounds))
        .await
        .unwrap_or_else(|e| Err(FileError::Invalid(format!("the file's parse failed: {e}"))))
}

fn parse_bytes(bytes: &[u8], bounds: &Bounds) -> Result<Vec<EndpointSpec>, FileError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| FileError::Invalid("the file is not UTF-8 text".into()))?;
    parse_within(text, bounds)
}

/// The file's bytes: a regular file only, read on a thread of its own within the read
/// timeout (the file may sit on a slow or network file system, or be a FIFO).
async fn read(config: &FileConfig, reader: &TimedReader) -> Result<Vec<u8>, FileError> {
    let path = &config.path;
    let max_bytes = config.max_file_bytes();
    let bytes = reader
        .read(path, max_bytes, config.read_timeout)
        .await
        .map_err(|source| FileError::Read {
            path: path.clone(),
            source,
        })?;
    if bytes.len() as u64 > max_bytes {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            max_bytes,
        });
    }
    Ok(bytes)
}

/// Reads the endpoints file, publishes its engines, and starts the task that reloads it
/// when it changes.
///
/// # Errors
///
/// [`FileError`] when the file cannot be read or is invalid now, or the poll interval
/// is zero ([`FileError::PollInterval`]).
///
/// # Panics
///
/// When called outside a tokio runtime.
pub async fn spawn(config: FileConfig) -> Result<SpecSource, FileError> {
    if config.poll_interval.is_zero() {
        return Err(FileError::PollInterval);
    }
    let reader = TimedReader::new();
    let (bytes, specs) = load(&config, &reader).await?;
    let (publisher, source) = SpecSource::channel(config.name.as_str());
    publisher.publish(specs);
    let task = tokio::spawn(poll(config, publisher, bytes, reader));
    Ok(source.with_task(task))
}

/// Changes in a row that do not settle before the file source warns (and counts an
/// error) that its file never holds still.
const UNSETTLED_WARN: u32 = 5;

/// What the last poll saw, so that a state is logged and counted once.
#[derive(PartialEq)]
enum Seen {
    /// This content (published if valid).
    Content(Vec<u8>),
    /// No readable file.
    Unreadable,
}

async fn poll(config: FileConfig, publisher: SpecPublisher, bytes: Vec<u8>, reader: TimedReader) {
    let mut state = PollState {
        seen: Seen::Content(bytes),
        unsettled: 0,
    };
    let mut interval = tokio::time::interval(config.poll_interval);
    // A slow read delays the next poll rather than bunching polls up.
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    while !publisher.is_closed() {
        interval.tick().await;
        poll_once(&config, &publisher, &reader, &mut state).await;
        // Counted once its outcome is taken (published, counted, or no change).
        publisher.record_poll();
    }
}

/// What the polls carry from one to the next.
struct PollState {
    /// What the last poll saw.
    seen: Seen,
    /// Changes in a row that never read the same twice: past a few, a writer that
    /// rewrites the file without pause (or two taking turns) is told, once per run.
    unsettled: u32,
}

/// One poll: the file read, and a change taken once it settles.
async fn poll_once(
    config: &FileConfig,
    publisher: &SpecPublisher,
    reader: &TimedReader,
    state: &mut PollState,
) {
    let PollState { seen, unsettled } = state;
    let bytes = match read(config, reader).await {
        Ok(bytes) => bytes,
        Err(e) => {
            if *seen != Seen::Unreadable {
                tracing::warn!(
                    path = %config.path.display(),
                    error = %disagg_core::error::error_chain(&e),
                    "endpoints file unreadable; keeping the last good endpoints"
                );
                publisher.record_error();
                *seen = Seen::Unreadable;
            }
            return;
        }
    };
    if matches!(&*seen, Seen::Content(b) if *b == bytes) {
        return;
    }
    // A change, taken once it reads the same again after the settle delay: a file
    // caught while it is rewritten in place (empty, or cut between entries) is not
    // published. Another content, or none, is looked at by the next poll.
    tokio::time::sleep(config.settle).await;
    if !read(config, reader).await.is_ok_and(|again| again == bytes) {
        *unsettled = unsettled.saturating_add(1);
        if *unsettled == UNSETTLED_WARN {
            tracing::warn!(
                path = %config.path.display(),
                polls = *unsettled,
                "endpoints file changes at every poll and never reads the same twice; keeping the last good endpoints"
            );
            publisher.record_error();
        }
        return;
    }
    *unsettled = 0;
    match parse_blocking(&bytes, config.bounds).await {
        Ok(specs) => {
            let n = specs.len();
            if publisher.publish(specs) {
                tracing::info!(path = %config.path.display(), engines = n, "endpoints file reloaded");
            }
        }
        Err(e) => {
            tracing::warn!(
                path = %config.path.display(),
                error = %e,
                "endpoints file edit refused; keeping the last good endpoints"
            );
            if matches!(e, FileError::OverLimit(_)) {
                publisher.record_over_limit();
            } else {
                publisher.record_error();
            }
        }
    }
    *seen = Seen::Content(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_of_an_entry_is_read() {
        let specs = parse(
            r#"
            [[prefill]]
            url = "http://10.0.0.5:8100"
            bootstrap_port = 8998
            model = "llama"
            ranks = "0-1"
            weight = 2.0
            kv_profile = { connector = "NixlConnector", role = "kv_producer", tp = 8 }
            kv_events = "tcp://10.0.0.5:5557"

            [[decode]]
            url = "http://10.0.0.7:8200"
            kv_profile = "NixlConnector,kv_consumer,1"
            lmcache_receiver = "10.0.0.7:7300:7400"
            "#,
        )
        .unwrap();
        let p = &specs[0];
        assert_eq!(p.role, Role::Prefill);
        assert_eq!(p.facts.get(Facts::BOOTSTRAP_PORT), Some("8998"));
        assert_eq!(p.models, ["llama"]);
        assert_eq!(p.ranks, Some(Ranks::new(0, 1).unwrap()));
        assert_eq!(p.weight, Some(2.0));
        let profile = p.kv_profile.as_ref().unwrap();
        assert_eq!(profile.tp_size, Some(8));
        assert_eq!(p.kv_events.as_deref(), Some("tcp://10.0.0.5:5557"));
        let d = &specs[1];
        assert_eq!(d.role, Role::Decode);
        assert_eq!(d.facts.get(Facts::KV_RECEIVER), Some("10.0.0.7:7300:7400"));
        assert_eq!(d.kv_profile.as_ref().unwrap().tp_size, Some(1));
    }

    #[test]
    fn malformed_or_oversized_facts_refuse_the_file() {
        // One byte past the 4096 a fact's value may have (`Facts`' documented limit).
        let long = "x".repeat(4097);
        let cases = [
            (
                "[[prefill]]\nurl = \"http://p:1\"\nbootstrap_port = \"abc\"\n".to_owned(),
                "bootstrap_port",
            ),
            (
                "[[prefill]]\nurl = \"http://p:1\"\nbootstrap_port = 70000\n".to_owned(),
                "bootstrap_port",
            ),
            (
                "[[prefill]]\nurl = \"http://p:1\"\nfacts = { bootstrap_port = \"89x\" }\n"
                    .to_owned(),
                "fact `bootstrap_port` is not a port number",
            ),
            (
                format!("[[decode]]\nurl = \"http://d:1\"\nfacts = {{ note = \"{long}\" }}\n"),
                "longer than the 4096 allowed",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\nfacts = { \"Bad Key\" = \"1\" }\n".to_owned(),
                "fact key",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\nlmcache_receiver = \"h:1,2:3\"\n".to_owned(),
                "one of each per TP rank",
            ),
        ];
        for (text, needle) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains(needle),
                "{}: {err}",
                &text[..text.len().min(80)]
            );
        }
        let ok =
            parse("[[prefill]]\nurl = \"http://p:1\"\nfacts = { engine_id = \"p-0\" }\n").unwrap();
        assert_eq!(ok[0].facts.get("engine_id"), Some("p-0"));
    }

    #[test]
    fn invalid_files_name_the_problem() {
        let cases = [
            (
                "[[prefill]]\nurl = \"http://p:1\"\nbootstarp_port = 1\n",
                "bootstarp_port",
            ),
            ("[[decode]]\nurl = \"ftp://d:1\"\n", "[[decode]] #1"),
            (
                "[[prefill]]\nurl = \"http://p:1\"\nranks = \"3-1\"\n",
                "3-1",
            ),
            (
                "[[prefill]]\nurl = \"http://p:1\"\nlmcache_receiver = \"h:1:2\"\n",
                "decode engines only",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\n[[decode]]\nurl = \"http://d:1/\"\n",
                "twice",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\nweight = -1.0\n",
                "weight",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\nkv_events = \"d:5557\"\n",
                "kv_events",
            ),
            (
                "[[decode]]\nurl = \"http://d:1\"\nkv_profile = \"a,b,c\"\n",
                "kv profile",
            ),
            ("[[decode]\n", "TOML"),
        ];
        for (text, needle) in cases {
            let err = parse(text).unwrap_err().to_string();
            let matched = err.contains(needle) || (needle == "TOML" && err.starts_with("invalid"));
            assert!(matched, "{text:?}: {err}");
        }
    }

    #[test]
    fn ranks_and_endpoints_past_their_ceilings_refuse_the_file() {
        let huge = "[[decode]]\nurl = \"http://d:1\"\nranks = \"0-4294967295\"\n";
        let err = parse(huge).unwrap_err();
        assert!(matches!(err, FileError::OverLimit(_)), "{err}");
        assert!(err.to_string().contains("1024"), "{err}");
        let ok = "[[decode]]\nurl = \"http://d:1\"\nranks = \"0-1023\"\n";
        assert_eq!(parse(ok).unwrap()[0].endpoint_count(), 1024);
        // Five engines of 1,000 ranks each: 5,000 endpoints in all.
        let many: String = (0..5)
            .map(|i| format!("[[decode]]\nurl = \"http://d{i}:1\"\nranks = \"0-999\"\n"))
            .collect();
        let err = parse(&many).unwrap_err();
        assert!(err.to_string().contains("5000 endpoints"), "{err}");
        let small = Bounds {
            max_endpoints: 2,
            ..Bounds::default()
        };
        let three = "[[decode]]\nurl = \"http://a:1\"\n[[decode]]\nurl = \"http://b:1\"\n[[prefill]]\nurl = \"http://c:1\"\n";
        assert!(matches!(
            parse_within(three, &small),
            Err(FileError::OverLimit(_))
        ));
        assert_eq!(parse(three).unwrap().len(), 3);
    }

    #[test]
    fn models_past_their_ceilings_refuse_the_file() {
        use crate::spec::MAX_MODELS_PER_ENGINE;
        let entry = |model: &str| {
            format!("[[decode]]\nurl = \"http://d:1\"\nranks = \"0-1023\"\nmodel = {model}\n")
        };
        let list = |names: &mut dyn Iterator<Item = String>| {
            let quoted: Vec<String> = names.map(|n| format!("\"{n}\"")).collect();
            format!("[{}]", quoted.join(", "))
        };
        // 257 distinct names: one past the ceiling.
        let many = entry(&list(
            &mut (0..=MAX_MODELS_PER_ENGINE).map(|i| format!("m{i}")),
        ));
        let err = parse(&many).unwrap_err();
        assert!(matches!(err, FileError::OverLimit(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("[[decode]] #1: model:") && text.contains("256"),
            "{text}"
        );
        // A name past 512 bytes, alone or in a list.
        let long = "x".repeat(MAX_MODEL_NAME_BYTES + 1);
        for model in [
            format!("\"{long}\""),
            list(&mut ["llama".to_owned(), long].into_iter()),
        ] {
            let err = parse(&entry(&model)).unwrap_err();
            assert!(matches!(err, FileError::OverLimit(_)), "{err}");
            assert!(err.to_string().contains("512"), "{err}");
        }
        // Any number of repeats is one name; at the ceilings, kept.
        let repeated = entry(&list(&mut std::iter::repeat_n("a".to_owned(), 100_000)));
        assert_eq!(parse(&repeated).unwrap()[0].models, ["a"]);
        let most = entry(&list(
            &mut (0..MAX_MODELS_PER_ENGINE).map(|i| format!("{i:0>512}")),
        ));
        assert_eq!(parse(&most).unwrap()[0].models.len(), MAX_MODELS_PER_ENGINE);
        // Not a name: refused as before.
        assert!(matches!(parse(&entry("[1]")), Err(FileError::Invalid(_))));
        assert!(matches!(
            parse(&entry("[\" \"]")),
            Err(FileError::Invalid(_))
        ));
    }

    #[test]
    fn a_metadata_address_refuses_the_file_unless_allowed() {
        for url in [
            "http://169.254.169.254",
            "http://[::ffff:169.254.169.254]:80",
        ] {
            let text = format!("[[decode]]\nurl = \"{url}\"\n");
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains("metadata") && err.contains("[[decode]] #1"),
                "{err}"
            );
            let open = Bounds {
                addresses: disagg_core::endpoint::AddressPolicy::allow_link_local(),
                ..Bounds::default()
            };
            assert_eq!(parse_within(&text, &open).unwrap().len(), 1);
        }
    }

    /// What every rank's endpoint copies is bounded: a kv_events that is not
    /// `tcp://HOST:PORT` (a 5,000-byte host) and an over-long connector name refuse the
    /// file, however many ranks the engine has.
    #[test]
    fn unbounded_strings_copied_per_rank_refuse_the_file() {
        let entry = |extra: &str| {
            format!("[[decode]]\nurl = \"http://d:1\"\nranks = \"0-1023\"\n{extra}\n")
        };
        let long = "a".repeat(5000);
        let err = parse(&entry(&format!("kv_events = \"tcp://{long}:5557\""))).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("[[decode]] #1") && text.contains("kv_events"),
            "{text}"
        );
        assert!(
            text.len() < 1024,
            "the error quotes a bounded part: {}",
            text.len()
        );
        let connector = "c".repeat(129);
        for extra in [
            format!("kv_profile = \"{connector},kv_consumer,1\""),
            format!("kv_profile = {{ connector = \"{connector}\" }}"),
            format!("ec_profile = \"{connector},ec_consumer\""),
        ] {
            let err = parse(&entry(&extra)).unwrap_err().to_string();
            assert!(
                err.contains("[[decode]] #1") && err.contains("128"),
                "{err}"
            );
        }
        let ok = "c".repeat(128);
        let specs = parse(&entry(&format!(
            "kv_profile = \"{ok},kv_consumer,1\"\nkv_events = \"tcp://d:5557\""
        )))
        .unwrap();
        assert_eq!(specs[0].kv_events.as_deref(), Some("tcp://d:5557"));
    }

    /// One engine written two ways in one file (a leading zero in the port, the host's
    /// case, IPv6 text, a rank both in a range and in a URL) is listed twice.
    #[test]
    fn one_engine_written_two_ways_is_listed_twice() {
        let two =
            |a: &str, b: &str| format!("[[decode]]\nurl = \"{a}\"\n[[decode]]\nurl = \"{b}\"\n");
        for (a, b) in [
            ("http://d:8200", "http://d:08200"),
            ("http://D:8200", "http://d:8200"),
            ("http://[FD00::1]:8200", "http://[fd00::1]:8200"),
            ("http://d:8200@1", "http://d:8200/@01"),
        ] {
            let err = parse(&two(a, b)).unwrap_err().to_string();
            assert!(err.contains("listed twice"), "{a} {b}: {err}");
        }
        let overlap = "[[decode]]\nurl = \"http://d:1\"\nranks = \"0-1\"\n\
                       [[decode]]\nurl = \"http://d:1@1\"\n";
        let err = parse(overlap).unwrap_err().to_string();
        assert!(err.contains("listed twice") && err.contains("@1"), "{err}");
        // Other ranks, or the same URL in two roles: distinct endpoints.
        let apart = "[[decode]]\nurl = \"http://d:1\"\nranks = \"0-1\"\n\
                     [[decode]]\nurl = \"http://d:1@2\"\n\
                     [[prefill]]\nurl = \"http://d:1\"\n";
        assert_eq!(parse(apart).unwrap().len(), 3);
        assert_eq!(
            parse(&two("http://d:1@0", "http://d:1@1")).unwrap().len(),
            2
        );
    }

    /// The generic `facts` table is held to the role rules of the named keys.
    #[test]
    fn facts_of_another_role_refuse_the_file() {
        for text in [
            "[[prefill]]\nurl = \"http://p:1\"\nfacts = { kv_receiver = \"h:1,2:3,4\" }\n",
            "[[decode]]\nurl = \"http://d:1\"\nfacts = { bootstrap_port = \"8998\" }\n",
            "[[encode]]\nurl = \"http://e:1\"\nfacts = { bootstrap_port = \"8998\" }\n",
            "[[encode]]\nurl = \"http://e:1\"\nfacts = { kv_receiver = \"h:1:2\" }\n",
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains("engines only"), "{text}: {err}");
        }
    }

    /// Model names are trimmed as the annotation and `--served-model` trim them.
    #[test]
    fn model_names_are_trimmed() {
        let entry = |model: &str| format!("[[decode]]\nurl = \"http://d:1\"\nmodel = {model}\n");
        assert_eq!(parse(&entry("\" llama \"")).unwrap()[0].models, ["llama"]);
        assert_eq!(
            parse(&entry("[\" llama\", \"llama \", \"qwen\"]")).unwrap()[0].models,
            ["llama", "qwen"]
        );
    }

    /// An IPv6 LMCache receiver host goes in brackets, as the Kubernetes source writes
    /// it and the LMCache connector reads it.
    #[test]
    fn an_ipv6_lmcache_receiver_is_bracketed() {
        let entry =
            |r: &str| format!("[[decode]]\nurl = \"http://d:1\"\nlmcache_receiver = \"{r}\"\n");
        let specs = parse(&entry("[fd00::1]:7300:7400")).unwrap();
        assert_eq!(
            specs[0].facts.get(Facts::KV_RECEIVER),
            Some("[fd00::1]:7300:7400")
        );
        let err = parse(&entry("fd00::1:7300:7400")).unwrap_err().to_string();
        assert!(err.contains("brackets"), "{err}");
    }

    /// A URL past [`MAX_URL_BYTES`](crate::spec::MAX_URL_BYTES) refuses the file as it
    /// is read, before anything is made per rank: a 64 KiB URL with 1,024 ranks would be
    /// written out once per rank (twice, with its identity) before the core refused it.
    /// The error names the entry and the ceiling, not the URL.
    #[test]
    fn an_over_long_url_refuses_the_file_before_its_ranks_are_expanded() {
        let url = format!("http://{}:1", "a".repeat(64 * 1024));
        let text = format!("[[decode]]\nurl = \"{url}\"\nranks = \"0-1023\"\n");
        let err = parse(&text).unwrap_err();
        let shown = err.to_string();
        assert!(matches!(err, FileError::Invalid(_)), "{shown}");
        assert!(
            shown.contains("[[decode]] #1") && shown.contains("2048"),
            "{shown}"
        );
        assert!(shown.len() < 1024, "the URL is not quoted whole");
    }

    #[test]
    fn an_empty_file_lists_no_engines() {
        assert!(parse("").unwrap().is_empty());
    }
}
