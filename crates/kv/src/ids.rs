//! Newtype identifiers. Tables and trees hold these, never references.

use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw value, for indexing and for kernels that take plain integers.
            #[inline]
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
    };
}

id_type!(
    /// A block of `block_size` token slots in the pool.
    BlockId(u32),
    "b"
);
id_type!(
    /// A sequence (one request, one sample of a request, one chat branch).
    SeqId(u64),
    "s"
);
id_type!(
    /// A node of the prefix tree.
    NodeId(u32),
    "n"
);
id_type!(
    /// A token id of the model's vocabulary.
    TokenId(u32),
    "t"
);
id_type!(
    /// A flat slot index into the pool: `block * block_size + offset`.
    Slot(u32),
    "slot"
);
id_type!(
    /// The key under which cached prefixes may be shared: model, adapter and
    /// tenant salt hashed together by the caller. Different namespaces never
    /// share blocks.
    Namespace(u64),
    "ns"
);

impl Slot {
    /// The slot of offset `offset` inside `block`.
    ///
    /// ```text
    /// pool:  | b0: 0 1 2 3 | b1: 4 5 6 7 | b2: 8 9 10 11 |   (block_size 4)
    /// Slot::of(b2, 1, 4) == 9
    /// ```
    #[inline]
    pub fn of(block: BlockId, offset: usize, block_size: usize) -> Slot {
        Slot(block.0 * block_size as u32 + offset as u32)
    }
}

/// Plain `u32` token ids as [`TokenId`]s (the representation is identical).
pub fn token_ids(raw: &[u32]) -> Vec<TokenId> {
    raw.iter().copied().map(TokenId).collect()
}
