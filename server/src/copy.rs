//! `memcpy` for the static build. musl's x86-64 `memcpy` (`rep movsq` and byte loops) took 22 % of
//! the static service's CPU under load, against 4 % for glibc's in the same code built for the GNU
//! target (BENCHMARKS.md, "The static service's libc"): most copies here are small (a Redis
//! command's arguments, a protobuf field, an HTTP/2 frame header). This one copies up to 64 bytes
//! with a few unaligned loads and stores, longer runs with `rep movsb` (fast strings on every x86-64
//! of the last decade). The binary exports it as `memcpy` only when linked against musl
//! (`main.rs`), where it takes the place of libc's; elsewhere it is only tested.

use core::ptr::{read_unaligned, write_unaligned};

/// Copies `n` bytes from `src` to `dst` (which must not overlap), as C's `memcpy`.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes, the two ranges disjoint.
#[inline(always)]
pub unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    // Every branch reads all its words before writing: the first and last words may overlap each
    // other (within one buffer), never the other buffer.
    unsafe {
        if n <= 16 {
            if n >= 8 {
                let (a, b) = (
                    read_unaligned(src.cast::<u64>()),
                    read_unaligned(src.add(n - 8).cast::<u64>()),
                );
                write_unaligned(dst.cast::<u64>(), a);
                write_unaligned(dst.add(n - 8).cast::<u64>(), b);
            } else if n >= 4 {
                let (a, b) = (
                    read_unaligned(src.cast::<u32>()),
                    read_unaligned(src.add(n - 4).cast::<u32>()),
                );
                write_unaligned(dst.cast::<u32>(), a);
                write_unaligned(dst.add(n - 4).cast::<u32>(), b);
            } else if n > 0 {
                let (a, b, c) = (*src, *src.add(n / 2), *src.add(n - 1));
                *dst = a;
                *dst.add(n / 2) = b;
                *dst.add(n - 1) = c;
            }
        } else if n <= 32 {
            let (a, b) = (
                read_unaligned(src.cast::<u128>()),
                read_unaligned(src.add(n - 16).cast::<u128>()),
            );
            write_unaligned(dst.cast::<u128>(), a);
            write_unaligned(dst.add(n - 16).cast::<u128>(), b);
        } else if n <= 64 {
            let (a, b, c, d) = (
                read_unaligned(src.cast::<u128>()),
                read_unaligned(src.add(16).cast::<u128>()),
                read_unaligned(src.add(n - 32).cast::<u128>()),
                read_unaligned(src.add(n - 16).cast::<u128>()),
            );
            write_unaligned(dst.cast::<u128>(), a);
            write_unaligned(dst.add(16).cast::<u128>(), b);
            write_unaligned(dst.add(n - 32).cast::<u128>(), c);
            write_unaligned(dst.add(n - 16).cast::<u128>(), d);
        } else {
            core::arch::asm!(
                "rep movsb",
                inout("rcx") n => _,
                inout("rdi") dst => _,
                inout("rsi") src => _,
                options(nostack, preserves_flags)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::copy;

    /// Every length from 0 to 300 at every offset of 0 to 7 in both buffers, against
    /// `copy_from_slice`; the bytes around the destination untouched.
    #[test]
    fn copies_exactly_the_bytes_asked() {
        let src: Vec<u8> = (0..320u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in 0..=300usize {
            for so in 0..8usize {
                for d_off in 0..8usize {
                    let mut dst = vec![0xAAu8; 320];
                    let mut want = dst.clone();
                    want[d_off..d_off + n].copy_from_slice(&src[so..so + n]);
                    // SAFETY: both ranges in bounds (offsets + n <= 308 < 320), separate buffers.
                    unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), n) };
                    assert_eq!(
                        dst, want,
                        "n {n}, source offset {so}, destination offset {d_off}"
                    );
                }
            }
        }
    }
}
