//! `AddrMap`: a hash map keyed by object addresses (unique, 16-byte aligned
//! `usize`s), hashed with one multiply instead of SipHash.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for object addresses: one multiply (addresses are already unique).
#[derive(Default)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map from object addresses to `V`.
pub type AddrMap<V> = HashMap<usize, V, BuildHasherDefault<AddrHasher>>;
