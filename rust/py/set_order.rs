//! The iteration order of a Python `set`, read without touching its items.
//!
//! Stock ReduceReplicas decides tasks in the iteration order of
//! `scheduler.replicated_tasks`. When the tracker needs that order for a few
//! tasks (see `amm_tracker::order_as_iterated`), iterating the set through
//! the C API costs one reference-count write per item, that is one cache miss
//! per task of the cluster (~60 ns each: 6 ms for 100k tasks). A set iterates
//! in the order of its hash-table slots, so reading the slots' key pointers
//! gives the same order from one sequential read of the table.
//!
//! The table is not part of the limited API. Its layout (CPython's
//! `PySetObject`: object header, `fill`, `used`, `mask`, `table`) has not
//! changed since 3.4, and [`SetTable::of`] uses it only after
//! [`layout_matches`] checked it once per process against real iteration,
//! and only for exact `set` objects whose `used` and `mask` agree with
//! `len()`. Anything else gets `None`, and the caller iterates.

use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySet};

/// One slot of a set's hash table (CPython's `setentry`).
#[repr(C)]
struct SetEntry {
    key: *mut ffi::PyObject,
    hash: ffi::Py_hash_t,
}

/// The head of CPython's `PySetObject`, up to the table pointer.
#[repr(C)]
struct SetHead {
    ob_refcnt: ffi::Py_ssize_t,
    ob_type: *mut ffi::PyTypeObject,
    fill: ffi::Py_ssize_t,
    used: ffi::Py_ssize_t,
    mask: ffi::Py_ssize_t,
    table: *const SetEntry,
}

/// The slots of one exact `set`, borrowed while the GIL is held and no
/// Python code runs (nothing can resize or free the table meanwhile).
pub(crate) struct SetTable<'a> {
    slots: &'a [SetEntry],
}

impl<'a> SetTable<'a> {
    /// The table of `set`, if it is an exact `set`, the layout was verified,
    /// and its header agrees with `len(set)`.
    pub(crate) fn of(set: &'a Bound<'_, PyAny>) -> Option<SetTable<'a>> {
        if !set.is_exact_instance_of::<PySet>() || !layout_matches(set.py()) {
            return None;
        }
        // SAFETY: an exact set (checked above) is a PySetObject, whose layout
        // starts as `SetHead` (checked once by `layout_matches`).
        unsafe { Self::read(set) }
    }

    /// # Safety
    /// `set` must be an exact `set` with the `SetHead` layout.
    unsafe fn read(set: &'a Bound<'_, PyAny>) -> Option<SetTable<'a>> {
        let head = &*set.as_ptr().cast::<SetHead>();
        let len = set.len().ok()?;
        let size = usize::try_from(head.mask).ok()?.checked_add(1)?;
        if usize::try_from(head.used).ok()? != len
            || !size.is_power_of_two()
            || head.fill < head.used
            || head.table.is_null()
        {
            return None;
        }
        Some(SetTable {
            slots: std::slice::from_raw_parts(head.table, size),
        })
    }

    /// The slot of the item at address `addr` whose hash is `hash`, looked
    /// for in the slots that follow the one its hash selects (where CPython
    /// puts all but the items of long collision chains); None if not there.
    /// Items iterate in slot order.
    pub(crate) fn slot_near(&self, addr: usize, hash: isize) -> Option<usize> {
        const NEAR: usize = 16;
        let mask = self.slots.len() - 1;
        let home = hash as usize & mask;
        (0..NEAR.min(self.slots.len()))
            .map(|k| (home + k) & mask)
            .find(|&j| self.slots[j].key as usize == addr)
    }

    /// Addresses of the items, in iteration order. Slots that are empty or
    /// hold a deleted item's marker (its hash is -1) are skipped.
    pub(crate) fn addresses(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots
            .iter()
            .filter(|e| !e.key.is_null() && e.hash != -1)
            .map(|e| e.key as usize)
    }
}

/// Whether `SetHead` describes this interpreter's sets: checked once per
/// process on a set with deletions, against its real iteration order.
fn layout_matches(py: Python<'_>) -> bool {
    static MATCHES: OnceLock<bool> = OnceLock::new();
    *MATCHES.get_or_init(|| check_layout(py).unwrap_or(false))
}

fn check_layout(py: Python<'_>) -> PyResult<bool> {
    let object = py.import("builtins")?.getattr("object")?;
    let items = PyList::empty(py);
    for _ in 0..300 {
        items.append(object.call0()?)?;
    }
    let set = PySet::new(py, items.iter())?;
    for (i, item) in items.iter().enumerate() {
        if i % 3 == 0 {
            set.discard(item)?;
        }
    }
    let expected: Vec<usize> = set
        .as_any()
        .try_iter()?
        .map(|x| x.map(|x| x.as_ptr() as usize))
        .collect::<PyResult<_>>()?;
    // SAFETY: not yet known; `read` only reads within the object header and
    // (if the header looks like a set's) the table it points to, which holds
    // 2**k >= 200 entries: a different layout fails the header checks or the
    // comparison, it does not get here with a wild pointer on any CPython
    // 3.11+ build, whose set objects are at least this large.
    let walked: Option<Vec<usize>> =
        unsafe { SetTable::read(set.as_any()) }.map(|t| t.addresses().collect());
    Ok(walked.is_some_and(|w| w == expected))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_matches_iteration_after_adds_and_removes() {
        Python::initialize();
        Python::attach(|py| {
            assert!(layout_matches(py));
            let set = PySet::empty(py).unwrap();
            for round in 0..5i64 {
                for i in 0..1000i64 {
                    set.add(i * 7 + round).unwrap();
                }
                for i in (0..1000i64).step_by(2) {
                    set.discard(i * 7 + round).unwrap();
                }
                let table = SetTable::of(set.as_any()).expect("an exact set");
                let walked: Vec<usize> = table.addresses().collect();
                let iterated: Vec<usize> = set
                    .as_any()
                    .try_iter()
                    .unwrap()
                    .map(|x| x.unwrap().as_ptr() as usize)
                    .collect();
                assert_eq!(walked, iterated);
                // Slots found from hashes sort into the same order.
                let mut by_slot: Vec<(usize, usize)> = Vec::new();
                for item in set.iter() {
                    let a = item.as_ptr() as usize;
                    if let Some(j) = table.slot_near(a, item.hash().unwrap()) {
                        by_slot.push((j, a));
                    }
                }
                assert!(
                    by_slot.len() * 10 >= set.len() * 9,
                    "most items are near home"
                );
                by_slot.sort_unstable();
                let found: Vec<usize> = by_slot.iter().map(|&(_, a)| a).collect();
                let expected: Vec<usize> = iterated
                    .iter()
                    .copied()
                    .filter(|a| found.contains(a))
                    .collect();
                assert_eq!(found, expected);
            }
            let frozen = pyo3::types::PyFrozenSet::new(py, [1, 2]).unwrap();
            assert!(SetTable::of(frozen.as_any()).is_none());
        });
    }
}
