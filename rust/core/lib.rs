//! `dask-shm-core`: the pure Rust half of dask-shm, with no Python in it.
//!
//! Spill files (`format`, `store`, `ledger`, `recycle`, `fs`, `strided`), the tier-2 ->
//! tier-3 move and budget (`tier`), deleting files off the caller's thread
//! (`unlinker`), a worker's figures for its nanny (`publish`), reading a peer's files (`peer`,
//! `local_transport`), the shared-memory arena (`born`) and the Active Memory
//! Manager's decisions (`amm`) and its ReduceReplicas tracker
//! (`replica_tracker`, with `addr_map`). The bindings (`rust/py`, the
//! `dask_shm._core` extension) convert Python objects to these types and
//! back; nothing here depends on them.

pub mod addr_map;
pub mod amm;
pub mod born;
pub mod format;
pub mod fs;
pub mod ledger;
pub mod local_transport;
pub mod peer;
pub mod publish;
pub mod recycle;
pub mod replica_tracker;
pub mod store;
pub mod strided;
pub mod tier;
pub mod unlinker;
