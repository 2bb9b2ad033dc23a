//! Spilled-size accounting: per-entry (memory, disk) sizes, running totals and
//! the `max_spill` capacity check.
//!
//! The ledger is a plain value; `store::FileStore` keeps it behind a mutex so
//! that "check capacity, then reserve" is one atomic step even when several
//! threads spill at once. A reservation is taken before a file is written and
//! either committed (the file exists) or released (the write failed), so two
//! concurrent writers can never both pass the check and overshoot the limit.

use std::collections::{HashMap, HashSet};

/// Sizes accounted for one spilled entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sizes {
    /// Size of the value in memory, as measured by `sizeof` on the Python side.
    pub memory: u64,
    /// Bytes the entry occupies on disk.
    pub disk: u64,
}

#[derive(Debug, Default)]
pub struct Ledger {
    entries: HashMap<String, Sizes>,
    total: Sizes,
    reserved_disk: u64,
    /// Entries whose file may have other hard links (handed to or received
    /// from a peer); their disk size is shared among the links.
    shared: HashSet<String>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Reserve `disk` bytes if that keeps committed + reserved bytes within
    /// `max_disk` (no limit when `None`). Returns whether the reservation was made.
    pub fn try_reserve(&mut self, disk: u64, max_disk: Option<u64>) -> bool {
        if let Some(limit) = max_disk {
            let would_be = self.total.disk + self.reserved_disk + disk;
            if would_be > limit {
                return false;
            }
        }
        self.reserved_disk += disk;
        true
    }

    /// Give back a reservation whose write failed.
    pub fn release(&mut self, disk: u64) {
        self.reserved_disk -= disk;
    }

    /// Turn a reservation of `sizes.disk` bytes into a committed entry.
    /// An existing entry of the same name is replaced (its sizes leave the totals).
    pub fn commit(&mut self, name: &str, sizes: Sizes) {
        self.reserved_disk -= sizes.disk;
        if let Some(old) = self.entries.insert(name.to_owned(), sizes) {
            self.shared.remove(name);
            self.subtract(old);
        }
        self.total.memory += sizes.memory;
        self.total.disk += sizes.disk;
    }

    pub fn remove(&mut self, name: &str) -> Option<Sizes> {
        let sizes = self.entries.remove(name)?;
        self.shared.remove(name);
        self.subtract(sizes);
        Some(sizes)
    }

    fn subtract(&mut self, sizes: Sizes) {
        self.total.memory -= sizes.memory;
        self.total.disk -= sizes.disk;
    }

    /// Record that the entry's file may have other hard links. Returns false
    /// for an unknown name.
    pub fn mark_shared(&mut self, name: &str) -> bool {
        if !self.entries.contains_key(name) {
            return false;
        }
        self.shared.insert(name.to_owned());
        true
    }

    pub fn is_shared(&self, name: &str) -> bool {
        self.shared.contains(name)
    }

    /// The shared entries with their sizes.
    pub fn shared_entries(&self) -> Vec<(String, Sizes)> {
        self.shared
            .iter()
            .map(|n| (n.clone(), self.entries[n]))
            .collect()
    }

    /// Change the memory size accounted for an entry. Returns false for an
    /// unknown name.
    pub fn set_memory(&mut self, name: &str, memory: u64) -> bool {
        let Some(sizes) = self.entries.get_mut(name) else {
            return false;
        };
        self.total.memory = self.total.memory - sizes.memory + memory;
        sizes.memory = memory;
        true
    }

    pub fn get(&self, name: &str) -> Option<Sizes> {
        self.entries.get(name).copied()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn total(&self) -> Sizes {
        self.total
    }

    pub fn reserved_disk(&self) -> u64 {
        self.reserved_disk
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::thread;

    #[test]
    fn totals_follow_commits_and_removals() {
        let mut ledger = Ledger::new();
        assert!(ledger.try_reserve(10, None));
        ledger.commit(
            "a",
            Sizes {
                memory: 100,
                disk: 10,
            },
        );
        assert!(ledger.try_reserve(20, None));
        ledger.commit(
            "b",
            Sizes {
                memory: 200,
                disk: 20,
            },
        );
        assert_eq!(
            ledger.total(),
            Sizes {
                memory: 300,
                disk: 30
            }
        );
        assert_eq!(
            ledger.remove("a"),
            Some(Sizes {
                memory: 100,
                disk: 10
            })
        );
        assert_eq!(ledger.remove("a"), None);
        assert_eq!(
            ledger.total(),
            Sizes {
                memory: 200,
                disk: 20
            }
        );
        assert_eq!(ledger.reserved_disk(), 0);
    }

    #[test]
    fn capacity_counts_reservations_in_flight() {
        let mut ledger = Ledger::new();
        assert!(ledger.try_reserve(60, Some(100)));
        // 60 in flight: another 60 must be refused even though nothing is committed.
        assert!(!ledger.try_reserve(60, Some(100)));
        assert!(ledger.try_reserve(40, Some(100)));
        ledger.release(60);
        assert!(ledger.try_reserve(60, Some(100)));
        assert!(!ledger.try_reserve(1, Some(100)));
    }

    #[test]
    fn recommit_replaces_old_sizes() {
        let mut ledger = Ledger::new();
        ledger.try_reserve(10, None);
        ledger.commit(
            "a",
            Sizes {
                memory: 1,
                disk: 10,
            },
        );
        ledger.try_reserve(5, None);
        ledger.commit("a", Sizes { memory: 2, disk: 5 });
        assert_eq!(ledger.total(), Sizes { memory: 2, disk: 5 });
        assert_eq!(ledger.len(), 1);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let ledger = Arc::new(Mutex::new(Ledger::new()));
        let limit = 1000;
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let ledger = Arc::clone(&ledger);
                thread::spawn(move || {
                    for i in 0..500 {
                        let name = format!("{t}-{i}");
                        let ok = ledger.lock().unwrap().try_reserve(7, Some(limit));
                        if ok {
                            let mut l = ledger.lock().unwrap();
                            l.commit(&name, Sizes { memory: 7, disk: 7 });
                            assert!(l.total().disk <= limit);
                            if i % 3 == 0 {
                                l.remove(&name);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let l = ledger.lock().unwrap();
        assert!(l.total().disk <= limit);
        assert_eq!(l.total().disk, 7 * l.len() as u64);
        assert_eq!(l.reserved_disk(), 0);
    }
}
