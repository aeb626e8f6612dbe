//! Tokenizers built from GGUF metadata (`tokenizer.ggml.*`) or loaded from
//! `tokenizer.json`, as `tokenizers::Tokenizer`s.
//!
//! - `gpt2` (byte-level BPE with merges): the pre-tokenizer regexes follow
//!   llama.cpp's per-`tokenizer.ggml.pre` table, so ids match llama.cpp's.
//! - `llama` (SentencePiece-style BPE with scores): merges are derived from
//!   the scores (a merge is ranked by the score of the token it produces),
//!   with byte fallback and `▁` for spaces.
//!
//! Control tokens (`<|im_start|>` …) are parsed as specials only when asked
//! ([`Special::Parse`]), which the chat template does for its own text and
//! never for user content.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::loader::GgufFile;
use crate::{ModelError, Result};

/// Whether control-token text in the input becomes the control token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// `<|im_start|>` in the text is the control token (template text).
    Parse,
    /// `<|im_start|>` in the text is plain text (user content).
    AsText,
}

/// GGUF token types (llama.cpp `llama_token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_UNKNOWN: i64 = 2;

/// Texts of end-of-generation tokens that llama.cpp also treats as such.
const EOG_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
];

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (o200k) split, as its `tokenizer.json` writes it (Phi-4 mini).
const GPT4O_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A model's tokenizer with its special-token facts.
#[derive(Clone)]
pub struct Tokenizer {
    parse_specials: tokenizers::Tokenizer,
    plain: tokenizers::Tokenizer,
    eog: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

fn split(regex: &str) -> Result<PreTokenizerWrapper> {
    Ok(Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?
    .into())
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` name, as llama.cpp splits.
fn gpt2_pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, false, use_regex));
    Ok(match pre {
        // Digits one by one, then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreSequence::new(vec![split(r"\p{N}")?, byte_level(true)]).into()
        }
        "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" => PreSequence::new(vec![split(LLAMA3_REGEX)?, byte_level(false)]).into(),
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" => PreSequence::new(vec![split(QWEN2_REGEX)?, byte_level(false)]).into(),
        "gpt-4o" | "llama4" => PreSequence::new(vec![split(GPT4O_REGEX)?, byte_level(false)]).into(),
        "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => byte_level(true),
        other => {
            return Err(ModelError::Tokenizer(format!(
                "unsupported pre-tokenizer {other:?} (tokenizer.ggml.pre); supported: smollm, llama-bpe, qwen2, gpt-4o, gpt2 and their aliases"
            )))
        }
    })
}

impl Tokenizer {
    /// Wraps a `tokenizers::Tokenizer`; `eog` are the ids that end generation.
    pub fn new(
        tokenizer: tokenizers::Tokenizer,
        eog: Vec<u32>,
        bos: Option<u32>,
        add_bos: bool,
    ) -> Tokenizer {
        let mut plain = tokenizer.clone();
        plain.set_encode_special_tokens(true);
        Tokenizer {
            parse_specials: tokenizer,
            plain,
            eog,
            bos,
            add_bos,
        }
    }

    /// Builds the tokenizer described by a GGUF file's metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let model = g.meta_str("tokenizer.ggml.model")?.to_string();
        let tokens: Vec<String> = g
            .meta("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| ModelError::Missing("GGUF metadata tokenizer.ggml.tokens".into()))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(tok_err))
            .collect::<Result<_>>()?;
        let types: Vec<i64> = match g
            .meta("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
        {
            Some(v) => v
                .iter()
                .map(|t| t.to_i32().map(i64::from).unwrap_or(1))
                .collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let bos = g.meta_u32("tokenizer.ggml.bos_token_id").ok();
        let mut tok = match model.as_str() {
            "gpt2" => {
                let merges: Vec<(String, String)> = g
                    .meta("tokenizer.ggml.merges")
                    .and_then(|v| v.to_vec().ok())
                    .ok_or_else(|| {
                        ModelError::Missing("GGUF metadata tokenizer.ggml.merges".into())
                    })?
                    .iter()
                    .filter_map(|m| m.to_string().ok())
                    .filter_map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                    })
                    .collect();
                let pre = g
                    .meta_str("tokenizer.ggml.pre")
                    .unwrap_or("default")
                    .to_string();
                build_byte_level_bpe(&tokens, merges, &pre)?
            }
            "llama" => {
                let scores: Vec<f32> = match g
                    .meta("tokenizer.ggml.scores")
                    .and_then(|v| v.to_vec().ok())
                {
                    Some(v) => v.iter().map(|s| s.to_f32().unwrap_or(0.0)).collect(),
                    None => vec![0.0; tokens.len()],
                };
                if scores.len() != tokens.len() {
                    return Err(ModelError::Tokenizer(format!(
                        "tokenizer.ggml.scores has {} entries for {} tokens",
                        scores.len(),
                        tokens.len()
                    )));
                }
                let add_space_prefix = g
                    .meta("tokenizer.ggml.add_space_prefix")
                    .and_then(|v| v.to_bool().ok())
                    .unwrap_or(true);
                build_sentencepiece_bpe(&tokens, &scores, &types, add_space_prefix)?
            }
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "unsupported tokenizer model {other:?} (gpt2, llama)"
                )))
            }
        };
        add_special_tokens(&mut tok, &tokens, &types)?;
        let mut eog: Vec<u32> = [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ]
        .iter()
        .filter_map(|k| g.meta_u32(k).ok())
        .collect();
        for (i, t) in tokens.iter().enumerate() {
            if types[i] == TYPE_CONTROL && EOG_TEXTS.contains(&t.as_str()) {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();
        let add_bos = g
            .meta("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(model == "llama");
        Ok(Tokenizer::new(tok, eog, bos, add_bos))
    }

    /// Loads `tokenizer.json`; end-of-generation ids are taken from the
    /// added tokens with the usual texts unless `eog` names them.
    pub fn from_file(
        path: &std::path::Path,
        eog: Option<Vec<u32>>,
        bos: Option<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_path_buf()));
        }
        let tok = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let eog = eog.unwrap_or_else(|| {
            EOG_TEXTS
                .iter()
                .filter_map(|t| tok.token_to_id(t))
                .collect()
        });
        Ok(Tokenizer::new(tok, eog, bos, add_bos))
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.parse_specials
    }

    /// Token ids of `text`; a BOS is prepended when the model asks for it
    /// and `with_bos` is set.
    pub fn encode(&self, text: &str, special: Special, with_bos: bool) -> Result<Vec<u32>> {
        let t = match special {
            Special::Parse => &self.parse_specials,
            Special::AsText => &self.plain,
        };
        let enc = t.encode_fast(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if with_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, control tokens included as their text.
    /// The texts of the special (control) tokens, longest first: what
    /// [`Special::Parse`] turns into control tokens.
    pub fn control_texts(&self) -> Vec<String> {
        let mut texts: Vec<String> = self
            .parse_specials
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        texts.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        texts.dedup();
        texts
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.parse_specials.decode(ids, false).map_err(tok_err)
    }

    pub fn vocab_size(&self) -> usize {
        self.parse_specials.get_vocab_size(true)
    }

    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.parse_specials.token_to_id(text)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.parse_specials.id_to_token(id)
    }

    /// The bytes token `id` stands for: its text, or, for a token that
    /// ends inside a character (whose text alone would be U+FFFD), its raw
    /// bytes (`<0xNN>` byte tokens, byte-level BPE pieces).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let text = self.decode(&[id]).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return text.into_bytes();
        }
        let Some(piece) = self.id_to_token(id) else {
            return text.into_bytes();
        };
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
        piece
            .chars()
            .map(byte_level)
            .collect::<Option<Vec<u8>>>()
            .unwrap_or_else(|| text.into_bytes())
    }

    /// Ids that end generation (EOS, EOT and the like).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// An incremental decoder for streaming output.
    pub fn stream(&self) -> StreamDecoder {
        StreamDecoder {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

fn build_byte_level_bpe(
    tokens: &[String],
    merges: Vec<(String, String)>,
    pre: &str,
) -> Result<tokenizers::Tokenizer> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .rev()
        .collect();
    let ignore_merges = matches!(pre, "llama-bpe" | "llama3");
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(gpt2_pre_tokenizer(pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tok)
}

fn build_sentencepiece_bpe(
    tokens: &[String],
    scores: &[f32],
    types: &[i64],
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .rev()
        .collect();
    // A merge (a, b) exists when a + b is a token; higher-scored results merge first.
    let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id).copied() != Some(1) {
            continue;
        }
        for (i, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(i);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                ranked.push((
                    scores.get(id).copied().unwrap_or(0.0),
                    id as u32,
                    a.to_string(),
                    b.to_string(),
                ));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    let merges = ranked.into_iter().map(|(_, _, a, b)| (a, b)).collect();
    let unk = types
        .iter()
        .position(|&t| t == TYPE_UNKNOWN)
        .map(|i| tokens[i].clone())
        .unwrap_or_else(|| "<unk>".into());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true)
        .unk_token(unk)
        .build()
        .map_err(tok_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        norms.push(Prepend::new("▁".into()).into());
    }
    norms.push(Replace::new(" ", "▁").map_err(tok_err)?.into());
    tok.with_normalizer(Some(NormalizerSequence::new(norms)))
        .map_err(tok_err)?;
    let mut decs: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decs.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(decs)));
    Ok(tok)
}

/// The byte a byte-level BPE character stands for (GPT-2's table: the
/// printable bytes are their own character; the others, in order, were
/// moved to U+0100 and up).
fn byte_level(c: char) -> Option<u8> {
    let direct = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let c = c as u32;
    if direct(c) {
        return Some(c as u8);
    }
    let k = c.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !direct(b))
        .nth(k as usize)
        .map(|b| b as u8)
}

/// Control tokens become special added tokens (matched only when parsing
/// specials); user-defined tokens are always matched, as in llama.cpp.
fn add_special_tokens(
    tok: &mut tokenizers::Tokenizer,
    tokens: &[String],
    types: &[i64],
) -> Result<()> {
    let pick = |ty| {
        tokens
            .iter()
            .zip(types)
            .filter(move |(_, &t)| t == ty)
            .map(|(s, _)| s.clone())
    };
    let control: Vec<AddedToken> = pick(TYPE_CONTROL)
        .map(|s| AddedToken::from(s, true))
        .collect();
    let user: Vec<AddedToken> = pick(TYPE_USER_DEFINED)
        .map(|s| AddedToken::from(s, false))
        .collect();
    tok.add_special_tokens(control).map_err(tok_err)?;
    tok.add_tokens(user).map_err(tok_err)?;
    Ok(())
}

/// Turns a stream of token ids into text pieces that are always valid,
/// complete UTF-8: a token that ends inside a multi-byte character is held
/// back until the character is complete.
/// It holds no reference to the tokenizer: each call takes it, so a decoder
/// can live in long-running request state.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len()
            && !now.ends_with('\u{FFFD}')
            && now.is_char_boundary(before.len())
        {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(Some(piece));
        }
        Ok(None)
    }

    /// Whatever is still held back (an incomplete character at the very end
    /// is emitted as U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now
            .get(before.len()..)
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    }
}
