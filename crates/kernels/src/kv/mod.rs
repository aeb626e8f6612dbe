//! The KV movers and the cache's formats: rows written into their slots
//! ([`write`]), whole blocks copied ([`copy`]), slots moved with their keys
//! rotated ([`shift`]), the RoPE rotation they and the forward share
//! ([`rope`]), and the quantized cache types ([`quant`]).

pub(crate) mod copy;
pub mod quant;
pub(crate) mod rope;
pub(crate) mod shift;
pub(crate) mod write;
