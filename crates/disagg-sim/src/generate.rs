//! Deterministic "model": tokenization, generation and KV digests.
//!
//! Everything here is a pure function of its inputs, so a prompt produces
//! the same text whether it is served directly or decoded from KV blocks
//! pulled from another engine.

/// The vocabulary, each token with the leading space it is emitted with.
const VOCAB: [&str; 64] = [
    " the", " of", " and", " to", " in", " is", " was", " for", " on", " that", " with", " as",
    " by", " at", " from", " it", " an", " be", " this", " which", " or", " are", " not", " have",
    " had", " one", " all", " but", " were", " they", " their", " there", " been", " has", " more",
    " when", " will", " would", " who", " so", " no", " if", " out", " into", " than", " them",
    " can", " only", " other", " new", " some", " could", " time", " these", " two", " may",
    " then", " do", " first", " any", " my", " now", " such", " like",
];

/// The words of the vocabulary, without their leading space.
pub(crate) fn vocab_words() -> impl Iterator<Item = &'static str> {
    VOCAB.iter().map(|w| w.trim_start())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A 64-bit FNV-1a hasher (stable across platforms and releases, unlike
/// `std`'s `DefaultHasher`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Self(FNV_OFFSET)
    }

    pub(crate) fn bytes(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(FNV_PRIME);
        }
        self
    }

    /// Hashes a token followed by a separator byte that never occurs in
    /// UTF-8, so token boundaries matter.
    pub(crate) fn token(self, token: &str) -> Self {
        self.bytes(token.as_bytes()).bytes(&[0xff])
    }

    pub(crate) fn u64(self, v: u64) -> Self {
        self.bytes(&v.to_le_bytes())
    }

    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

/// SplitMix64 finalizer: a cheap, well-mixing bijection on `u64`.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Number of token ids of the simulated vocabulary: every id is below it.
/// Ids under 16 are special tokens (such as [`EOS_TOKEN_ID`]), the others are words.
pub const VOCAB_SIZE: u32 = 1 << 20;

/// The end-of-sequence token id: the `first_tok` of an LMCache prefill whose
/// first generated token ends the sequence.
pub const EOS_TOKEN_ID: u32 = 2;

/// The first id of a word; ids below it are reserved for special tokens.
const FIRST_WORD_ID: u32 = 16;

/// The token id of one whitespace-free word: a stable hash of its bytes.
pub(crate) fn word_id(word: &str) -> u32 {
    let h = Fnv::new().bytes(word.as_bytes()).finish();
    let span = u64::from(VOCAB_SIZE - FIRST_WORD_ID);
    // The remainder is below `span`, so it fits in a u32.
    FIRST_WORD_ID + u32::try_from(h % span).unwrap_or(0)
}

/// Tokenizes text the way the simulated engine does: one token per
/// whitespace-separated word, whose id is a stable hash of the word (below
/// [`VOCAB_SIZE`], never a special token such as [`EOS_TOKEN_ID`]).
///
/// A completion request whose `prompt` is these ids is answered exactly like
/// one whose `prompt` is the text; `POST /tokenize` answers them.
///
/// ```
/// use disagg_sim::tokenize;
///
/// let ids = tokenize(" Hello   world\n");
/// assert_eq!(ids.len(), 2);
/// assert_eq!(ids, tokenize("Hello world"));
/// assert_ne!(ids[0], ids[1]);
/// ```
pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace().map(word_id).collect()
}

/// Hash of a prompt's token ids: what generation is seeded from.
pub(crate) fn ids_hash(ids: &[u32]) -> u64 {
    ids.iter()
        .fold(Fnv::new(), |h, &id| h.u64(u64::from(id)))
        .finish()
}

/// The token drawn after the sequence whose running [`ids_hash`] is `state` (the prompt's
/// ids and every id generated so far): its vocabulary text and whether it is an
/// end-of-sequence token.
///
/// Drawing from the whole sequence, not from the prompt and a position, makes a
/// continuation exact: a prompt that is an earlier prompt followed by the ids generated
/// for it goes on with the tokens the unbroken run would have drawn next.
fn token_after(state: u64, choice_salt: u64, eos_period: u32) -> (&'static str, bool) {
    let h = mix(state ^ choice_salt);
    let word = VOCAB[(h % VOCAB.len() as u64) as usize];
    let eos =
        eos_period > 0 && mix(h ^ 0x5eed_e05e_0000_0001).is_multiple_of(u64::from(eos_period));
    (word, eos)
}

fn choice_salt(choice: u32) -> u64 {
    mix(u64::from(choice).wrapping_add(0x0c40_1ce0))
}

/// Why a choice stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// `max_tokens` reached.
    Length,
    /// End-of-sequence token or stop string.
    Stop,
}

impl Finish {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
        }
    }
}

/// Sampling parameters that shape one generation.
#[derive(Debug)]
pub(crate) struct GenParams<'a> {
    /// The position of the first generated token: 0 for a whole answer, 1
    /// for an LMCache decode, whose prompt ends with the token at position 0.
    pub(crate) start: usize,
    /// Tokens to generate at most (counted from `start`).
    pub(crate) max_tokens: usize,
    /// Tokens to generate at least before an EOS or stop string may end the
    /// answer (counted from `start`).
    pub(crate) min_tokens: usize,
    pub(crate) eos_period: u32,
    pub(crate) ignore_eos: bool,
    pub(crate) stop: &'a [String],
    pub(crate) include_stop_str_in_output: bool,
}

/// The output of one choice.
#[derive(Debug, Clone)]
pub(crate) struct Generation {
    /// The text of every generated token, in order: the final token is `""`
    /// when it is an EOS token or an excluded stop string.
    pub(crate) steps: Vec<&'static str>,
    /// The token id sampled at every step ([`EOS_TOKEN_ID`] for an EOS).
    pub(crate) ids: Vec<u32>,
    pub(crate) finish: Finish,
    /// The stop string that ended the generation, if any.
    pub(crate) stop_reason: Option<String>,
}

impl Generation {
    pub(crate) fn text(&self) -> String {
        self.steps.concat()
    }
}

/// Generates one choice for a prompt whose [`ids_hash`] is given.
///
/// Each token is drawn from the running hash of the prompt and the ids generated before
/// it ([`token_after`]); the first `start` tokens are drawn and folded in but not
/// returned (an LMCache decode, whose prompt hash leaves out the token at position 0).
pub(crate) fn generate_choice(prompt_hash: u64, choice: u32, params: &GenParams<'_>) -> Generation {
    let salt = choice_salt(choice);
    let mut state = Fnv(prompt_hash);
    for _ in 0..params.start {
        let (token, _) = token_after(state.finish(), salt, params.eos_period);
        state = state.u64(u64::from(word_id(&token[1..])));
    }
    let mut steps = Vec::with_capacity(params.max_tokens.min(4096));
    let mut ids = Vec::with_capacity(params.max_tokens.min(4096));
    let end = |steps, ids, finish, stop_reason| Generation {
        steps,
        ids,
        finish,
        stop_reason,
    };
    for i in 0..params.max_tokens {
        let (token, eos) = token_after(state.finish(), salt, params.eos_period);
        let may_stop = i + 1 > params.min_tokens;
        if eos && may_stop && !params.ignore_eos {
            steps.push("");
            ids.push(EOS_TOKEN_ID);
            return end(steps, ids, Finish::Stop, None);
        }
        let word = &token[1..];
        let id = word_id(word);
        ids.push(id);
        state = state.u64(u64::from(id));
        if may_stop && let Some(stop) = params.stop.iter().find(|s| *s == word || *s == token) {
            steps.push(if params.include_stop_str_in_output {
                token
            } else {
                ""
            });
            return end(steps, ids, Finish::Stop, Some(stop.clone()));
        }
        steps.push(token);
    }
    end(steps, ids, Finish::Length, None)
}

/// The tokens the engine generates for `prompt` (choice 0, no stop strings,
/// EOS honoured): each token is a word with a leading space, exactly as it
/// appears in the answer's text, and the list ends before the first
/// end-of-sequence token.
///
/// `n_tokens` is the request's maximum number of tokens and `eos_period` the
/// engine's [`SimConfig::eos_period`](crate::SimConfig::eos_period). Tests use
/// it to predict answers, or to find a prompt whose first token is EOS:
///
/// ```
/// use disagg_sim::generate;
///
/// let tokens = generate("Hello there", 4, 0);
/// assert_eq!(tokens.len(), 4);
/// assert!(tokens.iter().all(|t| t.starts_with(' ')));
///
/// // A prompt whose very first token is end-of-sequence with eos_period = 3.
/// let eos_first = (0..)
///     .map(|i| format!("prompt {i}"))
///     .find(|p| generate(p, 1, 3).is_empty())
///     .unwrap();
/// assert!(generate(&eos_first, 10, 3).is_empty());
/// ```
pub fn generate(prompt: &str, n_tokens: usize, eos_period: u32) -> Vec<String> {
    generate_from_ids(&tokenize(prompt), n_tokens, eos_period)
}

/// [`generate`] for a prompt given as token ids (see [`tokenize`]): what the
/// engine answers to a completion request whose `prompt` is `ids`.
///
/// ```
/// use disagg_sim::{generate, generate_from_ids, tokenize};
///
/// let ids = tokenize("Hello there");
/// assert_eq!(generate_from_ids(&ids, 4, 0), generate("Hello there", 4, 0));
/// ```
pub fn generate_from_ids(ids: &[u32], n_tokens: usize, eos_period: u32) -> Vec<String> {
    let params = GenParams {
        start: 0,
        max_tokens: n_tokens,
        min_tokens: 0,
        eos_period,
        ignore_eos: false,
        stop: &[],
        include_stop_str_in_output: false,
    };
    generate_choice(ids_hash(ids), 0, &params)
        .steps
        .into_iter()
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The "KV cache" of a prompt: one digest per block of `block_size` tokens
/// (each chained to the previous block, as a block's KV depends on every
/// token before it) and a digest of the whole prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KvDigest {
    pub(crate) blocks: Vec<String>,
    pub(crate) prompt: String,
}

/// Computes the KV digests of the token ids `tokens` for `model`.
/// A prompt with no token still occupies one block.
pub(crate) fn kv_digest(
    model: &str,
    block_size: usize,
    tokens: impl IntoIterator<Item = u32>,
) -> KvDigest {
    let block_size = block_size.max(1);
    let base = Fnv::new().token(model);
    let mut blocks = Vec::new();
    let mut whole = base;
    let mut block = base;
    let mut parent = 0u64;
    let mut in_block = 0usize;
    let mut count = 0u64;
    for token in tokens {
        whole = whole.u64(u64::from(token));
        block = block.u64(u64::from(token));
        in_block += 1;
        count += 1;
        if in_block == block_size {
            parent = block.u64(parent).finish();
            blocks.push(format!("{parent:016x}"));
            block = base;
            in_block = 0;
        }
    }
    if in_block > 0 || blocks.is_empty() {
        parent = block.u64(parent).finish();
        blocks.push(format!("{parent:016x}"));
    }
    KvDigest {
        blocks,
        prompt: format!("{:016x}", whole.u64(count).finish()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_choice_dependent() {
        let h = ids_hash(&tokenize("a b  c"));
        assert_eq!(h, ids_hash(&tokenize(" a b c\n")));
        let p = GenParams {
            start: 0,
            max_tokens: 8,
            min_tokens: 0,
            eos_period: 0,
            ignore_eos: false,
            stop: &[],
            include_stop_str_in_output: false,
        };
        let a = generate_choice(h, 0, &p);
        let b = generate_choice(h, 0, &p);
        let c = generate_choice(h, 1, &p);
        assert_eq!(a.steps, b.steps);
        assert_ne!(a.steps, c.steps);
        assert_eq!(a.finish, Finish::Length);
        assert_eq!(a.steps.len(), 8);
    }

    #[test]
    fn eos_and_stop() {
        let prompt = (0..)
            .map(|i| format!("x {i}"))
            .find(|p| generate(p, 1, 2).is_empty())
            .unwrap();
        let h = ids_hash(&tokenize(&prompt));
        let mut p = GenParams {
            start: 0,
            max_tokens: 5,
            min_tokens: 0,
            eos_period: 2,
            ignore_eos: false,
            stop: &[],
            include_stop_str_in_output: false,
        };
        let g = generate_choice(h, 0, &p);
        assert_eq!(g.steps, vec![""]);
        assert_eq!(g.finish, Finish::Stop);
        p.ignore_eos = true;
        let g = generate_choice(h, 0, &p);
        assert_eq!(g.steps.len(), 5);
        assert_eq!(g.finish, Finish::Length);
        let stop = vec![g.steps[2].trim().to_owned()];
        p.stop = &stop;
        let s = generate_choice(h, 0, &p);
        assert!(s.steps.len() <= 3);
        assert_eq!(s.finish, Finish::Stop);
        assert_eq!(s.steps.last().copied(), Some(""));
    }

    #[test]
    fn digests() {
        let a = kv_digest("m", 2, tokenize("a b c"));
        assert_eq!(a.blocks.len(), 2);
        let b = kv_digest("m", 2, tokenize("a b d"));
        assert_eq!(a.blocks[0], b.blocks[0]);
        assert_ne!(a.blocks[1], b.blocks[1]);
        assert_ne!(a.prompt, b.prompt);
        let other_model = kv_digest("n", 2, tokenize("a b c"));
        assert_ne!(a.blocks[0], other_model.blocks[0]);
        assert_eq!(kv_digest("m", 4, []).blocks.len(), 1);
    }

    #[test]
    fn ids_and_offsets() {
        let ids = tokenize("one two three");
        assert!(
            ids.iter()
                .all(|id| (FIRST_WORD_ID..VOCAB_SIZE).contains(id))
        );
        let h = ids_hash(&ids);
        let whole = GenParams {
            start: 0,
            max_tokens: 6,
            min_tokens: 0,
            eos_period: 0,
            ignore_eos: false,
            stop: &[],
            include_stop_str_in_output: false,
        };
        let g = generate_choice(h, 0, &whole);
        // Every generated token's id is its tokenization.
        let text_ids: Vec<u32> = g.steps.iter().flat_map(|t| tokenize(t)).collect();
        assert_eq!(g.ids, text_ids);
        // A continuation from position 1 is the rest of the whole answer.
        let rest = generate_choice(
            h,
            0,
            &GenParams {
                start: 1,
                max_tokens: 5,
                ..whole
            },
        );
        assert_eq!(rest.steps, g.steps[1..]);
        assert_eq!(rest.ids, g.ids[1..]);
        // So is a prompt that is the first prompt followed by the ids generated so far
        // (a migrated stream's continuation), from any point.
        for k in 0..g.ids.len() {
            let mut longer = ids.clone();
            longer.extend_from_slice(&g.ids[..k]);
            let more = generate_choice(
                ids_hash(&longer),
                0,
                &GenParams {
                    max_tokens: 6 - k,
                    ..whole
                },
            );
            assert_eq!(more.steps, g.steps[k..]);
        }
        // EOS has its own id.
        let prompt = (0..)
            .map(|i| format!("e {i}"))
            .find(|p| generate(p, 1, 2).is_empty())
            .unwrap();
        let p = GenParams {
            eos_period: 2,
            ..whole
        };
        assert_eq!(
            generate_choice(ids_hash(&tokenize(&prompt)), 0, &p).ids,
            [EOS_TOKEN_ID]
        );
    }
}
