//! The command line of the kernel examples (`tile_stream`, `prefill_tiles`):
//! a weight format first, then `--name value` pairs of whole numbers.

use candle_core::quantized::GgmlDType;

pub struct Args(Vec<String>);

impl Args {
    pub fn new() -> Args {
        Args(std::env::args().skip(1).collect())
    }

    /// The value after `name`, or `default`.
    pub fn value(&self, name: &str, default: usize) -> anyhow::Result<usize> {
        match self.0.iter().position(|a| a == name) {
            Some(i) => Ok(self
                .0
                .get(i + 1)
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
                .parse()?),
            None => Ok(default),
        }
    }

    /// The comma-separated words after `name`, if given (`prefill_tiles`'
    /// `--isas`; `tile_stream` has no such option).
    #[allow(dead_code)]
    pub fn words(&self, name: &str) -> anyhow::Result<Option<Vec<String>>> {
        match self.0.iter().position(|a| a == name) {
            Some(i) => Ok(Some(
                self.0
                    .get(i + 1)
                    .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
                    .split(',')
                    .map(|w| w.trim().to_lowercase())
                    .collect(),
            )),
            None => Ok(None),
        }
    }

    /// `--levels` (1 or 2; 2 by default).
    pub fn levels(&self) -> anyhow::Result<usize> {
        let levels = self.value("--levels", 2)?;
        anyhow::ensure!((1..=2).contains(&levels), "--levels is 1 or 2");
        Ok(levels)
    }

    /// The format named first (`q4_0` by default), among `known`.
    pub fn format(&self, known: &[(&'static str, GgmlDType)]) -> anyhow::Result<(&str, GgmlDType)> {
        let name = self
            .0
            .first()
            .filter(|a| !a.starts_with("--"))
            .map_or("q4_0", String::as_str);
        let names: Vec<&str> = known.iter().map(|(n, _)| *n).collect();
        known
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(n, d)| (n, d))
            .ok_or_else(|| anyhow::anyhow!("unknown format {name} ({})", names.join(", ")))
    }
}
