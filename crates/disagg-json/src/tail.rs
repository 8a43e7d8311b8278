//! The last bytes of a stream watched frame by frame ([`Tail`]): what a watch needs to
//! find a needle cut between two frames, and to look back from one it found.

/// The last `N` bytes seen of a stream, the oldest first, and how many bytes it had.
///
/// A watch indexes "the tail followed by the frame" as one run of bytes
/// ([`byte`](Self::byte)): index `i` is the tail's below [`len`](Self::len), the
/// frame's from there.
pub(crate) struct Tail<const N: usize> {
    bytes: [u8; N],
    len: usize,
    /// Bytes seen before the current frame.
    seen: u64,
}

impl<const N: usize> Tail<N> {
    /// The tail of a stream not begun.
    pub(crate) const fn new() -> Self {
        Tail {
            bytes: [0; N],
            len: 0,
            seen: 0,
        }
    }

    /// Bytes kept.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes seen before the current frame.
    pub(crate) fn seen(&self) -> u64 {
        self.seen
    }

    /// The bytes kept, the oldest first.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The byte at `i`, an index into the tail followed by `data`.
    pub(crate) fn byte(&self, i: usize, data: &[u8]) -> u8 {
        if i < self.len {
            self.bytes[i]
        } else {
            data[i - self.len]
        }
    }

    /// For each way `key` may be cut between the tail and `data` (its first `k` bytes
    /// ending the tail, the rest starting `data`), `k`: the key then starts at
    /// `len() - k` in the tail followed by `data`. A key wholly in the tail was seen
    /// with the frame before.
    pub(crate) fn cut<'a>(
        &'a self,
        key: &'a [u8],
        data: &'a [u8],
    ) -> impl Iterator<Item = usize> + 'a {
        (1..key.len())
            .filter(move |&k| self.as_slice().ends_with(&key[..k]) && data.starts_with(&key[k..]))
    }

    /// Keep the last bytes of the tail followed by `data`, `data` now seen.
    pub(crate) fn keep(&mut self, data: &[u8]) {
        self.seen += data.len() as u64;
        if data.len() >= N {
            self.bytes.copy_from_slice(&data[data.len() - N..]);
            self.len = N;
            return;
        }
        let keep = (N - data.len()).min(self.len);
        self.bytes.copy_within(self.len - keep..self.len, 0);
        self.bytes[keep..keep + data.len()].copy_from_slice(data);
        self.len = keep + data.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_bytes_are_kept_across_frames_of_any_size() {
        let stream: Vec<u8> = (0..=255).collect();
        for size in [1, 3, 8, 20] {
            let mut tail = Tail::<8>::new();
            for frame in stream.chunks(size) {
                tail.keep(frame);
            }
            assert_eq!(
                tail.as_slice(),
                &stream[stream.len() - 8..],
                "frames of {size}"
            );
            assert_eq!(tail.seen(), 256);
        }
        let mut tail = Tail::<8>::new();
        tail.keep(b"abc");
        assert_eq!((tail.as_slice(), tail.len()), (&b"abc"[..], 3));
        assert_eq!(tail.byte(1, b"xyz"), b'b');
        assert_eq!(tail.byte(4, b"xyz"), b'y');
    }

    #[test]
    fn a_key_cut_between_the_tail_and_a_frame_is_found_at_each_cut() {
        let key = b"\"error\"";
        for k in 1..key.len() {
            let mut tail = Tail::<16>::new();
            tail.keep(b"data: {");
            tail.keep(&key[..k]);
            let cuts: Vec<usize> = tail.cut(key, &key[k..]).collect();
            assert_eq!(cuts, [k]);
        }
        let mut tail = Tail::<16>::new();
        tail.keep(b"\"err");
        assert_eq!(tail.cut(b"\"error\"", b"x\"").count(), 0);
    }
}
