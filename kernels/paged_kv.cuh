// Paged K/V: a pool of pages of `page_size` positions, shared by the sequences, and a block
// table whose row b lists sequence b's pages in order. Position `pos` of sequence b is row
// `pos % page_size` of page `block_table[b][pos / page_size]`; the pool's page stride is the
// K/V "batch" stride.
#pragma once

#include "common.cuh"

// pos / page_size, as a multiply by the magic number the host derived from the page size: the
// quotient is (umulhi(pos, magic) + pos) >> shift for every pos below 2^31.
__device__ __forceinline__ int page_index(const DecodeParams& p, int pos) {
    const unsigned n = static_cast<unsigned>(pos);
    return static_cast<int>((__umulhi(n, p.page_magic) + n) >> p.page_shift);
}

// Where a position's row lies in a pool, as page and row within it.
struct PagedRow {
    long long page;
    int row;
};

// The page and row of position `pos` of the sequence whose table row is `pages`.
__device__ __forceinline__ PagedRow paged_row(const DecodeParams& p, const uint32_t* pages, int pos) {
    const int index = page_index(p, pos);
    return {static_cast<long long>(__ldg(pages + index)), pos - index * p.page_size};
}
