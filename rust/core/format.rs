//! On-disk layout of one spill file.
//!
//! ```text
//! offset 0   magic  b"DSK2"                           4 bytes
//!        4   frame count n (u32 little endian)        4 bytes
//!        8   n frame lengths (u64 little endian)      8 * n bytes
//!            frame 0, frame 1, ..., frame n-1
//! ```
//!
//! The header is exactly as long as the length prelude that stock distributed
//! writes in front of its spill files (a u64 count and a u64 per frame), and
//! frames follow each other with no padding, except that a frame of at least
//! [`ALIGN_MIN_LEN`] bytes starts on the next [`ALIGN`]-byte boundary of the
//! file (zero padding before it). So a value made of small frames takes the
//! same bytes on disk as in a stock spill file (`max_spill` trips at the same
//! point), while a large buffer read through a page-aligned `mmap` is aligned
//! for any numpy dtype and SIMD loads; only such buffers pay the (< `ALIGN`
//! bytes) padding. Small frames land where stock puts them too: unaligned.
//!
//! The layout is a function of the frame lengths alone, and the file ends
//! exactly where the last frame ends: any other size means the file was
//! truncated or extended and is rejected.

use std::fmt;

/// Alignment of the frames that get aligned (see [`ALIGN_MIN_LEN`]), in bytes.
pub const ALIGN: u64 = 64;
/// Frames at least this long start on an [`ALIGN`] boundary; shorter ones are
/// packed. A page: below it, an aligned zero-copy view gains nothing that
/// padding bytes on disk would pay for.
pub const ALIGN_MIN_LEN: u64 = 4096;
pub const MAGIC: &[u8; 4] = b"DSK2";
const WORD: u64 = 8;
/// Bytes of the fixed part of the header (magic and frame count).
const PREFIX: u64 = 8;

/// Refuse headers announcing more frames than this; protects against a
/// forged or corrupted count making us allocate gigabytes of offsets.
pub const MAX_FRAMES: u64 = 1 << 20;

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Byte range of each frame plus the total file size, computed from lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub header_len: u64,
    /// (offset, length) of each frame inside the file.
    pub frames: Vec<(u64, u64)>,
    pub file_size: u64,
}

impl Layout {
    pub fn for_lengths(lengths: &[u64]) -> Layout {
        let header_len = header_len_for(lengths.len() as u64);
        let mut frames = Vec::with_capacity(lengths.len());
        let mut end = header_len;
        for &len in lengths {
            let offset = if len >= ALIGN_MIN_LEN {
                align_up(end)
            } else {
                end
            };
            frames.push((offset, len));
            end = offset + len;
        }
        Layout {
            header_len,
            frames,
            file_size: end,
        }
    }

    /// Serialized header bytes (magic, count, lengths); padding is not included.
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.header_len as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.frames.len() as u32).to_le_bytes());
        for &(_, len) in &self.frames {
            out.extend_from_slice(&len.to_le_bytes());
        }
        out
    }

    /// Zero bytes to write after the header and after each frame (the last
    /// frame is never padded). `pads[0]` follows the header, `pads[i+1]`
    /// follows frame i.
    pub fn padding(&self) -> Vec<u64> {
        let mut pads = Vec::with_capacity(self.frames.len() + 1);
        let mut cursor = self.header_len;
        for &(off, len) in &self.frames {
            pads.push(off - cursor);
            cursor = off + len;
        }
        pads.push(0);
        pads
    }
}

/// Why a file cannot be read as a spill file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    TooShort { size: u64 },
    BadMagic,
    TooManyFrames { count: u64 },
    SizeMismatch { expected: u64, actual: u64 },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::TooShort { size } => {
                write!(f, "file is truncated: {size} bytes is shorter than a header")
            }
            FormatError::BadMagic => write!(f, "not a dask-shm spill file (bad magic)"),
            FormatError::TooManyFrames { count } => {
                write!(f, "corrupted header: announces {count} frames")
            }
            FormatError::SizeMismatch { expected, actual } => write!(
                f,
                "file is truncated or corrupted: header describes {expected} bytes, file has {actual}"
            ),
        }
    }
}

impl std::error::Error for FormatError {}

fn read_u64(buf: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Number of header bytes needed to parse a header announcing `count` frames.
pub fn header_len_for(count: u64) -> u64 {
    PREFIX + WORD * count
}

/// Read the frame count from the first 8 bytes of `prefix` (callers may pass
/// more), validating the magic.
pub fn parse_count(prefix: &[u8], file_size: u64) -> Result<u64, FormatError> {
    if prefix.len() < PREFIX as usize || file_size < PREFIX {
        return Err(FormatError::TooShort { size: file_size });
    }
    if &prefix[..4] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let mut word = [0u8; 4];
    word.copy_from_slice(&prefix[4..8]);
    let count = u64::from(u32::from_le_bytes(word));
    if count > MAX_FRAMES || header_len_for(count) > file_size {
        return Err(FormatError::TooManyFrames { count });
    }
    Ok(count)
}

/// Parse a complete header and check it against the actual file size.
pub fn parse_layout(header: &[u8], file_size: u64) -> Result<Layout, FormatError> {
    let count = parse_count(header, file_size)?;
    let need = header_len_for(count) as usize;
    if header.len() < need {
        return Err(FormatError::TooShort { size: file_size });
    }
    let lengths: Vec<u64> = (0..count as usize)
        .map(|i| read_u64(header, PREFIX as usize + 8 * i))
        .collect();
    // Laid out with checked sums first: lengths summing past u64 (a forged
    // header on a sparse file) must not wrap around to the file's size.
    let mut end = header_len_for(count);
    for &len in &lengths {
        let offset = if len >= ALIGN_MIN_LEN {
            end.checked_next_multiple_of(ALIGN)
        } else {
            Some(end)
        };
        match offset.and_then(|o| o.checked_add(len)) {
            Some(next) if next <= file_size => end = next,
            _ => {
                return Err(FormatError::SizeMismatch {
                    expected: lengths.iter().fold(0u64, |a, &l| a.saturating_add(l)),
                    actual: file_size,
                })
            }
        }
    }
    let layout = Layout::for_lengths(&lengths);
    if layout.file_size != file_size {
        return Err(FormatError::SizeMismatch {
            expected: layout.file_size,
            actual: file_size,
        });
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_summing_past_u64_are_refused() {
        // Two frames whose aligned ends wrap around to the claimed file size.
        let file_size: u64 = 1 << 45;
        let big = u64::MAX - (1 << 44);
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&2u32.to_le_bytes());
        header.extend_from_slice(&big.to_le_bytes());
        header.extend_from_slice(&big.to_le_bytes());
        assert!(matches!(
            parse_layout(&header, file_size),
            Err(FormatError::SizeMismatch { .. })
        ));
    }

    #[test]
    fn small_frames_are_packed_like_stock() {
        // Same bytes as stock's prelude (u64 count + u64 per frame) + frames.
        let lengths = [3, 100, 0, 64, ALIGN_MIN_LEN - 1];
        let layout = Layout::for_lengths(&lengths);
        let stock = 8 + 8 * lengths.len() as u64 + lengths.iter().sum::<u64>();
        assert_eq!(layout.file_size, stock);
        assert_eq!(layout.frames[0], (48, 3));
        assert_eq!(layout.frames[1], (51, 100));
        assert_eq!(layout.frames[2], (151, 0));
        assert_eq!(layout.frames[3], (151, 64));
        assert!(layout.padding().iter().all(|&p| p == 0));
        assert_eq!(layout.header_bytes().len() as u64, layout.header_len);
    }

    #[test]
    fn large_frames_are_aligned_and_size_is_exact() {
        let layout = Layout::for_lengths(&[3, ALIGN_MIN_LEN, 5, ALIGN_MIN_LEN + 1]);
        assert_eq!(layout.header_len, 40);
        assert_eq!(layout.frames[0], (40, 3));
        assert_eq!(layout.frames[1], (64, ALIGN_MIN_LEN));
        assert_eq!(layout.frames[2], (64 + ALIGN_MIN_LEN, 5));
        let (off3, _) = layout.frames[3];
        assert_eq!(off3, 64 + ALIGN_MIN_LEN + 64);
        assert_eq!(layout.file_size, off3 + ALIGN_MIN_LEN + 1);
        assert_eq!(layout.padding(), vec![0, 64 - 43, 0, 64 - 5, 0]);
    }

    #[test]
    fn header_round_trips() {
        let layout = Layout::for_lengths(&[10, 20]);
        let mut bytes = layout.header_bytes();
        bytes.resize(layout.file_size as usize, 0);
        assert_eq!(parse_layout(&bytes, layout.file_size).unwrap(), layout);
    }

    #[test]
    fn truncation_and_garbage_are_rejected() {
        let layout = Layout::for_lengths(&[10, 20]);
        let header = layout.header_bytes();
        assert!(matches!(
            parse_layout(&header, layout.file_size - 1),
            Err(FormatError::SizeMismatch { .. })
        ));
        assert!(matches!(
            parse_layout(&header, layout.file_size + 1),
            Err(FormatError::SizeMismatch { .. })
        ));
        assert_eq!(
            parse_layout(&header[..6], 6),
            Err(FormatError::TooShort { size: 6 })
        );
        assert_eq!(
            parse_layout(&header[..10], 10),
            Err(FormatError::TooManyFrames { count: 2 })
        );
        // extended or truncated around an aligned frame, too
        let big = Layout::for_lengths(&[7, ALIGN_MIN_LEN * 2]);
        let big_header = big.header_bytes();
        for size in [big.file_size - 1, big.file_size + 1, big.file_size - 64] {
            assert!(parse_layout(&big_header, size).is_err(), "{size}");
        }
        let mut bad = header.clone();
        bad[0] = b'X';
        assert_eq!(
            parse_layout(&bad, layout.file_size),
            Err(FormatError::BadMagic)
        );
        let mut huge = header;
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse_layout(&huge, layout.file_size),
            Err(FormatError::TooManyFrames { .. })
        ));
    }
}
