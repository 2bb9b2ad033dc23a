//! Tier 2 -> tier 3 of a shared-memory spill buffer: moving a file from the
//! tmpfs store to a store on a real file system (`move_entry`), and the
//! tier-2 byte budget that decides which files move (`TierBudget`).
//!
//! The move copies in the kernel ([`crate::fs::copy_file`]), publishes the
//! copy whole under the destination's naming rules, accounts it there with the
//! same memory size, and only then removes the source entry: a failure at any
//! step leaves the source untouched.

use std::collections::{BTreeMap, HashMap};

use crate::store::{FileStore, StoreError};

/// Move entry `name` of `src` into `dst`: copy its file, account it in `dst`
/// with the same memory size, then remove it from `src`. Returns the entry's
/// name in `dst` and its bytes on disk. Errors (unknown name, ENOSPC, ...)
/// leave `src` unchanged and nothing in `dst`.
pub fn move_entry(
    src: &FileStore,
    name: &str,
    dst: &FileStore,
) -> Result<(String, u64), StoreError> {
    let memory = src
        .sizes(name)
        .ok_or_else(|| StoreError::Missing(name.to_owned()))?
        .memory;
    let stem = name.rsplit_once('#').map_or(name, |(stem, _)| stem);
    let moved = {
        let reader = src.open_entry(name)?;
        dst.put_copy(stem, &reader.file, reader.size, memory)?
    };
    if src.remove(name)?.is_none() {
        // Removed from `src` by another thread during the copy: the copy
        // must not bring it back.
        let _ = dst.remove(&moved.0);
        return Err(StoreError::Missing(name.to_owned()));
    }
    Ok(moved)
}

#[derive(Debug, Clone)]
struct Entry {
    size: u64,
    last_use: u64,
    pins: u32,
    /// Moves after the others (see `TierBudget::set_deferred`).
    deferred: bool,
}

/// What to do before writing `incoming` bytes to tier 2.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    /// Least recently used unpinned entries to move to tier 3, oldest first.
    pub victims: Vec<String>,
    /// Whether the new file fits in tier 2 once the victims are gone; when
    /// false the victims only bring tier 2 back within its budget.
    pub fits: bool,
}

/// Byte budget of tier 2 with least-recently-used order. Pinned entries
/// (files mapped by values in memory) are never chosen to move. Pure
/// bookkeeping: the caller moves the files and reports back with `remove`.
///
/// Every operation is O(log n) in the number of entries, and `plan` is
/// O(1) when the incoming bytes fit without moving anything (the common
/// case): the unpinned entries are kept in LRU order with their byte total,
/// instead of being collected and sorted at every write.
#[derive(Debug, Default)]
pub struct TierBudget {
    limit: u64,
    used: u64,
    clock: u64,
    entries: HashMap<String, Entry>,
    /// last use -> name of every unpinned entry that is not deferred, least
    /// recently used first (each use has its own tick of `clock`, so a last
    /// use names one entry)
    movable: BTreeMap<u64, String>,
    /// the same for the unpinned deferred entries
    movable_deferred: BTreeMap<u64, String>,
    /// bytes of the entries in `movable` and `movable_deferred`
    movable_bytes: u64,
}

impl TierBudget {
    pub fn new(limit: u64) -> Self {
        TierBudget {
            limit,
            ..Default::default()
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn movable_of(&mut self, e: &Entry) -> &mut BTreeMap<u64, String> {
        if e.deferred {
            &mut self.movable_deferred
        } else {
            &mut self.movable
        }
    }

    fn make_movable(&mut self, name: &str, e: &Entry) {
        self.movable_of(e).insert(e.last_use, name.to_owned());
        self.movable_bytes += e.size;
    }

    fn make_fixed(&mut self, e: &Entry) {
        if self.movable_of(e).remove(&e.last_use).is_some() {
            self.movable_bytes -= e.size;
        }
    }

    /// Account a new tier-2 entry (replacing one of the same name).
    pub fn add(&mut self, name: &str, size: u64) {
        self.remove(name);
        let last_use = self.tick();
        let e = Entry {
            size,
            last_use,
            pins: 0,
            deferred: false,
        };
        self.make_movable(name, &e);
        self.entries.insert(name.to_owned(), e);
        self.used += size;
    }

    /// Forget an entry (deleted or moved); false if unknown.
    pub fn remove(&mut self, name: &str) -> bool {
        match self.entries.remove(name) {
            Some(e) => {
                self.make_fixed(&e);
                self.used -= e.size;
                true
            }
            None => false,
        }
    }

    /// Mark an entry as just used.
    pub fn touch(&mut self, name: &str) {
        let now = self.tick();
        self.reuse(name, now, 0);
    }

    /// Set the entry's last use to `now` and add `pins` to its pins.
    fn reuse(&mut self, name: &str, now: u64, pins: u32) {
        self.update(name, |e| Entry {
            last_use: now,
            pins: e.pins + pins,
            ..e
        });
    }

    /// Replace a known entry by `change` of it, keeping the movable maps in
    /// step.
    fn update(&mut self, name: &str, change: impl FnOnce(Entry) -> Entry) {
        let Some(e) = self.entries.get(name).cloned() else {
            return;
        };
        if e.pins == 0 {
            self.make_fixed(&e);
        }
        let e = change(e);
        if e.pins == 0 {
            self.make_movable(name, &e);
        }
        self.entries.insert(name.to_owned(), e);
    }

    /// A value maps the entry's file: it must not move. Pins nest.
    pub fn pin(&mut self, name: &str) {
        let now = self.tick();
        self.reuse(name, now, 1);
    }

    pub fn unpin(&mut self, name: &str) {
        let Some(e) = self.entries.get_mut(name) else {
            return;
        };
        if e.pins == 0 {
            return;
        }
        e.pins -= 1;
        if e.pins == 0 {
            let e = e.clone();
            self.make_movable(name, &e);
        }
    }

    pub fn is_pinned(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|e| e.pins > 0)
    }

    /// Whether the entry moves only after every entry that is not deferred
    /// (a file another holder links too: moving it frees no RAM while that
    /// link lives). Its last use stays as it was.
    pub fn set_deferred(&mut self, name: &str, deferred: bool) {
        self.update(name, |e| Entry { deferred, ..e });
    }

    pub fn is_deferred(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|e| e.deferred)
    }

    /// Which entries to move so that `incoming` more bytes fit: least
    /// recently used first, the deferred ones after all the others. O(victims).
    pub fn plan(&self, incoming: u64) -> Plan {
        let over = |extra: u64| (self.used + extra).saturating_sub(self.limit);
        let fits = incoming <= self.limit && over(incoming) <= self.movable_bytes;
        let need = if fits { over(incoming) } else { over(0) };
        let mut victims = Vec::new();
        let mut freed = 0;
        for name in self.movable.values().chain(self.movable_deferred.values()) {
            if freed >= need {
                break;
            }
            let size = self.entries[name].size;
            freed += size;
            victims.push(name.clone());
        }
        Plan { victims, fits }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::PutOutcome;

    #[test]
    fn an_entry_removed_during_its_move_is_not_brought_back() {
        use std::sync::{Arc, Barrier};
        let tmp = tempfile::tempdir().unwrap();
        let src = Arc::new(FileStore::open(tmp.path().join("src")).unwrap());
        let dst = Arc::new(FileStore::open(tmp.path().join("dst")).unwrap());
        let data = vec![7u8; 8 << 20];
        for i in 0..20 {
            let name = put(&src, &format!("k{i}"), &data);
            let start = Arc::new(Barrier::new(2));
            let (s, d, n, b) = (src.clone(), dst.clone(), name.clone(), start.clone());
            let mover = std::thread::spawn(move || {
                b.wait();
                move_entry(&s, &n, &d).is_ok()
            });
            start.wait();
            std::thread::sleep(std::time::Duration::from_micros(300));
            let deleted = src.remove(&name).unwrap().is_some();
            let moved = mover.join().unwrap();
            // exactly one of them had the entry
            assert!(moved != deleted, "moved {moved}, deleted {deleted}");
        }
        assert_eq!(src.len(), 0);
    }

    fn put(store: &FileStore, stem: &str, bytes: &[u8]) -> String {
        match store.put(stem, &[bytes], 7, None).unwrap() {
            PutOutcome::Stored { name, .. } => name,
            PutOutcome::OverCapacity => unreachable!(),
        }
    }

    #[test]
    fn move_entry_copies_accounts_and_removes_the_source() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = FileStore::open(a.path().join("s")).unwrap();
        let dst = FileStore::open(b.path().join("d")).unwrap();
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
        let name = put(&src, "key", &payload);
        let before = src.sizes(&name).unwrap();
        let (moved, disk) = move_entry(&src, &name, &dst).unwrap();
        assert!(moved.starts_with("key#"));
        assert_eq!(disk, before.disk);
        assert!(src.sizes(&name).is_none());
        assert!(!src.path_of(&name).exists());
        assert_eq!(src.total().disk, 0);
        assert_eq!(dst.sizes(&moved).unwrap().memory, 7);
        assert_eq!(dst.total().disk, disk);
        let (map, layout) = dst.map(&moved).unwrap();
        let (off, len) = layout.frames[0];
        assert_eq!(&map[off as usize..(off + len) as usize], &payload[..]);
        // Permissions of the copy follow the store's rules.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dst.path_of(&moved))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn move_of_an_unknown_or_vanished_entry_changes_nothing() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = FileStore::open(a.path().join("s")).unwrap();
        let dst = FileStore::open(b.path().join("d")).unwrap();
        assert!(move_entry(&src, "nope#1", &dst).is_err());
        let name = put(&src, "k", b"abc");
        std::fs::remove_file(src.path_of(&name)).unwrap();
        assert!(move_entry(&src, &name, &dst).is_err());
        assert!(src.sizes(&name).is_some(), "source entry kept on failure");
        assert!(dst.is_empty());
        assert_eq!(std::fs::read_dir(dst.directory()).unwrap().count(), 0);
    }

    #[test]
    fn budget_moves_least_recently_used_unpinned_files() {
        let mut b = TierBudget::new(100);
        b.add("a", 40);
        b.add("b", 40);
        b.add("c", 20);
        assert_eq!(b.used(), 100);
        b.touch("a"); // order now b, c, a
        let plan = b.plan(30);
        assert_eq!(
            plan,
            Plan {
                victims: vec!["b".into()],
                fits: true
            }
        );
        b.pin("b");
        let plan = b.plan(30);
        assert_eq!(
            plan,
            Plan {
                victims: vec!["c".into(), "a".into()],
                fits: true
            }
        );
        assert!(b.plan(0).victims.is_empty(), "within budget: nothing moves");
    }

    #[test]
    fn budget_refuses_what_cannot_fit_and_restores_the_limit() {
        let mut b = TierBudget::new(100);
        b.add("a", 60);
        b.add("b", 60); // over budget by 20
        b.pin("b");
        // Larger than the whole budget: goes to tier 3; tier 2 trimmed to its limit.
        assert_eq!(
            b.plan(101),
            Plan {
                victims: vec!["a".into()],
                fits: false
            }
        );
        // Pinned files cannot make room: does not fit.
        b.pin("a");
        assert_eq!(
            b.plan(10),
            Plan {
                victims: vec![],
                fits: false
            }
        );
        b.unpin("a");
        b.unpin("b");
        b.unpin("b"); // extra unpins are harmless
        assert!(!b.is_pinned("b"));
        assert!(b.remove("a"));
        assert!(!b.remove("a"));
        assert_eq!(b.used(), 60);
        b.set_limit(50);
        assert_eq!(
            b.plan(0),
            Plan {
                victims: vec!["b".into()],
                fits: true
            }
        );
    }

    #[test]
    fn zero_budget_sends_everything_to_tier_three() {
        let b = TierBudget::new(0);
        assert_eq!(
            b.plan(1),
            Plan {
                victims: vec![],
                fits: false
            }
        );
        assert!(b.plan(0).fits);
    }

    /// The plan every write of the previous version made: collect the
    /// unpinned entries, sort them by last use, take the oldest.
    fn sorted_plan(b: &TierBudget, incoming: u64) -> Plan {
        let over = |extra: u64| (b.used + extra).saturating_sub(b.limit);
        let mut movable: Vec<(&String, &Entry)> =
            b.entries.iter().filter(|(_, e)| e.pins == 0).collect();
        movable.sort_by_key(|(name, e)| (e.last_use, name.as_str()));
        let freeable: u64 = movable.iter().map(|(_, e)| e.size).sum();
        let fits = incoming <= b.limit && over(incoming) <= freeable;
        let need = if fits { over(incoming) } else { over(0) };
        let (mut victims, mut freed) = (Vec::new(), 0);
        for (name, e) in movable {
            if freed >= need {
                break;
            }
            freed += e.size;
            victims.push(name.clone());
        }
        Plan { victims, fits }
    }

    #[test]
    fn budget_plans_as_sorting_every_entry_would() {
        // A fixed pseudo-random sequence of every operation on 40 names.
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut b = TierBudget::new(1_000);
        for _ in 0..20_000 {
            let name = format!("k{}", next(40));
            match next(7) {
                0 | 1 => b.add(&name, 1 + next(120)),
                2 => {
                    b.remove(&name);
                }
                3 => b.touch(&name),
                4 => b.pin(&name),
                5 => b.unpin(&name),
                _ => b.set_limit(200 + next(1_500)),
            }
            let incoming = next(400);
            assert_eq!(b.plan(incoming), sorted_plan(&b, incoming));
            let movable: u64 = b
                .entries
                .values()
                .filter(|e| e.pins == 0)
                .map(|e| e.size)
                .sum();
            assert_eq!(b.movable_bytes, movable);
            assert_eq!(
                b.movable.len(),
                b.entries.values().filter(|e| e.pins == 0).count()
            );
        }
    }

    #[test]
    fn deferred_entries_move_after_the_others_in_lru_order() {
        let mut b = TierBudget::new(100);
        for (name, size) in [("s1", 20), ("u1", 20), ("s2", 20), ("u2", 20), ("s3", 20)] {
            b.add(name, size);
            b.set_deferred(name, name.starts_with('s'));
        }
        assert!(b.plan(0).victims.is_empty() && b.plan(0).fits);
        // The two unshared ones suffice, whatever their age; then the
        // deferred ones, oldest first.
        assert_eq!(b.plan(30).victims, ["u1", "u2"]);
        assert_eq!(b.plan(50).victims, ["u1", "u2", "s1"]);
        // Deferring keeps an entry's last use; a use moves it back.
        b.set_deferred("u1", true);
        assert_eq!(b.plan(30).victims, ["u2", "s1"]);
        b.set_deferred("u1", false);
        b.touch("u1");
        b.touch("s1");
        assert_eq!(b.plan(70).victims, ["u2", "u1", "s2", "s3"]);
        // Pinned entries never move, deferred or not; unpinned they come back.
        b.pin("s2");
        b.set_deferred("s2", false);
        assert_eq!(b.plan(60).victims, ["u2", "u1", "s3"]);
        b.unpin("s2");
        assert!(!b.is_deferred("s2") && b.is_deferred("s3"));
        assert_eq!(b.plan(60).victims, ["u2", "u1", "s2"]);
        assert!(b.remove("s3") && b.used() == 80);
        assert_eq!(b.plan(100).victims, ["u2", "u1", "s2", "s1"]);
    }
}
