//! The hasher of the agent's large tables: foldhash, keyed at random per process.
//!
//! The keys of these tables come from the API server (pod and slice names, label sets), so a
//! user who may create pods chooses them: the key is random per process, as std's SipHash
//! key is, and foldhash hashes a short string several times faster (std's SipHash was a tenth
//! of an agent's CPU during the initial sync of 150,000 pods). Tables keyed by what only the
//! agent makes (policy keys, selector ids) use `rustc_hash`'s unkeyed Fx instead.
//!
//! Only as a table's hasher, where a collision costs time and the table's `Eq` keeps answers
//! right. Where a hash stands for a value (did this pod's entry change? which pod is this key
//! hash?), a collision would be a wrong answer, and foldhash makes no promise against crafted
//! ones: those hashes stay std's keyed SipHash.

/// foldhash's random state: a per-process random seed, a fresh per-table key.
pub type RandomState = foldhash::fast::RandomState;

/// A `HashMap` with [`RandomState`] (`HashMap::default()` makes one).
pub type HashMap<K, V> = std::collections::HashMap<K, V, RandomState>;

/// A `HashSet` with [`RandomState`].
pub type HashSet<K> = std::collections::HashSet<K, RandomState>;
