//! `PagedKvCache`: the keys and values of many sequences in one pool of fixed-size pages per layer,
//! shared by all of them, for batched decoding (`crate::flash_decode_paged`).
//!
//! Sequences are added and freed as requests come and go; they grow a page at a time, so none
//! reserves its longest possible length. A fork shares its parent's pages, and a shared page is
//! copied only when one of its holders writes into it (copy on write), so sequences with a common
//! prefix store it once. When the pool runs out, growing fails with an error: nothing is evicted.
//!
//! Each layer's pool is head-major, `(num_pages, kv_heads, page_size, head_dim)`, as the
//! contiguous [`crate::KvCache`] is: it streams faster than the sequence-major layout. The op
//! takes it as the `(num_pages, page_size, kv_heads, head_dim)` view [`PagedKvCache::layer`]
//! returns.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::page_allocator::PageAllocator;

mod mixed_step;

pub use mixed_step::{MixedStep, StepGroup};

/// Sizes and placement of a [`PagedKvCache`].
#[derive(Debug, Clone)]
pub struct PagedKvCacheConfig {
    /// Attention layers, each with its own pool of `num_pages` pages.
    pub layers: usize,
    pub num_pages: usize,
    /// Positions per page.
    pub page_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// f32, f16 or bf16.
    pub dtype: DType,
    pub device: Device,
}

/// A sequence of a [`PagedKvCache`], valid until it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SequenceId(usize);

#[derive(Debug, Clone)]
struct Sequence {
    pages: Vec<u32>,
    len: usize,
}

/// One step of some sequences: what the op needs to read them after it, and where each new row
/// is written. Made by [`PagedKvCache::begin_step`].
#[derive(Debug, Clone)]
pub struct PagedStep {
    /// u32 `(batch, max_pages)`: each sequence's pages, padded with page 0 (see
    /// [`PagedKvCache::block_table`]).
    pub block_table: Tensor,
    /// u32 `(batch,)`: each sequence's length, the step's positions included.
    pub seqlens: Tensor,
    /// u32 `(batch · t · kv_heads,)`: the row of a layer's pool, flattened to
    /// `(num_pages · kv_heads · page_size, head_dim)`, of each new (sequence, token, head).
    rows: Tensor,
    ids: Vec<SequenceId>,
    t: usize,
}

impl PagedStep {
    /// The step's sequences, in the order of its batch.
    pub fn ids(&self) -> &[SequenceId] {
        &self.ids
    }

    /// Sequences in the step.
    pub fn batch(&self) -> usize {
        self.ids.len()
    }

    /// New positions per sequence.
    pub fn t(&self) -> usize {
        self.t
    }
}

/// Keys and values of every layer for many sequences, in pools of pages (see the module docs).
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    config: PagedKvCacheConfig,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    pages: PageAllocator,
    sequences: Vec<Option<Sequence>>,
}

impl PagedKvCache {
    /// Allocates every layer's pool, filled with zeros.
    pub fn new(config: &PagedKvCacheConfig) -> Result<Self> {
        let c = config;
        if c.layers == 0 || c.num_pages == 0 || c.page_size == 0 || c.kv_heads == 0 {
            bail!(
                "paged kv cache: layers ({}), num_pages ({}), page_size ({}) and kv_heads ({}) \
                 must all be at least 1",
                c.layers,
                c.num_pages,
                c.page_size,
                c.kv_heads
            )
        }
        if !crate::SUPPORTED_HEAD_DIMS.contains(&c.head_dim) {
            bail!(
                "paged kv cache: head_dim {} is not one the op takes: {:?}",
                c.head_dim,
                crate::SUPPORTED_HEAD_DIMS
            )
        }
        if !matches!(c.dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!(
                "paged kv cache: dtype {:?} is not supported; use f32, f16 or bf16 (fp8 pages \
                 are not implemented yet)",
                c.dtype
            )
        }
        let shape = (c.num_pages, c.kv_heads, c.page_size, c.head_dim);
        let mut k = Vec::with_capacity(c.layers);
        let mut v = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            k.push(Tensor::zeros(shape, c.dtype, &c.device)?);
            v.push(Tensor::zeros(shape, c.dtype, &c.device)?);
        }
        Ok(Self {
            config: config.clone(),
            k,
            v,
            pages: PageAllocator::new(c.num_pages),
            sequences: Vec::new(),
        })
    }

    pub fn config(&self) -> &PagedKvCacheConfig {
        &self.config
    }

    /// Pages no sequence holds.
    pub fn free_pages(&self) -> usize {
        self.pages.free_pages()
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SequenceId {
        let fresh = Sequence {
            pages: Vec::new(),
            len: 0,
        };
        match self.sequences.iter().position(Option::is_none) {
            Some(slot) => {
                self.sequences[slot] = Some(fresh);
                SequenceId(slot)
            }
            None => {
                self.sequences.push(Some(fresh));
                SequenceId(self.sequences.len() - 1)
            }
        }
    }

    /// Frees `id`'s pages (those it shares stay with their other holders); `id` is then invalid.
    pub fn free_sequence(&mut self, id: SequenceId) -> Result<()> {
        let sequence = self.take(id)?;
        for page in sequence.pages {
            self.pages.release(page);
        }
        Ok(())
    }

    /// A new sequence with `id`'s contents, sharing its pages until either writes into one.
    pub fn fork(&mut self, id: SequenceId) -> Result<SequenceId> {
        let parent = self.sequence(id)?.clone();
        for &page in &parent.pages {
            self.pages.retain(page);
        }
        let child = self.add_sequence();
        self.sequences[child.0] = Some(parent);
        Ok(child)
    }

    /// The positions `id` holds.
    pub fn len(&self, id: SequenceId) -> Result<usize> {
        Ok(self.sequence(id)?.len)
    }

    /// Shortens `id` to `len` positions (to roll back rejected draft tokens), freeing the pages
    /// past them.
    pub fn truncate(&mut self, id: SequenceId, len: usize) -> Result<()> {
        let page_size = self.config.page_size;
        let sequence = self.sequence(id)?;
        if len > sequence.len {
            bail!(
                "paged kv cache: cannot truncate a sequence of {} positions to {len}",
                sequence.len
            )
        }
        let keep = len.div_ceil(page_size);
        let dropped: Vec<u32> = sequence.pages[keep..].to_vec();
        let sequence = self.sequence_mut(id)?;
        sequence.pages.truncate(keep);
        sequence.len = len;
        for page in dropped {
            self.pages.release(page);
        }
        Ok(())
    }

    /// Makes room for `t` new positions at the end of each of `ids` (in this order, each once),
    /// copying a shared last page first, and counts them in the sequences' lengths. Then
    /// [`PagedKvCache::write`] stores each layer's new keys and values, and the op reads the
    /// sequences through the step's block table and lengths.
    ///
    /// Fails, changing nothing, when the pool has too few free pages.
    pub fn begin_step(&mut self, ids: &[SequenceId], t: usize) -> Result<PagedStep> {
        if ids.is_empty() || t == 0 {
            bail!(
                "paged kv cache: a step needs at least one sequence and one position, got {} \
                 sequences and {t} positions",
                ids.len()
            )
        }
        let counts: Vec<(SequenceId, usize)> = ids.iter().map(|&id| (id, t)).collect();
        self.reserve(&counts)?;
        self.step_tensors(ids, t)
    }

    /// Like [`PagedKvCache::begin_step`] for sequences that each bring their own number of new
    /// positions, `counts[s] = (id, new positions)`, each at least 1: prompt chunks of some
    /// sequences beside one-token decode rows of others. The step's tokens are laid end to end
    /// in the order of `counts`; see [`MixedStep`] for how attention reads them.
    ///
    /// Fails, changing nothing, on an empty step, a count of 0, a sequence that is not live or
    /// is named twice, or when the pool has too few free pages.
    pub fn begin_mixed_step(&mut self, counts: &[(SequenceId, usize)]) -> Result<MixedStep> {
        if counts.is_empty() {
            bail!("paged kv cache: a mixed step needs at least one sequence")
        }
        if let Some((id, _)) = counts.iter().find(|(_, count)| *count == 0) {
            bail!("paged kv cache: sequence {id:?} brings 0 positions to the step; at least 1")
        }
        self.reserve(counts)?;
        let starts = counts
            .iter()
            .map(|&(id, count)| Ok(self.len(id)? - count))
            .collect::<Result<Vec<_>>>()?;
        let mut groups: Vec<(usize, Vec<SequenceId>)> = Vec::new();
        for &(id, count) in counts {
            match groups.iter_mut().find(|(t, _)| *t == count) {
                Some((_, ids)) => ids.push(id),
                None => groups.push((count, vec![id])),
            }
        }
        let steps = groups
            .iter()
            .map(|(t, ids)| self.step_tensors(ids, *t))
            .collect::<Result<Vec<_>>>()?;
        MixedStep::new(counts, starts, steps, &self.config.device)
    }

    /// Checks that each sequence of `counts` is live and named once and that the pool has the
    /// pages for their new positions, then gives each its pages and counts them.
    fn reserve(&mut self, counts: &[(SequenceId, usize)]) -> Result<()> {
        let page_size = self.config.page_size;
        for (i, (id, _)) in counts.iter().enumerate() {
            self.sequence(*id)?;
            if counts[..i].iter().any(|(other, _)| other == id) {
                bail!("paged kv cache: sequence {id:?} is in the step twice")
            }
        }
        // Every page the step needs, before any is taken.
        let mut needed = 0;
        for &(id, t) in counts {
            let sequence = self.sequence(id)?;
            let partial = sequence.len % page_size != 0;
            let copy = partial
                && self
                    .pages
                    .is_shared(sequence.pages[sequence.len / page_size]);
            needed +=
                (sequence.len + t).div_ceil(page_size) - sequence.pages.len() + usize::from(copy);
        }
        if needed > self.pages.free_pages() {
            bail!(
                "paged kv cache: the step needs {needed} free pages, the pool has {} of {}; free \
                 or truncate sequences, or make the pool larger",
                self.pages.free_pages(),
                self.pages.num_pages()
            )
        }
        for &(id, t) in counts {
            self.grow(id, t)?;
        }
        Ok(())
    }

    /// Writes layer `layer`'s keys and values of `step`'s new positions, `(batch, t, kv_heads,
    /// head_dim)` in the cache's dtype.
    pub fn write(
        &self,
        layer: usize,
        step: &PagedStep,
        k_new: &Tensor,
        v_new: &Tensor,
    ) -> Result<()> {
        let c = &self.config;
        let (k_pool, v_pool) = (self.pool(&self.k, layer)?, self.pool(&self.v, layer)?);
        let want = [step.batch(), step.t, c.kv_heads, c.head_dim];
        for (name, x) in [("k", k_new), ("v", v_new)] {
            if x.dims() != want || x.dtype() != c.dtype {
                bail!(
                    "paged kv cache: new {name} must be {:?} {want:?}, got {:?} {:?}",
                    c.dtype,
                    x.dtype(),
                    x.dims()
                )
            }
        }
        let flat_rows = c.num_pages * c.kv_heads * c.page_size;
        let rows = step.batch() * step.t * c.kv_heads;
        #[cfg(feature = "cuda")]
        if c.device.is_cuda() {
            // One launch for K and V, a thread per element: candle's scatter walks the rows of
            // each column one after the other. Each (sequence, token, head) row is an entry of
            // its own whose one head goes to the pool row `step.rows` names.
            let (k, v) = (k_new.contiguous()?, v_new.contiguous()?);
            let source = |x: &Tensor| x.reshape((rows, 1, 1, c.head_dim));
            let destination = |pool: &Tensor| {
                pool.reshape((1, 1, flat_rows, c.head_dim))?
                    .broadcast_as((rows, 1, flat_rows, c.head_dim))
            };
            return crate::cuda::cache_write::write_rows(
                (&destination(k_pool)?, &destination(v_pool)?),
                (&source(&k)?, &source(&v)?),
                crate::cuda::cache_write::RowStarts::Device(&step.rows),
                (1.0, 1.0),
            );
        }
        let index = step
            .rows
            .unsqueeze(1)?
            .broadcast_as((rows, c.head_dim))?
            .contiguous()?;
        for (pool, x) in [(k_pool, k_new), (v_pool, v_new)] {
            let source = x.contiguous()?.reshape((rows, c.head_dim))?;
            pool.reshape((flat_rows, c.head_dim))?
                .scatter_set(&index, &source, 0)?;
        }
        Ok(())
    }

    /// Layer `layer`'s keys and values as the op takes them: `(num_pages, page_size, kv_heads,
    /// head_dim)` views of the pools.
    pub fn layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            self.pool(&self.k, layer)?.transpose(1, 2)?,
            self.pool(&self.v, layer)?.transpose(1, 2)?,
        ))
    }

    /// Layer `layer`'s keys and values of sequence `id`, gathered from its pages into
    /// `(1, len, kv_heads, head_dim)` views of head-major copies: what attention over a whole
    /// prompt, which the op does not take, reads.
    pub fn sequence_kv(&self, layer: usize, id: SequenceId) -> Result<(Tensor, Tensor)> {
        let c = &self.config;
        let sequence = self.sequence(id)?;
        let used = sequence.len.div_ceil(c.page_size);
        let pages = Tensor::from_slice(&sequence.pages[..used], used, &c.device)?;
        let gather = |pool: &Tensor| -> Result<Tensor> {
            pool.index_select(&pages, 0)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((c.kv_heads, used * c.page_size, c.head_dim))?
                .narrow(1, 0, sequence.len)?
                .unsqueeze(0)?
                .transpose(1, 2)
        };
        Ok((
            gather(self.pool(&self.k, layer)?)?,
            gather(self.pool(&self.v, layer)?)?,
        ))
    }

    fn pool<'a>(&self, pools: &'a [Tensor], layer: usize) -> Result<&'a Tensor> {
        match pools.get(layer) {
            Some(pool) => Ok(pool),
            None => bail!(
                "paged kv cache: layer {layer} does not exist; the cache has {}",
                pools.len()
            ),
        }
    }

    /// Gives `id` the pages for `t` more positions, copying its last page first where another
    /// sequence shares it, and counts them. The caller has checked that the pool has the pages.
    fn grow(&mut self, id: SequenceId, t: usize) -> Result<()> {
        let page_size = self.config.page_size;
        let sequence = self.sequence(id)?.clone();
        let mut pages = sequence.pages;
        if sequence.len % page_size != 0 {
            let last = sequence.len / page_size;
            if self.pages.is_shared(pages[last]) {
                let copy = self.pages.allocate()?;
                self.copy_page(pages[last], copy)?;
                self.pages.release(pages[last]);
                pages[last] = copy;
            }
        }
        while pages.len() < (sequence.len + t).div_ceil(page_size) {
            pages.push(self.pages.allocate()?);
        }
        let grown = self.sequence_mut(id)?;
        grown.pages = pages;
        grown.len = sequence.len + t;
        Ok(())
    }

    /// Copies page `from` over page `to` in every layer.
    fn copy_page(&self, from: u32, to: u32) -> Result<()> {
        for pool in self.k.iter().chain(&self.v) {
            let page = pool.narrow(0, from as usize, 1)?.copy()?;
            pool.slice_set(&page, 0, to as usize)?;
        }
        Ok(())
    }

    /// The block table, u32 `(batch, max_pages)` padded with page 0, and the lengths, u32
    /// `(batch,)`, of `ids` as they stand: what the op reads them through.
    pub fn block_table(&self, ids: &[SequenceId]) -> Result<(Tensor, Tensor)> {
        let device = &self.config.device;
        let mut sequences = Vec::with_capacity(ids.len());
        for id in ids {
            sequences.push(self.sequence(*id)?);
        }
        let max_pages = sequences
            .iter()
            .map(|s| s.pages.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut table = vec![0u32; ids.len() * max_pages];
        for (b, sequence) in sequences.iter().enumerate() {
            table[b * max_pages..][..sequence.pages.len()].copy_from_slice(&sequence.pages);
        }
        let lens: Vec<u32> = sequences.iter().map(|s| s.len as u32).collect();
        Ok((
            Tensor::from_vec(table, (ids.len(), max_pages), device)?,
            Tensor::from_vec(lens, ids.len(), device)?,
        ))
    }

    /// The block table, lengths and write rows of a step of `t` positions just counted in `ids`.
    fn step_tensors(&self, ids: &[SequenceId], t: usize) -> Result<PagedStep> {
        let c = &self.config;
        let mut rows = Vec::with_capacity(ids.len() * t * c.kv_heads);
        for id in ids {
            let sequence = self.sequence(*id)?;
            for pos in sequence.len - t..sequence.len {
                let page = sequence.pages[pos / c.page_size] as usize;
                for head in 0..c.kv_heads {
                    let row = (page * c.kv_heads + head) * c.page_size + pos % c.page_size;
                    rows.push(row as u32);
                }
            }
        }
        let (block_table, seqlens) = self.block_table(ids)?;
        let rows_len = ids.len() * t * c.kv_heads;
        Ok(PagedStep {
            block_table,
            seqlens,
            rows: Tensor::from_vec(rows, rows_len, &c.device)?,
            ids: ids.to_vec(),
            t,
        })
    }

    fn sequence(&self, id: SequenceId) -> Result<&Sequence> {
        match self.sequences.get(id.0) {
            Some(Some(sequence)) => Ok(sequence),
            _ => bail!("paged kv cache: {id:?} is not a live sequence of this cache"),
        }
    }

    fn sequence_mut(&mut self, id: SequenceId) -> Result<&mut Sequence> {
        match self.sequences.get_mut(id.0) {
            Some(Some(sequence)) => Ok(sequence),
            _ => bail!("paged kv cache: {id:?} is not a live sequence of this cache"),
        }
    }

    fn take(&mut self, id: SequenceId) -> Result<Sequence> {
        match self.sequences.get_mut(id.0).and_then(Option::take) {
            Some(sequence) => Ok(sequence),
            None => bail!("paged kv cache: {id:?} is not a live sequence of this cache"),
        }
    }
}
