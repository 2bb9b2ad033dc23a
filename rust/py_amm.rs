//! Python face of `amm::WorkerTable`: `dask_shm._core.AmmWorkerTable`.
//!
//! Workers are plain indices `0..n`; the Python side maps them to
//! `WorkerState` objects. Every method validates its indices and offsets and
//! raises `ValueError`/`IndexError` instead of panicking. Choices come back as
//! a worker index (>= 0) or a negative rejection code (see `amm.rs`).

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::amm::WorkerTable;

fn check_indices(name: &str, workers: &[u32], n: usize) -> PyResult<()> {
    match workers.iter().find(|&&w| w as usize >= n) {
        Some(bad) => Err(PyIndexError::new_err(format!(
            "{name}: worker index {bad} out of range for {n} workers"
        ))),
        None => Ok(()),
    }
}

fn check_offsets(name: &str, offsets: &[usize], keys: usize, total: usize) -> PyResult<()> {
    let ok = offsets.len() == keys + 1
        && offsets[0] == 0
        && offsets[keys] == total
        && offsets.windows(2).all(|p| p[0] <= p[1]);
    if ok {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "{name}: expected {} non-decreasing offsets from 0 to {total}",
            keys + 1
        )))
    }
}

/// Per-run table of worker memory and status answering the AMM's
/// "find recipient" and "find dropper" questions.
#[pyclass(module = "dask_shm._core")]
pub struct AmmWorkerTable {
    inner: WorkerTable,
}

#[pymethods]
impl AmmWorkerTable {
    #[new]
    fn new(memory: Vec<i64>, running: Vec<bool>, eligible: Vec<bool>) -> PyResult<Self> {
        if memory.len() != running.len() || memory.len() != eligible.len() {
            return Err(PyValueError::new_err(
                "memory, running and eligible must have the same length",
            ));
        }
        if u32::try_from(memory.len()).is_err() {
            return Err(PyValueError::new_err("too many workers"));
        }
        Ok(AmmWorkerTable {
            inner: WorkerTable::new(memory, running, eligible),
        })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Memory of worker `w` downstream of the accepted actions.
    fn memory(&self, w: u32) -> PyResult<i64> {
        check_indices("w", &[w], self.inner.len())?;
        Ok(self.inner.memory(w))
    }

    /// Overwrite the memory of worker `w`.
    fn set_memory(&mut self, w: u32, value: i64) -> PyResult<()> {
        check_indices("w", &[w], self.inner.len())?;
        self.inner.set_memory(w, value);
        Ok(())
    }

    /// Choose and account a recipient; see `WorkerTable::find_recipient`.
    #[pyo3(signature = (candidates, holders, pending, nbytes))]
    fn replicate(
        &mut self,
        candidates: Option<Vec<u32>>,
        holders: Vec<u32>,
        pending: Vec<u32>,
        nbytes: i64,
    ) -> PyResult<i64> {
        let n = self.inner.len();
        check_indices("holders", &holders, n)?;
        check_indices("pending", &pending, n)?;
        if let Some(c) = &candidates {
            check_indices("candidates", c, n)?;
        }
        Ok(
            match self
                .inner
                .find_recipient(candidates.as_deref(), &holders, &pending)
            {
                Ok(w) => {
                    self.inner.add_replica(w, nbytes);
                    i64::from(w)
                }
                Err(e) => -(e as i64),
            },
        )
    }

    /// Choose and account a dropper; see `WorkerTable::find_dropper`.
    #[pyo3(signature = (holders, pending, candidates, dependents, nbytes))]
    fn drop(
        &mut self,
        holders: Vec<u32>,
        pending: Vec<u32>,
        candidates: Option<Vec<u32>>,
        dependents: Vec<u32>,
        nbytes: i64,
    ) -> PyResult<i64> {
        let n = self.inner.len();
        check_indices("holders", &holders, n)?;
        check_indices("pending", &pending, n)?;
        check_indices("dependents", &dependents, n)?;
        if let Some(c) = &candidates {
            check_indices("candidates", c, n)?;
        }
        Ok(
            match self
                .inner
                .find_dropper(&holders, &pending, candidates.as_deref(), &dependents)
            {
                Ok(w) => {
                    self.inner.drop_replica(w, nbytes);
                    i64::from(w)
                }
                Err(e) => -(e as i64),
            },
        )
    }

    /// Sequence of unrestricted replications; see `WorkerTable::replicate_many`.
    fn replicate_many(
        &mut self,
        nbytes: Vec<i64>,
        excluded: Vec<u32>,
        offsets: Vec<usize>,
    ) -> PyResult<Vec<i64>> {
        check_indices("excluded", &excluded, self.inner.len())?;
        check_offsets("offsets", &offsets, nbytes.len(), excluded.len())?;
        Ok(self.inner.replicate_many(&nbytes, &excluded, &offsets))
    }

    /// Sequence of drops; see `WorkerTable::drop_many`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (nbytes, counts, holders, holder_offsets, pending, pending_offsets,
                        dependents, dependent_offsets, candidate=None))]
    fn drop_many(
        &mut self,
        nbytes: Vec<i64>,
        counts: Vec<u32>,
        holders: Vec<u32>,
        holder_offsets: Vec<usize>,
        pending: Vec<u32>,
        pending_offsets: Vec<usize>,
        dependents: Vec<u32>,
        dependent_offsets: Vec<usize>,
        candidate: Option<u32>,
    ) -> PyResult<Vec<i64>> {
        let n = self.inner.len();
        let keys = nbytes.len();
        if counts.len() != keys {
            return Err(PyValueError::new_err("counts must have one entry per key"));
        }
        check_indices("holders", &holders, n)?;
        check_indices("pending", &pending, n)?;
        check_indices("dependents", &dependents, n)?;
        if let Some(c) = candidate {
            check_indices("candidate", &[c], n)?;
        }
        check_offsets("holder_offsets", &holder_offsets, keys, holders.len())?;
        check_offsets("pending_offsets", &pending_offsets, keys, pending.len())?;
        check_offsets(
            "dependent_offsets",
            &dependent_offsets,
            keys,
            dependents.len(),
        )?;
        Ok(self.inner.drop_many(
            &nbytes,
            &counts,
            &holders,
            &holder_offsets,
            &pending,
            &pending_offsets,
            &dependents,
            &dependent_offsets,
            candidate,
        ))
    }
}
