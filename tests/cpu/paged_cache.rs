//! `PagedKvCache` on the CPU: sequences of different lengths stepped together, forks sharing a
//! prefix (copy on write), rollback by truncation, freeing, and a full pool, each checked by
//! reading the cache with the paged op against the contiguous op over the same history.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{
    flash_decode_paged, flash_decode_varlen, PagedKvCache, PagedKvCacheConfig, SequenceId,
};

const HEADS: (usize, usize, usize) = (8, 2, 64);

fn config(num_pages: usize, page_size: usize) -> PagedKvCacheConfig {
    PagedKvCacheConfig {
        layers: 2,
        num_pages,
        page_size,
        kv_heads: HEADS.1,
        head_dim: HEADS.2,
        dtype: DType::F32,
        device: Device::Cpu,
    }
}

/// What each sequence should hold, per layer: `(len, kv_heads, head_dim)` keys and values.
#[derive(Clone)]
struct History {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl History {
    fn empty(layers: usize) -> Result<Self> {
        let none = Tensor::zeros((0, HEADS.1, HEADS.2), DType::F32, &Device::Cpu)?;
        Ok(Self {
            k: vec![none.clone(); layers],
            v: vec![none; layers],
        })
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            *x = x.narrow(0, 0, len)?;
        }
        Ok(())
    }
}

/// One step of `t` random positions for `ids`, written to every layer and to the histories.
fn step(
    cache: &mut PagedKvCache,
    histories: &mut [&mut History],
    ids: &[SequenceId],
    t: usize,
) -> Result<()> {
    let step = cache.begin_step(ids, t)?;
    let layers = cache.config().layers;
    for layer in 0..layers {
        let k = Tensor::randn(0f32, 1.0, (ids.len(), t, HEADS.1, HEADS.2), &Device::Cpu)?;
        let v = Tensor::randn(0f32, 1.0, (ids.len(), t, HEADS.1, HEADS.2), &Device::Cpu)?;
        cache.write(layer, &step, &k, &v)?;
        for (b, history) in histories.iter_mut().enumerate() {
            history.k[layer] = Tensor::cat(&[&history.k[layer], &k.get(b)?], 0)?;
            history.v[layer] = Tensor::cat(&[&history.v[layer], &v.get(b)?], 0)?;
        }
    }
    Ok(())
}

/// Reads `ids` from every layer with the paged op and compares with the contiguous op over
/// their histories.
fn check(cache: &PagedKvCache, ids: &[SequenceId], histories: &[&History]) -> Result<()> {
    let lens: Vec<usize> = ids.iter().map(|&id| cache.len(id)).collect::<Result<_>>()?;
    for (len, history) in lens.iter().zip(histories) {
        assert_eq!(*len, history.k[0].dim(0)?, "cache length against history");
    }
    let longest = lens.iter().copied().max().unwrap_or(0);
    let (block_table, seqlens) = cache.block_table(ids)?;
    let q = Tensor::randn(0f32, 1.0, (ids.len(), 1, HEADS.0, HEADS.2), &Device::Cpu)?;
    for layer in 0..cache.config().layers {
        let (k_pages, v_pages) = cache.layer(layer)?;
        let got = flash_decode_paged(&q, &k_pages, &v_pages, &block_table, &seqlens, 0.125)?;
        let pad = |x: &Tensor| -> Result<Tensor> {
            let rest = Tensor::zeros(
                (longest - x.dim(0)?, HEADS.1, HEADS.2),
                DType::F32,
                &Device::Cpu,
            )?;
            Tensor::cat(&[x, &rest], 0)
        };
        let k = Tensor::stack(
            &histories
                .iter()
                .map(|h| pad(&h.k[layer]))
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let v = Tensor::stack(
            &histories
                .iter()
                .map(|h| pad(&h.v[layer]))
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let want = flash_decode_varlen(&q, &k, &v, &seqlens, 0.125)?;
        let diff = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "layer {layer}: paged cache differs by {diff}");
    }
    Ok(())
}

#[test]
fn sequences_of_different_lengths_step_together() -> Result<()> {
    let mut cache = PagedKvCache::new(&config(64, 16))?;
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    let (mut ha, mut hb) = (History::empty(2)?, History::empty(2)?);
    step(&mut cache, &mut [&mut ha], &[a], 37)?;
    step(&mut cache, &mut [&mut hb], &[b], 5)?;
    for t in [1, 1, 3, 16, 1] {
        step(&mut cache, &mut [&mut ha, &mut hb], &[a, b], t)?;
    }
    check(&cache, &[a, b], &[&ha, &hb])?;
    // One page per 16 positions, nothing more.
    assert_eq!(
        cache.free_pages(),
        64 - 59usize.div_ceil(16) - 27usize.div_ceil(16)
    );
    Ok(())
}

#[test]
fn a_fork_shares_its_prefix_and_copies_on_write() -> Result<()> {
    let mut cache = PagedKvCache::new(&config(16, 8))?;
    let parent = cache.add_sequence();
    let mut hp = History::empty(2)?;
    step(&mut cache, &mut [&mut hp], &[parent], 21)?;
    let free = cache.free_pages();
    let child = cache.fork(parent)?;
    assert_eq!(cache.free_pages(), free, "a fork takes no pages");
    let mut hc = hp.clone();
    // Both write into the shared, partly filled third page: each gets its own copy.
    step(&mut cache, &mut [&mut hc], &[child], 2)?;
    step(&mut cache, &mut [&mut hp], &[parent], 4)?;
    check(&cache, &[parent, child], &[&hp, &hc])?;
    cache.free_sequence(parent)?;
    check(&cache, &[child], &[&hc])?;
    cache.free_sequence(child)?;
    assert_eq!(cache.free_pages(), 16);
    Ok(())
}

#[test]
fn truncation_rolls_back_and_frees_pages() -> Result<()> {
    let mut cache = PagedKvCache::new(&config(8, 4))?;
    let a = cache.add_sequence();
    let mut ha = History::empty(2)?;
    step(&mut cache, &mut [&mut ha], &[a], 14)?;
    cache.truncate(a, 6)?;
    ha.truncate(6)?;
    assert_eq!(cache.free_pages(), 8 - 2);
    step(&mut cache, &mut [&mut ha], &[a], 3)?;
    check(&cache, &[a], &[&ha])?;
    let e = cache.truncate(a, 10).unwrap_err().to_string();
    assert!(
        e.contains("cannot truncate a sequence of 9 positions to 10"),
        "{e}"
    );
    Ok(())
}

#[test]
fn a_full_pool_is_an_error_that_changes_nothing() -> Result<()> {
    let mut cache = PagedKvCache::new(&config(4, 4))?;
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    let (mut ha, mut hb) = (History::empty(2)?, History::empty(2)?);
    step(&mut cache, &mut [&mut ha, &mut hb], &[a, b], 6)?;
    let e = cache.begin_step(&[a, b], 3).unwrap_err().to_string();
    assert!(e.contains("needs 2 free pages, the pool has 0 of 4"), "{e}");
    assert_eq!((cache.len(a)?, cache.len(b)?), (6, 6));
    cache.free_sequence(b)?;
    step(&mut cache, &mut [&mut ha], &[a], 3)?;
    check(&cache, &[a], &[&ha])
}

#[test]
fn bad_calls_are_clear_errors() -> Result<()> {
    let mut cache = PagedKvCache::new(&config(4, 4))?;
    let a = cache.add_sequence();
    let e = cache.begin_step(&[a, a], 1).unwrap_err().to_string();
    assert!(e.contains("in the step twice"), "{e}");
    let e = cache.begin_step(&[a], 0).unwrap_err().to_string();
    assert!(e.contains("at least one sequence and one position"), "{e}");
    cache.free_sequence(a)?;
    let e = cache.len(a).unwrap_err().to_string();
    assert!(e.contains("not a live sequence"), "{e}");
    let b = cache.add_sequence();
    let step = cache.begin_step(&[b], 2)?;
    let wrong = Tensor::zeros((1, 3, HEADS.1, HEADS.2), DType::F32, &Device::Cpu)?;
    let e = cache
        .write(0, &step, &wrong, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("new k must be"), "{e}");
    let right = Tensor::zeros((1, 2, HEADS.1, HEADS.2), DType::F32, &Device::Cpu)?;
    let e = cache
        .write(2, &step, &right, &right)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 2 does not exist"), "{e}");
    let e = PagedKvCache::new(&PagedKvCacheConfig {
        dtype: DType::F8E4M3,
        ..config(4, 4)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("fp8 pages are not implemented yet"), "{e}");
    Ok(())
}
