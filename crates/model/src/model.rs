//! [`Model`]: weights, tokenizer and chat template loaded together from a
//! GGUF file or a Hugging Face directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Device;

use crate::llama::Llama;
use crate::loader::{GgufFile, HfDir, Source};
use crate::template::{ChatTemplate, CHATML};
use crate::tokenizer::Tokenizer;
use crate::{ModelConfig, ModelError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    Safetensors,
}

/// A loaded model, ready to run.
pub struct Model {
    pub llama: Llama,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub format: ModelFormat,
    pub path: PathBuf,
    /// Tensor storage types and how many tensors use each.
    pub storage: BTreeMap<String, usize>,
    pub file_bytes: u64,
    /// Identifies the weights, the architecture and the tokenizer (for
    /// session files): a hash of every byte of the model's files.
    pub fingerprint: u64,
}

/// A 64-bit hash of the files' bytes, in order (xxh3, streamed: about a
/// tenth of a second per gigabyte read from the page cache).
fn hash_files(paths: &[PathBuf]) -> Result<u64> {
    use std::io::Read;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    for p in paths {
        let mut f = std::fs::File::open(p).map_err(|e| ModelError::Io {
            path: p.clone(),
            source: e,
        })?;
        h.update(p.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        loop {
            let n = f.read(&mut buf).map_err(|e| ModelError::Io {
                path: p.clone(),
                source: e,
            })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.digest())
}

impl Model {
    /// Loads a GGUF file, or a directory (or a `.safetensors` file inside
    /// one) holding `config.json`, safetensors and `tokenizer.json`.
    /// `progress(done, total)` is called as layers load.
    pub fn load(path: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<Model> {
        Model::load_on(path, &Device::Cpu, progress)
    }

    /// [`Model::load`] onto `device` (see [`crate::DeviceSpec`]): on a GPU
    /// the model runs the candle reference forward over K/V kept there.
    pub fn load_on(
        path: &Path,
        device: &Device,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_path_buf()));
        }
        let device = device.clone();
        let is_dir = path.is_dir();
        let is_safetensors = path.extension().is_some_and(|e| e == "safetensors");
        if is_dir || is_safetensors {
            let dir = if is_dir {
                path
            } else {
                path.parent().unwrap_or(Path::new("."))
            };
            return Self::load_hf(dir, &device, progress);
        }
        let mut g = GgufFile::open(path)?;
        let cfg = g.config()?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let token_text = |key: &str| {
            g.meta_u32(key)
                .ok()
                .and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        let (bos, eos) = (
            token_text("tokenizer.ggml.bos_token_id"),
            token_text("tokenizer.ggml.eos_token_id"),
        );
        let template = match g.meta_str("tokenizer.chat_template") {
            Ok(src) => ChatTemplate::new(src, &bos, &eos)?,
            Err(_) => ChatTemplate::new(CHATML, &bos, &eos)?,
        };
        let mut storage = BTreeMap::new();
        for info in g.content.tensor_infos.values() {
            *storage.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
        }
        let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        // The file holds the metadata (architecture, tokenizer) too.
        let fingerprint = hash_files(&[path.to_path_buf()])?;
        let llama = Llama::build(&mut Source::Gguf(&mut g), cfg, &device, progress)?;
        if tokenizer.vocab_size() > llama.config().vocab_size {
            return Err(ModelError::Config(format!(
                "tokenizer has {} tokens but the model only {}",
                tokenizer.vocab_size(),
                llama.config().vocab_size
            )));
        }
        Ok(Model {
            llama,
            tokenizer,
            template,
            format: ModelFormat::Gguf,
            path: path.to_path_buf(),
            storage,
            file_bytes,
            fingerprint,
        })
    }

    fn load_hf(
        dir: &Path,
        device: &Device,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model> {
        let (hf, cfg) = HfDir::open(dir)?;
        let tok_cfg: serde_json::Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        let token_str = |key: &str| -> String {
            match &tok_cfg[key] {
                serde_json::Value::String(s) => s.clone(),
                v => v["content"].as_str().unwrap_or_default().to_string(),
            }
        };
        let (bos, eos) = (token_str("bos_token"), token_str("eos_token"));
        let gen_cfg: serde_json::Value =
            std::fs::read_to_string(dir.join("generation_config.json"))
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok())
                .unwrap_or_default();
        let eog: Option<Vec<u32>> = match &gen_cfg["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64().map(|x| vec![x as u32]),
            serde_json::Value::Array(a) => Some(
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect(),
            ),
            _ => None,
        };
        let add_bos = tok_cfg["add_bos_token"].as_bool().unwrap_or(false);
        let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), eog, None, add_bos)?;
        let bos_id = tokenizer.token_to_id(&bos);
        let mut eog_ids = tokenizer.eog_ids().to_vec();
        eog_ids.extend(tokenizer.token_to_id(&eos));
        eog_ids.sort_unstable();
        eog_ids.dedup();
        tokenizer = Tokenizer::new(tokenizer.inner().clone(), eog_ids, bos_id, add_bos);
        let template = match tok_cfg["chat_template"].as_str() {
            Some(src) => ChatTemplate::new(src, &bos, &eos)?,
            None => ChatTemplate::new(CHATML, &bos, &eos)?,
        };
        let file_bytes: u64 = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        let storage = BTreeMap::from([("safetensors".to_string(), 1)]);
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io {
                path: dir.to_path_buf(),
                source: e,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    || p.file_name().is_some_and(|n| {
                        ["config.json", "tokenizer.json", "tokenizer_config.json"]
                            .iter()
                            .any(|k| n == *k)
                    })
            })
            .collect();
        files.sort();
        let fingerprint = hash_files(&files)?;
        let llama = Llama::build(&mut Source::Hf(&hf), cfg, device, progress)?;
        Ok(Model {
            llama,
            tokenizer,
            template,
            format: ModelFormat::Safetensors,
            path: dir.to_path_buf(),
            storage,
            file_bytes,
            fingerprint,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.llama.config()
    }
}
