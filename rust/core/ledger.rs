//! Spilled-size accounting: per-entry (memory, disk) sizes, running totals and
//! the `max_spill` capacity check.
//!
//! The ledger is a plain value; `store::FileStore` keeps it behind a mutex so
//! that "check capacity, then reserve" is one atomic step even when several
//! threads spill at once. A reservation is taken before a file is written and
//! either committed (the file exists) or released (the write failed), so two
//! concurrent writers can never both pass the check and overshoot the limit.
//!
//! Hard links: a file with k links counts `disk / k` for each holder, so
//! that holders' totals add up to the bytes the host uses. The ledger keeps
//! the last known link count of every shared entry and the running sum of
//! those shares (`split_disk`), updated on commit, link, unlink and removal:
//! the split total is O(1), whatever the number of entries. Link counts that
//! other processes change (a peer dropping its link) are corrected by the
//! store's `refresh_links`, which stats the shared files.

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
    /// from a peer), with their last known link count (at least 1); their
    /// disk size is shared among the links.
    shared: HashMap<String, u64>,
    /// Sum over entries of `disk / links` (links = 1 for unshared entries).
    split_disk: u64,
    /// Entries whose file has been memory-mapped: a mapping may outlive the
    /// entry, so their file must never be overwritten (recycled).
    pinned: HashSet<String>,
    /// Copying reads in progress per name. A file removed while being read
    /// is never recycled (the reader still holds it open). Counts may outlive
    /// their entry until the read ends; names are never reused by a store.
    readers: HashMap<String, u32>,
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
            let links = self.shared.remove(name).unwrap_or(1);
            self.pinned.remove(name);
            self.subtract(old, links);
        }
        self.total.memory += sizes.memory;
        self.total.disk += sizes.disk;
        self.split_disk += sizes.disk;
    }

    pub fn remove(&mut self, name: &str) -> Option<Sizes> {
        self.remove_entry(name).map(|(sizes, _)| sizes)
    }

    /// Remove an entry; also tells whether nobody else can still see its
    /// file through us: never shared, never mapped, no read in progress.
    pub fn remove_entry(&mut self, name: &str) -> Option<(Sizes, bool)> {
        let sizes = self.entries.remove(name)?;
        let links = self.shared.remove(name);
        let pinned = self.pinned.remove(name);
        let private = links.is_none() && !pinned && !self.readers.contains_key(name);
        self.subtract(sizes, links.unwrap_or(1));
        Some((sizes, private))
    }

    /// Record that the entry's file has been mapped (see `pinned`). Returns
    /// false for an unknown name.
    pub fn pin(&mut self, name: &str) -> bool {
        if !self.entries.contains_key(name) {
            return false;
        }
        self.pinned.insert(name.to_owned());
        true
    }

    /// Count a copying read of a known entry as in progress; false for an
    /// unknown name (nothing counted). Pair with `end_read`.
    pub fn begin_read(&mut self, name: &str) -> bool {
        if !self.entries.contains_key(name) {
            return false;
        }
        *self.readers.entry(name.to_owned()).or_insert(0) += 1;
        true
    }

    /// End a read counted by `begin_read` (the entry may be gone by now).
    pub fn end_read(&mut self, name: &str) {
        if let Some(n) = self.readers.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.readers.remove(name);
            }
        }
    }

    fn subtract(&mut self, sizes: Sizes, links: u64) {
        self.total.memory -= sizes.memory;
        self.total.disk -= sizes.disk;
        self.split_disk -= sizes.disk / links;
    }

    /// Record that the entry's file may have other hard links and that it
    /// has `links` of them now (0 is taken as 1). Returns false for an
    /// unknown name. O(1).
    pub fn mark_shared(&mut self, name: &str, links: u64) -> bool {
        let Some(sizes) = self.entries.get(name) else {
            return false;
        };
        let links = links.max(1);
        let old = self.shared.insert(name.to_owned(), links).unwrap_or(1);
        self.split_disk = self.split_disk - sizes.disk / old + sizes.disk / links;
        true
    }

    /// Update the link count of an entry that is still shared (one that was
    /// removed meanwhile is left alone). Returns whether it changed.
    pub fn update_links(&mut self, name: &str, links: u64) -> bool {
        match self.shared.get(name) {
            Some(&old) if old != links.max(1) => self.mark_shared(name, links),
            _ => false,
        }
    }

    pub fn is_shared(&self, name: &str) -> bool {
        self.shared.contains_key(name)
    }

    /// Last known link count of an entry (1 if it was never shared), None
    /// for an unknown name.
    pub fn links(&self, name: &str) -> Option<u64> {
        self.entries.get(name)?;
        Some(self.shared.get(name).copied().unwrap_or(1))
    }

    /// Names of the shared entries (whose link counts may change behind our back).
    pub fn shared_names(&self) -> Vec<String> {
        self.shared.keys().cloned().collect()
    }

    pub fn shared_len(&self) -> usize {
        self.shared.len()
    }

    /// Totals with the disk size of each shared entry divided by its last
    /// known link count. O(1).
    pub fn split_total(&self) -> Sizes {
        Sizes {
            memory: self.total.memory,
            disk: self.split_disk,
        }
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
    fn removal_tells_whether_the_file_was_private() {
        let mut ledger = Ledger::new();
        let one = Sizes { memory: 1, disk: 1 };
        for name in ["plain", "shared", "pinned", "read", "read-done"] {
            ledger.try_reserve(1, None);
            ledger.commit(name, one);
        }
        assert!(ledger.mark_shared("shared", 2));
        assert!(ledger.pin("pinned"));
        assert!(!ledger.pin("unknown"));
        assert!(!ledger.begin_read("unknown"));
        assert!(ledger.begin_read("read"));
        assert!(ledger.begin_read("read-done"));
        ledger.end_read("read-done");
        assert_eq!(ledger.remove_entry("plain"), Some((one, true)));
        assert_eq!(ledger.remove_entry("shared"), Some((one, false)));
        assert_eq!(ledger.remove_entry("pinned"), Some((one, false)));
        assert_eq!(ledger.remove_entry("read"), Some((one, false)));
        assert_eq!(ledger.remove_entry("read-done"), Some((one, true)));
        assert_eq!(ledger.remove_entry("plain"), None);
        // a read that outlives its entry still ends cleanly
        ledger.end_read("read");
        assert!(ledger.readers.is_empty());
        assert_eq!(ledger.total(), Sizes::default());
    }

    #[test]
    fn split_total_follows_links_without_looking_at_files() {
        let mut ledger = Ledger::new();
        let commit = |l: &mut Ledger, name: &str, disk: u64| {
            l.try_reserve(disk, None);
            l.commit(name, Sizes { memory: 1, disk });
        };
        commit(&mut ledger, "a", 1200);
        commit(&mut ledger, "b", 600);
        assert_eq!(
            ledger.split_total(),
            Sizes {
                memory: 2,
                disk: 1800
            }
        );
        assert_eq!(ledger.links("a"), Some(1));
        // handed out: 2 links, then a peer adopts: 3
        assert!(ledger.mark_shared("a", 2));
        assert_eq!(ledger.split_total().disk, 600 + 600);
        assert!(ledger.update_links("a", 3));
        assert_eq!(ledger.split_total().disk, 400 + 600);
        assert!(!ledger.update_links("a", 3), "unchanged");
        assert!(!ledger.update_links("b", 5), "never shared: left alone");
        assert!(!ledger.mark_shared("unknown", 2));
        assert_eq!(ledger.links("unknown"), None);
        // 0 links (the file vanished) counts as 1
        assert!(ledger.update_links("a", 0));
        assert_eq!(ledger.split_total().disk, 1200 + 600);
        assert!(ledger.update_links("a", 4));
        assert_eq!(ledger.shared_names(), vec!["a".to_owned()]);
        // removal takes away the share it had, replacement the old one
        assert_eq!(ledger.remove("a").unwrap().disk, 1200);
        assert_eq!(
            ledger.split_total(),
            Sizes {
                memory: 1,
                disk: 600
            }
        );
        assert!(ledger.mark_shared("b", 3));
        commit(&mut ledger, "b", 90);
        assert_eq!(
            ledger.split_total(),
            Sizes {
                memory: 1,
                disk: 90
            }
        );
        assert!(!ledger.is_shared("b"));
        ledger.remove("b");
        assert_eq!(ledger.split_total(), Sizes::default());
        assert_eq!(ledger.shared_len(), 0);
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
