//! The pages of a paged K/V pool: which are free, and how many sequences hold each of the others.
//! A page held by more than one sequence (a shared prefix after a fork) is copied before it is
//! written.

use candle_core::{bail, Result};

/// Hands out page indices of a pool of `num_pages` pages and counts their holders.
#[derive(Debug, Clone)]
pub(crate) struct PageAllocator {
    /// Holders of each page; 0 for a free page.
    holders: Vec<u32>,
    /// Free pages, the next one handed out last.
    free: Vec<u32>,
}

impl PageAllocator {
    pub fn new(num_pages: usize) -> Self {
        Self {
            holders: vec![0; num_pages],
            // Lowest indices first, so that a fresh pool fills from its start.
            free: (0..num_pages as u32).rev().collect(),
        }
    }

    pub fn num_pages(&self) -> usize {
        self.holders.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// A free page, now held once; an error when none is left (no page is ever evicted).
    pub fn allocate(&mut self) -> Result<u32> {
        let Some(page) = self.free.pop() else {
            bail!(
                "paged kv cache: all {} pages are in use; free or truncate sequences, or make \
                 the pool larger",
                self.holders.len()
            )
        };
        self.holders[page as usize] = 1;
        Ok(page)
    }

    /// One more holder of `page` (a fork sharing it).
    pub fn retain(&mut self, page: u32) {
        self.holders[page as usize] += 1;
    }

    /// One holder fewer of `page`; it is free again when none is left.
    pub fn release(&mut self, page: u32) {
        let holders = &mut self.holders[page as usize];
        debug_assert!(*holders > 0, "page {page} released more often than held");
        *holders = holders.saturating_sub(1);
        if *holders == 0 {
            self.free.push(page);
        }
    }

    /// Whether `page` has other holders, so that writing it would change their contents.
    pub fn is_shared(&self, page: u32) -> bool {
        self.holders[page as usize] > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_until_none_is_left() {
        let mut pages = PageAllocator::new(3);
        let got: Vec<u32> = (0..3).map(|_| pages.allocate().unwrap()).collect();
        assert_eq!(got, [0, 1, 2]);
        let e = pages.allocate().unwrap_err().to_string();
        assert!(e.contains("all 3 pages are in use"), "{e}");
        pages.release(1);
        assert_eq!(pages.free_pages(), 1);
        assert_eq!(pages.allocate().unwrap(), 1);
    }

    #[test]
    fn a_shared_page_is_free_once_every_holder_released_it() {
        let mut pages = PageAllocator::new(2);
        let page = pages.allocate().unwrap();
        pages.retain(page);
        assert!(pages.is_shared(page));
        pages.release(page);
        assert!(!pages.is_shared(page));
        assert_eq!(pages.free_pages(), 1);
        pages.release(page);
        assert_eq!(pages.free_pages(), 2);
    }
}
