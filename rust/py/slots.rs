//! Where the `__slots__` attributes of a Python class live in its objects,
//! so that a loop over many objects can ask the CPU for the objects those
//! attributes point to ahead of reading them.
//!
//! An AMM run reads a few attributes of each of thousands of scheduler
//! objects (`TaskState.who_has`, `.waiters`, ...). Those reads go through
//! `getattr`, which takes a reference to the value: a cache miss on the value
//! object, taken one at a time. Knowing the slot offsets, a loop can read the
//! slots of objects it reaches a few steps later and prefetch their values,
//! so the misses overlap. The reads that produce results still go through
//! `getattr`; the offsets only ever feed prefetch hints, which cannot fault.
//!
//! The offsets are measured, not assumed: [`SlotOffsets::of`] stores a
//! sentinel in each attribute of a fresh instance and finds it in the
//! object's memory. A class whose attribute access is customised
//! (`__getattribute__`, `__getattr__`) or whose attributes are not plain slots
//! gets `None`.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyType;

/// Byte offsets of some slot attributes in the objects of one exact class.
#[derive(Debug, Clone)]
pub(crate) struct SlotOffsets {
    class: usize,
    offsets: Vec<usize>,
}

impl SlotOffsets {
    /// The offsets of `names` in objects of exactly `class` (measured once
    /// per class and process, then cached); None if any is not a plain slot.
    pub(crate) fn of(class: &Bound<'_, PyType>, names: &[&str]) -> Option<SlotOffsets> {
        type Cache = HashMap<(usize, Vec<String>), (Py<PyType>, Option<Vec<usize>>)>;
        static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
        let key = (
            class.as_ptr() as usize,
            names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
        );
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let cache = cache.get_or_insert_with(HashMap::new);
        let offsets = match cache.get(&key) {
            Some((_, found)) => found.clone(),
            None => {
                let found = measure(class, names).ok().flatten();
                // The strong reference keeps the class (and its address) alive.
                cache.insert(key, (class.clone().unbind(), found.clone()));
                found
            }
        };
        offsets.map(|offsets| SlotOffsets {
            class: class.as_ptr() as usize,
            offsets,
        })
    }

    /// The address stored in slot `i` of `obj` (0 if unset), if `obj` is
    /// exactly of the measured class; None otherwise. Only for hints.
    #[inline]
    pub(crate) fn peek(&self, obj: &Bound<'_, PyAny>, i: usize) -> Option<usize> {
        if obj.get_type().as_ptr() as usize != self.class {
            return None;
        }
        // SAFETY: `obj` is an instance of the class whose basic size holds
        // this offset (checked by `measure`); a slot is one aligned pointer.
        Some(unsafe {
            obj.as_ptr()
                .cast::<u8>()
                .add(self.offsets[i])
                .cast::<usize>()
                .read()
        })
    }
}

/// Store a sentinel in each of `names` on a fresh instance of `class` and
/// find where it lands; None for any name that is not a plain slot.
fn measure(class: &Bound<'_, PyType>, names: &[&str]) -> PyResult<Option<Vec<usize>>> {
    let py = class.py();
    let object = py.import("builtins")?.getattr("object")?;
    let generic = object.getattr("__getattribute__")?;
    if !class.getattr("__getattribute__")?.is(&generic) || class.hasattr("__getattr__")? {
        return Ok(None);
    }
    let size: usize = class.getattr("__basicsize__")?.extract()?;
    let instance = object.call_method1("__new__", (class,))?;
    let mut offsets = Vec::with_capacity(names.len());
    for name in names {
        let mut found = None;
        for _ in 0..2 {
            let sentinel = object.call0()?;
            instance.setattr(*name, &sentinel)?;
            if !instance.getattr(*name)?.is(&sentinel) {
                return Ok(None);
            }
            let want = sentinel.as_ptr() as usize;
            // SAFETY: `instance` is an object of `size` bytes; aligned
            // pointer-sized reads within it.
            let hits: Vec<usize> = (0..size / 8)
                .map(|i| i * 8)
                .filter(|&off| unsafe {
                    instance
                        .as_ptr()
                        .cast::<u8>()
                        .add(off)
                        .cast::<usize>()
                        .read()
                        == want
                })
                .collect();
            match (hits.as_slice(), found) {
                ([off], None) => found = Some(*off),
                ([off], Some(prev)) if *off == prev => {}
                _ => return Ok(None),
            }
        }
        offsets.push(found.expect("set by the loop"));
    }
    Ok(Some(offsets))
}

/// Steps ahead at which a loop over many objects asks for an object's own
/// cache lines, then (its slots being in the cache by then) for the objects
/// its slots point to.
const OBJECT_AHEAD: usize = 16;
const VALUES_AHEAD: usize = 8;

/// The prefetches of step `i` of a loop over `items`: `object` for the item
/// `OBJECT_AHEAD` steps on, `values` for the one `VALUES_AHEAD` steps on.
#[inline]
pub(crate) fn prefetch_ahead<T>(items: &[T], i: usize, object: impl Fn(&T), values: impl Fn(&T)) {
    if let Some(item) = items.get(i + OBJECT_AHEAD) {
        object(item);
    }
    if let Some(item) = items.get(i + VALUES_AHEAD) {
        values(item);
    }
}

/// Ask the CPU to start loading cache lines `lines` (64 bytes each) of the
/// object at `addr`. A hint: it never faults nor changes memory, whatever the
/// address.
#[inline]
pub(crate) fn prefetch_at(addr: usize, lines: std::ops::RangeInclusive<usize>) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = addr as *const i8;
        for i in lines {
            // SAFETY: a prefetch never faults nor changes memory;
            // `wrapping_add` makes no claim about the address either.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * i)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, lines);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    #[test]
    fn offsets_of_slots_and_refusals() {
        Python::initialize();
        Python::attach(|py| {
            let code = CString::new(
                "class A:\n    __slots__ = ('x', 'y')\n\
                 class B(A):\n    __slots__ = ('z',)\n\
                 class C:\n    __slots__ = ('x',)\n    def __getattr__(self, n): return 1\n\
                 class D:\n    pass\n",
            )
            .unwrap();
            let m = PyModule::from_code(py, &code, c"slots_test.py", c"slots_test").unwrap();
            let class = |n: &str| m.getattr(n).unwrap().cast_into::<PyType>().unwrap();
            let b = class("B");
            let offsets = SlotOffsets::of(&b, &["z", "x", "y"]).expect("plain slots");
            let obj = b.call0().unwrap();
            for (i, name) in ["z", "x", "y"].iter().enumerate() {
                let value = py
                    .import("builtins")
                    .unwrap()
                    .getattr("object")
                    .unwrap()
                    .call0()
                    .unwrap();
                obj.setattr(*name, &value).unwrap();
                assert_eq!(offsets.peek(&obj, i), Some(value.as_ptr() as usize));
            }
            // An instance of another class is not read.
            assert_eq!(offsets.peek(&class("A").call0().unwrap(), 1), None);
            assert!(SlotOffsets::of(&class("C"), &["x"]).is_none());
            assert!(SlotOffsets::of(&class("D"), &["x"]).is_none());
        });
    }
}
