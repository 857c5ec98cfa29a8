//! Division by the page size as the paged CUDA kernels do it: a multiply-high, an add and a shift
//! instead of an integer division per K/V row (kernels/paged_kv.cuh).

/// The magic number and shift that divide positions by one page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PageDivisor {
    pub magic: u32,
    pub shift: u32,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl PageDivisor {
    /// The divisor for pages of `page_size` positions (at least 1). With `shift` the smallest s
    /// with 2^s ≥ page_size, `magic` = ⌊2^32 · (2^s − page_size) / page_size⌋ + 1.
    pub fn new(page_size: u32) -> Self {
        let page_size = page_size.max(1);
        let shift = page_size.next_power_of_two().trailing_zeros();
        let size = u64::from(page_size);
        let magic = ((1u64 << 32) * ((1u64 << shift) - size)) / size + 1;
        Self {
            // Below 2^32: (2^s − size) < size, as 2^(s−1) < size.
            magic: magic as u32,
            shift,
        }
    }

    /// `pos / page_size` the way the kernels compute it; exact for every `pos` below 2^31.
    #[cfg(test)]
    pub fn quotient(self, pos: u32) -> u32 {
        let high = ((u64::from(pos) * u64::from(self.magic)) >> 32) as u32;
        (high + pos) >> self.shift
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divides_exactly_for_every_page_size_up_to_256() {
        let big = (i32::MAX as u32 - 70_000)..=i32::MAX as u32;
        for page_size in 1..=256u32 {
            let divisor = PageDivisor::new(page_size);
            for pos in (0..70_000u32).chain(big.clone()) {
                assert_eq!(
                    divisor.quotient(pos),
                    pos / page_size,
                    "{pos} / {page_size}"
                );
            }
        }
    }

    #[test]
    fn divides_exactly_for_odd_large_page_sizes() {
        for page_size in [257u32, 1000, 4097, 65_537, 1 << 20, (1 << 30) + 3] {
            let divisor = PageDivisor::new(page_size);
            for pos in (0..20_000u32).chain([page_size - 1, page_size, i32::MAX as u32]) {
                assert_eq!(
                    divisor.quotient(pos),
                    pos / page_size,
                    "{pos} / {page_size}"
                );
            }
        }
    }
}
