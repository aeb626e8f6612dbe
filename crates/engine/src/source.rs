//! Where a model comes from: a local path, or `hf:OWNER/REPO/FILE` fetched
//! through hf-hub (needs internet access the first time; cached after).

use std::path::PathBuf;

use crate::{EngineError, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Path(PathBuf),
    Hub { repo: String, file: String },
}

impl ModelSource {
    /// `hf:OWNER/REPO/FILE` or a path.
    pub fn parse(s: &str) -> Result<ModelSource> {
        let Some(rest) = s.strip_prefix("hf:") else {
            return Ok(ModelSource::Path(PathBuf::from(s)));
        };
        let parts: Vec<&str> = rest.splitn(3, '/').collect();
        match parts.as_slice() {
            [owner, repo, file] if !owner.is_empty() && !repo.is_empty() && !file.is_empty() => {
                Ok(ModelSource::Hub {
                    repo: format!("{owner}/{repo}"),
                    file: file.to_string(),
                })
            }
            _ => Err(EngineError::Invalid(format!(
                "{s:?}: expected hf:OWNER/REPO/FILE"
            ))),
        }
    }

    /// The local path, downloading first for a hub source.
    pub fn resolve(&self) -> Result<PathBuf> {
        match self {
            ModelSource::Path(p) => Ok(p.clone()),
            ModelSource::Hub { repo, file } => {
                let api =
                    hf_hub::api::sync::Api::new().map_err(|e| EngineError::Hub(e.to_string()))?;
                api.model(repo.clone()).get(file).map_err(|e| {
                    EngineError::Hub(format!(
                        "could not fetch {file} from {repo} ({e}); downloads need internet access — pass a local path instead"
                    ))
                })
            }
        }
    }
}

/// What [`ModelSource::parse`] reads back.
impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Path(p) => write!(f, "{}", p.display()),
            ModelSource::Hub { repo, file } => write!(f, "hf:{repo}/{file}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hub_and_paths() {
        assert_eq!(
            ModelSource::parse("hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2.gguf").unwrap(),
            ModelSource::Hub {
                repo: "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF".into(),
                file: "smollm2.gguf".into()
            }
        );
        assert_eq!(
            ModelSource::parse("models/x.gguf").unwrap(),
            ModelSource::Path("models/x.gguf".into())
        );
        assert!(ModelSource::parse("hf:only-owner").is_err());
        for s in ["hf:a/b/c.gguf", "models/x.gguf"] {
            assert_eq!(ModelSource::parse(s).unwrap().to_string(), s);
        }
    }
}
