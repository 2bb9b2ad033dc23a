//! The bytes of a strided array, in C order, as the contiguous runs they are
//! made of: what a vectored write takes to store a view such as numpy's
//! `a[1:, 1:]` without first copying it into a contiguous buffer.

/// `(offset from the buffer's start, length)` of each contiguous run of an
/// array of `shape` with `strides` (in bytes) and items of `itemsize` bytes,
/// in C order: written back to back, the runs are the bytes a C-contiguous
/// copy of the array holds. A run spans the innermost dimensions whose
/// strides are those of a C-contiguous array (dimensions of length 1 count
/// as such, whatever their stride).
///
/// None when the innermost dimension is not contiguous (every run would be one
/// item), a run would be shorter than `min_run` bytes, or there would be more
/// than `max_runs` runs: then a copy is cheaper than the pieces. An array with
/// no items has no runs.
pub fn c_order_runs(
    itemsize: usize,
    shape: &[usize],
    strides: &[isize],
    min_run: usize,
    max_runs: usize,
) -> Option<Vec<(isize, usize)>> {
    if shape.len() != strides.len() || itemsize == 0 {
        return None;
    }
    if shape.contains(&0) {
        return Some(Vec::new());
    }
    // The trailing dimensions that one run covers.
    let mut outer = shape.len();
    let mut run = itemsize;
    while outer > 0 && (shape[outer - 1] == 1 || strides[outer - 1] == run as isize) {
        run = run.checked_mul(shape[outer - 1])?;
        outer -= 1;
    }
    if outer == shape.len() && shape.last().is_some_and(|&n| n > 1) {
        return None;
    }
    if outer == 0 {
        return Some(vec![(0, run)]);
    }
    let count = shape[..outer]
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))?;
    if run < min_run || count > max_runs {
        return None;
    }
    let mut runs = Vec::with_capacity(count);
    let mut index = vec![0usize; outer];
    let mut offset: isize = 0;
    for _ in 0..count {
        runs.push((offset, run));
        // Next index in C order: the last outer dimension moves fastest.
        for d in (0..outer).rev() {
            index[d] += 1;
            offset += strides[d];
            if index[d] < shape[d] {
                break;
            }
            offset -= strides[d] * shape[d] as isize;
            index[d] = 0;
        }
    }
    Some(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of the runs over `buf`, concatenated.
    fn gather(buf: &[u8], base: usize, runs: &[(isize, usize)]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(offset, len) in runs {
            let start = (base as isize + offset) as usize;
            out.extend_from_slice(&buf[start..start + len]);
        }
        out
    }

    #[test]
    fn a_contiguous_array_is_one_run() {
        assert_eq!(
            c_order_runs(8, &[4, 5], &[40, 8], 0, 100),
            Some(vec![(0, 160)])
        );
        assert_eq!(c_order_runs(8, &[], &[], 0, 100), Some(vec![(0, 8)]));
    }

    #[test]
    fn a_sliced_matrix_is_one_run_per_row() {
        // a 4 x 4 matrix of u8 items 0..16, viewed as a[1:, 1:]
        let buf: Vec<u8> = (0..16).collect();
        let runs = c_order_runs(1, &[3, 3], &[4, 1], 0, 100).unwrap();
        assert_eq!(runs, vec![(0, 3), (4, 3), (8, 3)]);
        assert_eq!(gather(&buf, 5, &runs), vec![5, 6, 7, 9, 10, 11, 13, 14, 15]);
    }

    #[test]
    fn runs_span_every_contiguous_trailing_dimension() {
        // a[::2] of a 4 x 2 x 3 array: each of the 2 runs holds a 2 x 3 block
        let buf: Vec<u8> = (0..24).collect();
        let runs = c_order_runs(1, &[2, 2, 3], &[12, 3, 1], 0, 100).unwrap();
        assert_eq!(runs, vec![(0, 6), (12, 6)]);
        assert_eq!(
            gather(&buf, 0, &runs),
            vec![0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]
        );
        // a[:, :, 1:] of the same 4 x 2 x 3 array: 8 runs of 2, in C order
        let runs = c_order_runs(1, &[4, 2, 2], &[6, 3, 1], 0, 100).unwrap();
        let expected: Vec<u8> = (0..24).filter(|i| i % 3 != 0).collect();
        assert_eq!(gather(&buf, 1, &runs), expected);
    }

    #[test]
    fn dimensions_of_one_and_negative_strides() {
        // a[::-1, 1:] of a 3 x 4 array, with a length-1 axis in between
        let buf: Vec<u8> = (0..12).collect();
        let runs = c_order_runs(1, &[3, 1, 3], &[-4, 999, 1], 0, 100).unwrap();
        assert_eq!(gather(&buf, 9, &runs), vec![9, 10, 11, 5, 6, 7, 1, 2, 3]);
    }

    #[test]
    fn no_runs_where_a_copy_is_cheaper() {
        // innermost dimension strided (a[:, ::2])
        assert_eq!(c_order_runs(8, &[4, 2], &[32, 16], 0, 100), None);
        // runs under min_run, or too many of them
        assert_eq!(c_order_runs(8, &[4, 3], &[32, 8], 25, 100), None);
        assert_eq!(c_order_runs(8, &[4, 3], &[32, 8], 24, 3), None);
        assert_eq!(
            c_order_runs(8, &[4, 3], &[32, 8], 24, 4).map(|r| r.len()),
            Some(4)
        );
        // inconsistent input
        assert_eq!(c_order_runs(8, &[4, 3], &[32], 0, 100), None);
    }

    #[test]
    fn an_empty_array_has_no_runs() {
        assert_eq!(c_order_runs(8, &[0, 3], &[24, 8], 0, 100), Some(vec![]));
    }
}
