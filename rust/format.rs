//! On-disk layout of one spill file.
//!
//! ```text
//! offset 0   magic  b"DSKSHM01"                       8 bytes
//!        8   frame count n (u64 little endian)        8 bytes
//!       16   n frame lengths (u64 little endian)      8 * n bytes
//!            zero padding up to the next ALIGN boundary
//!            frame 0, zero padding up to ALIGN, frame 1, ..., frame n-1
//! ```
//!
//! Every frame starts on an `ALIGN`-byte boundary of the file, so a frame read
//! through a page-aligned `mmap` is aligned for any numpy dtype. The file ends
//! exactly where the last frame ends: any other size means the file was
//! truncated or extended and is rejected.

use std::fmt;

/// Alignment of every frame inside a spill file, in bytes.
pub const ALIGN: u64 = 64;
pub const MAGIC: &[u8; 8] = b"DSKSHM01";
const WORD: u64 = 8;

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
        let header_len = 2 * WORD + WORD * lengths.len() as u64;
        let mut offset = align_up(header_len);
        let mut frames = Vec::with_capacity(lengths.len());
        let mut end = header_len;
        for &len in lengths {
            frames.push((offset, len));
            end = offset + len;
            offset = align_up(end);
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
        out.extend_from_slice(&(self.frames.len() as u64).to_le_bytes());
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
    2 * WORD + WORD * count
}

/// Read the frame count from the first 16 bytes, validating the magic.
pub fn parse_count(prefix: &[u8], file_size: u64) -> Result<u64, FormatError> {
    if prefix.len() < 16 || file_size < 16 {
        return Err(FormatError::TooShort { size: file_size });
    }
    if &prefix[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let count = read_u64(prefix, 8);
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
        .map(|i| read_u64(header, 16 + 8 * i))
        .collect();
    if lengths.iter().any(|&l| l > file_size) {
        return Err(FormatError::SizeMismatch {
            expected: lengths.iter().fold(0u64, |a, &l| a.saturating_add(l)),
            actual: file_size,
        });
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
    fn frames_are_aligned_and_size_is_exact() {
        let layout = Layout::for_lengths(&[3, 100, 0, 64]);
        for &(off, _) in &layout.frames {
            assert_eq!(off % ALIGN, 0);
        }
        assert_eq!(layout.frames[0], (64, 3));
        assert_eq!(layout.frames[1], (128, 100));
        assert_eq!(layout.frames[2], (256, 0));
        assert_eq!(layout.frames[3], (256, 64));
        assert_eq!(layout.file_size, 320);
        let pads = layout.padding();
        assert_eq!(pads, vec![64 - 48, 128 - 67, 256 - 228, 0, 0]);
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
        assert_eq!(
            parse_layout(&header[..10], 10),
            Err(FormatError::TooShort { size: 10 })
        );
        let mut bad = header.clone();
        bad[0] = b'X';
        assert_eq!(
            parse_layout(&bad, layout.file_size),
            Err(FormatError::BadMagic)
        );
        let mut huge = header;
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_layout(&huge, layout.file_size),
            Err(FormatError::TooManyFrames { .. })
        ));
    }
}
