//! `KvCache`: a preallocated, head-major key/value cache for one attention layer.
//!
//! Storage is `(batch, kv_heads, capacity, head_dim)` in the model's dtype, on the model's device.
//! New keys and values are written in place, so a decode step costs O(new tokens) copies, not
//! O(context). Views `(batch, len, kv_heads, head_dim)` (a narrow plus a transpose, no copy) go
//! straight into [`crate::flash_decode`]. The capacity doubles when it runs out, the only time the
//! cached data is copied, up to a fixed maximum; past it `append` fails instead of truncating.
//!
//! The cache may store fp8 (e4m3): half the bytes of bf16 per position. Keys and values are
//! then stored divided by per-tensor scales (real = stored × scale) and saturated at ±448, and
//! readers pass [`KvCache::k_scale`] and [`KvCache::v_scale`] to the op.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::stored_kv::StoredForm;
#[cfg(feature = "cuda")]
use crate::cuda::cache_write::RowStarts;

/// Sizes and placement of a [`KvCache`].
#[derive(Debug, Clone)]
pub struct KvCacheConfig {
    pub batch: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions allocated up front, per sequence.
    pub initial_capacity: usize,
    /// Positions the cache may grow to, per sequence (usually the model's context length).
    pub max_capacity: usize,
    /// The stored dtype, one of [`CACHE_DTYPES`](crate::CACHE_DTYPES): f32, f16, bf16 or f8e4m3.
    pub dtype: DType,
    pub device: Device,
    /// Keys are stored divided by this (real = stored × `k_scale`); finite and positive, 1.0
    /// to store them as they are. With f8e4m3, keys beyond ±448 × `k_scale` saturate there.
    pub k_scale: f32,
    /// Values are stored divided by this, as keys are by `k_scale`; 1.0 to store them as they are.
    pub v_scale: f32,
}

impl KvCacheConfig {
    /// The per-tensor scales of keys and values (see [`KvCacheConfig::k_scale`]).
    pub fn with_kv_scales(mut self, k_scale: f32, v_scale: f32) -> Self {
        self.k_scale = k_scale;
        self.v_scale = v_scale;
        self
    }
}

/// Keys and values of one attention layer, for a batch of sequences.
///
/// Every sequence has its own length: [`KvCache::append`] writes each sequence's new positions
/// right after its own last one, and [`KvCache::append_to`] extends a single sequence (for
/// prompts of different lengths). Views span the longest sequence; positions of a shorter
/// sequence past its length hold stale data and must be masked, e.g. with
/// [`crate::flash_decode_varlen`] and [`KvCache::seq_lens_tensor`].
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    k_form: StoredForm,
    v_form: StoredForm,
    seq_lens: Vec<usize>,
    max_capacity: usize,
}

impl KvCache {
    /// Allocates the cache with `config.initial_capacity` positions per sequence (at least 1, at
    /// most `config.max_capacity`), filled with zeros. Fails on a dtype outside
    /// [`CACHE_DTYPES`](crate::CACHE_DTYPES) and on scales that are not finite and positive.
    pub fn new(config: &KvCacheConfig) -> Result<Self> {
        let KvCacheConfig {
            batch,
            kv_heads,
            head_dim,
            initial_capacity,
            max_capacity,
            dtype,
            ref device,
            k_scale,
            v_scale,
        } = *config;
        if batch == 0 || kv_heads == 0 || head_dim == 0 || max_capacity == 0 {
            bail!(
                "kv cache: batch ({batch}), kv_heads ({kv_heads}), head_dim ({head_dim}) and \
                 max_capacity ({max_capacity}) must all be at least 1"
            )
        }
        let k_form = StoredForm::new(dtype, k_scale, "k_scale")?;
        let v_form = StoredForm::new(dtype, v_scale, "v_scale")?;
        let capacity = initial_capacity.clamp(1, max_capacity);
        let k = Tensor::zeros((batch, kv_heads, capacity, head_dim), dtype, device)?;
        let v = k.zeros_like()?;
        Ok(Self {
            k,
            v,
            k_form,
            v_form,
            seq_lens: vec![0; batch],
            max_capacity,
        })
    }

    pub fn batch(&self) -> usize {
        self.seq_lens.len()
    }

    /// The configuration of an empty cache like this one, at its current capacity.
    pub fn config(&self) -> KvCacheConfig {
        KvCacheConfig {
            batch: self.batch(),
            kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            initial_capacity: self.capacity(),
            max_capacity: self.max_capacity,
            dtype: self.dtype(),
            device: self.device().clone(),
            k_scale: self.k_scale(),
            v_scale: self.v_scale(),
        }
    }

    pub fn kv_heads(&self) -> usize {
        self.k.dims()[1]
    }

    /// Positions allocated per sequence.
    pub fn capacity(&self) -> usize {
        self.k.dims()[2]
    }

    pub fn head_dim(&self) -> usize {
        self.k.dims()[3]
    }

    pub fn max_capacity(&self) -> usize {
        self.max_capacity
    }

    /// The stored dtype: that of the views.
    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }

    /// The real keys are the stored ones (the views) times this.
    pub fn k_scale(&self) -> f32 {
        self.k_form.scale()
    }

    /// The real values are the stored ones (the views) times this.
    pub fn v_scale(&self) -> f32 {
        self.v_form.scale()
    }

    pub fn device(&self) -> &Device {
        self.k.device()
    }

    /// The length of the longest sequence: the `kv_len` of the views.
    pub fn len(&self) -> usize {
        self.seq_lens.iter().copied().max().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cached positions of each sequence.
    pub fn seq_lens(&self) -> &[usize] {
        &self.seq_lens
    }

    /// Whether all sequences have the same length (then views need no masking).
    pub fn is_uniform(&self) -> bool {
        self.seq_lens.windows(2).all(|w| w[0] == w[1])
    }

    /// The sequence lengths as a u32 `(batch,)` tensor on the cache's device, the form
    /// [`crate::flash_decode_varlen`] takes.
    pub fn seq_lens_tensor(&self) -> Result<Tensor> {
        let lens = self
            .seq_lens
            .iter()
            .map(|&len| u32::try_from(len))
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(candle_core::Error::wrap)?;
        Tensor::from_vec(lens, self.batch(), self.device())
    }

    /// Forgets every cached position, keeping the allocation.
    pub fn reset(&mut self) {
        self.seq_lens.fill(0);
    }

    /// Forgets the positions past `len` of every sequence (e.g. rejected speculative tokens);
    /// sequences already at most `len` long are unchanged.
    pub fn truncate(&mut self, len: usize) {
        self.seq_lens.iter_mut().for_each(|l| *l = (*l).min(len));
    }

    /// Appends `t` new positions to every sequence; `k_new` and `v_new` are the real keys and
    /// values `(batch, t, kv_heads, head_dim)` in f32, f16 or bf16, stored as described on
    /// [`KvCacheConfig::k_scale`]. Returns the views after the append.
    pub fn append(&mut self, k_new: &Tensor, v_new: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = self.check_new("append", k_new, v_new, self.batch())?;
        let needed = self.len() + t;
        self.reserve(needed)?;
        if self.is_uniform() {
            self.write_uniform(self.len(), k_new, v_new)?;
        } else {
            self.write_each_sequence(k_new, v_new)?;
        }
        self.seq_lens.iter_mut().for_each(|len| *len += t);
        self.views()
    }

    /// Writes every sequence's new rows at positions `at..at + t`: on CUDA K and V in one launch
    /// that reads the rows through their strides, elsewhere stored and copied in.
    fn write_uniform(&self, at: usize, k_new: &Tensor, v_new: &Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return self.write_rows(k_new, v_new, RowStarts::Host(at));
        }
        self.k_form.write(&self.k, at, k_new)?;
        self.v_form.write(&self.v, at, v_new)
    }

    /// The cache-write kernel over K and V (see `kernels/cache_write.cuh`).
    #[cfg(feature = "cuda")]
    fn write_rows(&self, k_new: &Tensor, v_new: &Tensor, starts: RowStarts) -> Result<()> {
        crate::cuda::cache_write::write_rows(
            (&self.k, &self.v),
            (
                &self.k_form.kernel_rows(k_new)?,
                &self.v_form.kernel_rows(v_new)?,
            ),
            starts,
            (self.k_scale(), self.v_scale()),
        )
    }

    /// Writes each sequence's new rows after its own last position, one sequence at a time.
    fn write_each_sequence(&self, k_new: &Tensor, v_new: &Tensor) -> Result<()> {
        for (seq, &at) in self.seq_lens.iter().enumerate() {
            // Narrowing the batch dim of contiguous storage keeps it contiguous, so the write
            // goes straight into this sequence's rows.
            let rows = |x: &Tensor| x.narrow(0, seq, 1);
            self.k_form
                .write(&self.k.narrow(0, seq, 1)?, at, &rows(k_new)?)?;
            self.v_form
                .write(&self.v.narrow(0, seq, 1)?, at, &rows(v_new)?)?;
        }
        Ok(())
    }

    /// Appends `t` new positions to sequence `seq` only; `k_new` and `v_new` are
    /// `(1, t, kv_heads, head_dim)`, as for [`KvCache::append`]. Returns that sequence's views
    /// `(1, len, kv_heads, head_dim)`.
    pub fn append_to(
        &mut self,
        seq: usize,
        k_new: &Tensor,
        v_new: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        if seq >= self.batch() {
            bail!(
                "kv cache: sequence {seq} is out of range, the cache holds {} sequences",
                self.batch()
            )
        }
        let t = self.check_new("append_to", k_new, v_new, 1)?;
        let at = self.seq_lens[seq];
        self.reserve(at + t)?;
        self.k_form.write(&self.k.narrow(0, seq, 1)?, at, k_new)?;
        self.v_form.write(&self.v.narrow(0, seq, 1)?, at, v_new)?;
        self.seq_lens[seq] += t;
        self.sequence_views(seq)
    }

    /// Like [`KvCache::append`], for a step whose positions live in device memory: `lengths`
    /// is a u32 `(batch,)` tensor on the cache's device holding [`KvCache::seq_lens`], and the
    /// rows go to `lengths[s]..lengths[s] + t` as the device reads it when the write runs. A
    /// decode step captured in a CUDA graph appends this way, so that each replay writes where
    /// the cache then ends. Returns the views over the whole capacity,
    /// [`KvCache::capacity_views`], to be masked by the new lengths.
    ///
    /// On CUDA `lengths` is trusted to match the cache's lengths (checking it would wait for the
    /// device); positions past the capacity are never written. Elsewhere a mismatch is an error.
    pub fn append_at(
        &mut self,
        k_new: &Tensor,
        v_new: &Tensor,
        lengths: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let t = self.check_new("append_at", k_new, v_new, self.batch())?;
        if lengths.dtype() != DType::U32
            || lengths.dims() != [self.batch()]
            || !lengths.device().same_device(self.device())
        {
            bail!(
                "kv cache append_at: lengths must be a u32 ({},) tensor on the cache's device, got \
                 {:?} {:?} on {:?}",
                self.batch(),
                lengths.dtype(),
                lengths.dims(),
                lengths.device().location()
            )
        }
        self.reserve(self.len() + t)?;
        self.write_at(k_new, v_new, lengths)?;
        self.seq_lens.iter_mut().for_each(|len| *len += t);
        self.capacity_views()
    }

    /// Makes room for `t` more positions in every sequence, has `write` store their keys and
    /// values in the storage `(batch, kv_heads, capacity, head_dim)` (given with the scales), and
    /// counts them: [`KvCache::append_at`] for a kernel that computes the rows and stores them
    /// in one launch, at the lengths it reads from device memory. Returns the views over the
    /// whole capacity.
    #[cfg(all(feature = "cuda", feature = "models"))]
    pub(crate) fn append_in_place(
        &mut self,
        t: usize,
        write: impl FnOnce(&Tensor, &Tensor, (f32, f32)) -> Result<()>,
    ) -> Result<(Tensor, Tensor)> {
        self.reserve(self.len() + t)?;
        write(&self.k, &self.v, (self.k_scale(), self.v_scale()))?;
        self.seq_lens.iter_mut().for_each(|len| *len += t);
        self.capacity_views()
    }

    /// Whether a kernel may store rows of `dtype` in this cache by themselves: the cache holds
    /// them as they are (its dtype, unscaled), or quantizes them to fp8 with its scales, as the
    /// cache-write kernel does.
    #[cfg(all(feature = "cuda", feature = "models"))]
    pub(crate) fn stores_rows_of(&self, dtype: DType) -> bool {
        self.dtype() == DType::F8E4M3
            || (self.dtype() == dtype && self.k_scale() == 1.0 && self.v_scale() == 1.0)
    }

    #[cfg(feature = "cuda")]
    fn write_at(&self, k_new: &Tensor, v_new: &Tensor, lengths: &Tensor) -> Result<()> {
        if !self.device().is_cuda() {
            return self.write_at_host_lengths(k_new, v_new, lengths);
        }
        let lengths = lengths.contiguous()?;
        self.write_rows(k_new, v_new, RowStarts::Device(&lengths))
    }

    #[cfg(not(feature = "cuda"))]
    fn write_at(&self, k_new: &Tensor, v_new: &Tensor, lengths: &Tensor) -> Result<()> {
        self.write_at_host_lengths(k_new, v_new, lengths)
    }

    /// [`KvCache::append_at`]'s write where the lengths can be read without waiting on a GPU.
    fn write_at_host_lengths(
        &self,
        k_new: &Tensor,
        v_new: &Tensor,
        lengths: &Tensor,
    ) -> Result<()> {
        let given = lengths.to_vec1::<u32>()?;
        if given
            .iter()
            .zip(&self.seq_lens)
            .any(|(&g, &l)| g as usize != l)
        {
            bail!(
                "kv cache append_at: lengths {given:?} differ from the cached lengths {:?}",
                self.seq_lens
            )
        }
        self.write_each_sequence(k_new, v_new)
    }

    /// The ids of the K and V storage: a cache that grew, or another cache, has others.
    #[cfg(all(feature = "cuda", feature = "models"))]
    pub(crate) fn storage_ids(&self) -> (candle_core::TensorId, candle_core::TensorId) {
        (self.k.id(), self.v.id())
    }

    /// Counts `t` positions appended to every sequence by device work whose host side did not
    /// run again (a replayed graph of [`KvCache::append_at`]).
    #[cfg(all(feature = "cuda", feature = "models"))]
    pub(crate) fn count_appended(&mut self, t: usize) {
        self.seq_lens.iter_mut().for_each(|len| *len += t);
    }

    /// Keys and values `(batch, capacity, kv_heads, head_dim)` over every allocated position, as
    /// strided views of the storage; positions past a sequence's length hold stale data.
    pub fn capacity_views(&self) -> Result<(Tensor, Tensor)> {
        Ok((self.k.transpose(1, 2)?, self.v.transpose(1, 2)?))
    }

    /// Keys and values `(batch, len, kv_heads, head_dim)` over the longest sequence, as strided
    /// views of the storage.
    pub fn views(&self) -> Result<(Tensor, Tensor)> {
        let len = self.len();
        Ok((
            self.k.narrow(2, 0, len)?.transpose(1, 2)?,
            self.v.narrow(2, 0, len)?.transpose(1, 2)?,
        ))
    }

    /// Keys and values `(1, seq_len, kv_heads, head_dim)` of sequence `seq`, as strided views.
    pub fn sequence_views(&self, seq: usize) -> Result<(Tensor, Tensor)> {
        let Some(&len) = self.seq_lens.get(seq) else {
            bail!(
                "kv cache: sequence {seq} is out of range, the cache holds {} sequences",
                self.batch()
            )
        };
        let view = |x: &Tensor| x.narrow(0, seq, 1)?.narrow(2, 0, len)?.transpose(1, 2);
        Ok((view(&self.k)?, view(&self.v)?))
    }

    /// Makes room for `needed` positions per sequence, doubling the capacity as often as needed
    /// (capped at the maximum).
    pub fn reserve(&mut self, needed: usize) -> Result<()> {
        let capacity = self.capacity();
        if needed <= capacity {
            return Ok(());
        }
        if needed > self.max_capacity {
            bail!(
                "kv cache: {needed} positions needed but the maximum capacity is {} \
                 (the model's context length); start a new sequence or reset the cache",
                self.max_capacity
            )
        }
        let mut new_capacity = capacity;
        while new_capacity < needed {
            new_capacity = new_capacity.saturating_mul(2);
        }
        let new_capacity = new_capacity.min(self.max_capacity);
        let (b, h, _, d) = self.k.dims4()?;
        let grow = |old: &Tensor| -> Result<Tensor> {
            let new = Tensor::zeros((b, h, new_capacity, d), old.dtype(), old.device())?;
            new.slice_set(old, 2, 0)?;
            Ok(new)
        };
        self.k = grow(&self.k)?;
        self.v = grow(&self.v)?;
        Ok(())
    }

    /// Checks new keys/values against the cache; returns their number of positions.
    fn check_new(&self, op: &str, k: &Tensor, v: &Tensor, batch: usize) -> Result<usize> {
        let expected = (batch, self.kv_heads(), self.head_dim());
        for (name, x) in [("k", k), ("v", v)] {
            let wrong_shape = || {
                candle_core::Error::Msg(format!(
                    "kv cache {op}: {name} must be (batch, t, kv_heads, head_dim) = ({}, t, {}, {}), \
                     got {:?}",
                    expected.0,
                    expected.1,
                    expected.2,
                    x.dims()
                ))
            };
            let (b, _t, h, d) = x.dims4().map_err(|_| wrong_shape())?;
            if (b, h, d) != expected {
                return Err(wrong_shape());
            }
            super::stored_kv::check_input_dtype(op, name, x.dtype())?;
            if !x.device().same_device(self.device()) {
                bail!(
                    "kv cache {op}: {name} is on {:?}, the cache is on {:?}",
                    x.device().location(),
                    self.device().location()
                )
            }
        }
        if k.dtype() != v.dtype() {
            bail!(
                "kv cache {op}: k and v must have the same dtype, got {:?} and {:?}",
                k.dtype(),
                v.dtype()
            )
        }
        if k.dims() != v.dims() {
            bail!(
                "kv cache {op}: k and v must have the same shape, got {:?} and {:?}",
                k.dims(),
                v.dims()
            )
        }
        Ok(k.dims()[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::IndexOp;

    fn config(batch: usize, initial: usize, max: usize) -> KvCacheConfig {
        KvCacheConfig {
            batch,
            kv_heads: 2,
            head_dim: 4,
            initial_capacity: initial,
            max_capacity: max,
            dtype: DType::F32,
            device: Device::Cpu,
            k_scale: 1.0,
            v_scale: 1.0,
        }
    }

    /// `(b, t, 2, 4)` with distinct values starting at `start`.
    fn rows(b: usize, t: usize, start: f32) -> Result<Tensor> {
        let n = b * t * 8;
        Tensor::arange(start, start + n as f32, &Device::Cpu)?.reshape((b, t, 2, 4))
    }

    #[test]
    fn appends_in_place_and_views_match_the_concatenation() -> Result<()> {
        let mut cache = KvCache::new(&config(2, 8, 64))?;
        let a = rows(2, 3, 0.0)?;
        let b = rows(2, 1, 1000.0)?;
        cache.append(&a, &(&a + 0.5)?)?;
        // A clone shares the storage: if the append writes in place, the clone sees the new rows.
        let storage_before = cache.k.clone();
        let (k, v) = cache.append(&b, &(&b + 0.5)?)?;
        let seen = storage_before.narrow(2, 3, 1)?.transpose(1, 2)?;
        assert_eq!(
            seen.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
            "append did not write into the existing storage"
        );
        assert_eq!(k.dims(), [2, 4, 2, 4]);
        assert_eq!(k.stride()[3], 1);
        let expected = Tensor::cat(&[&a, &b], 1)?;
        let diff = (k - &expected)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        let diff = (v - (expected + 0.5)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        assert_eq!(cache.len(), 4);
        assert_eq!(cache.seq_lens(), [4, 4]);
        Ok(())
    }

    #[test]
    fn append_at_lengths_writes_what_append_does() -> Result<()> {
        for dtype in [DType::F32, DType::F8E4M3] {
            let config = KvCacheConfig {
                dtype,
                ..config(2, 2, 64)
            }
            .with_kv_scales(0.5, 2.0);
            let (mut plain, mut at) = (KvCache::new(&config)?, KvCache::new(&config)?);
            for (step, t) in [3, 1, 2].into_iter().enumerate() {
                let x = rows(2, t, 10.0 * step as f32)?;
                plain.append(&x, &(&x * 3.0)?)?;
                let lengths = Tensor::new(&[at.len() as u32, at.len() as u32], &Device::Cpu)?;
                let (k, _) = at.append_at(&x, &(&x * 3.0)?, &lengths)?;
                assert_eq!(k.dims(), [2, at.capacity(), 2, 4]);
            }
            assert_eq!(at.seq_lens(), plain.seq_lens());
            let f32_of = |t: Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            let (k_at, v_at) = at.views()?;
            let (k, v) = plain.views()?;
            assert_eq!(f32_of(k_at)?, f32_of(k)?, "{dtype:?}");
            assert_eq!(f32_of(v_at)?, f32_of(v)?, "{dtype:?}");
            let stale = Tensor::new(&[0u32, 0], &Device::Cpu)?;
            let x = rows(2, 1, 0.0)?;
            let err = at.append_at(&x, &x, &stale).unwrap_err();
            assert!(
                err.to_string().contains("differ from the cached lengths"),
                "{err}"
            );
            let err = at.append_at(&x, &x, &stale.narrow(0, 0, 1)?).unwrap_err();
            assert!(err.to_string().contains("u32 (2,)"), "{err}");
        }
        Ok(())
    }

    #[test]
    fn grows_by_doubling_and_keeps_the_data() -> Result<()> {
        let mut cache = KvCache::new(&config(1, 2, 100))?;
        let mut all = Vec::new();
        for step in 0..5 {
            let x = rows(1, 1, 100.0 * step as f32)?;
            cache.append(&x, &x)?;
            all.push(x);
        }
        assert_eq!(cache.capacity(), 8);
        let (k, _) = cache.views()?;
        let expected = Tensor::cat(&all, 1)?;
        assert_eq!(
            k.flatten_all()?.to_vec1::<f32>()?,
            expected.flatten_all()?.to_vec1::<f32>()?
        );
        // A long append jumps straight to the capacity it needs, capped at the maximum.
        let x = rows(1, 90, 0.0)?;
        cache.append(&x, &x)?;
        assert_eq!(cache.capacity(), 100);
        assert_eq!(cache.len(), 95);
        Ok(())
    }

    #[test]
    fn errors_past_the_maximum_capacity() -> Result<()> {
        let mut cache = KvCache::new(&config(1, 4, 6))?;
        let x = rows(1, 5, 0.0)?;
        cache.append(&x, &x)?;
        let err = cache
            .append(&rows(1, 2, 0.0)?, &rows(1, 2, 0.0)?)
            .unwrap_err();
        assert!(err.to_string().contains("maximum capacity is 6"), "{err}");
        assert_eq!(cache.len(), 5, "a failed append must not change the length");
        Ok(())
    }

    #[test]
    fn rejects_mismatched_inputs() -> Result<()> {
        let mut cache = KvCache::new(&config(1, 4, 8))?;
        let good = rows(1, 1, 0.0)?;
        let wrong_heads = Tensor::zeros((1, 1, 3, 4), DType::F32, &Device::Cpu)?;
        assert!(cache.append(&wrong_heads, &wrong_heads).is_err());
        assert!(cache.append(&good, &good.to_dtype(DType::F16)?).is_err());
        assert!(cache.append(&good.to_dtype(DType::F16)?, &good).is_err());
        let err = cache.append(&good.i((.., .., 0))?, &good).unwrap_err();
        assert!(
            err.to_string().contains("(batch, t, kv_heads, head_dim)"),
            "{err}"
        );
        assert!(cache.append_to(1, &good, &good).is_err());
        assert!(cache.is_empty());
        Ok(())
    }

    #[test]
    fn ragged_sequences_append_at_their_own_lengths() -> Result<()> {
        let mut cache = KvCache::new(&config(2, 2, 16))?;
        let a0 = rows(1, 3, 0.0)?;
        let a1 = rows(1, 1, 500.0)?;
        cache.append_to(0, &a0, &a0)?;
        cache.append_to(1, &a1, &a1)?;
        assert_eq!(cache.seq_lens(), [3, 1]);
        assert!(!cache.is_uniform());
        assert_eq!(cache.seq_lens_tensor()?.to_vec1::<u32>()?, [3, 1]);
        let step = rows(2, 1, 900.0)?;
        let (k, _) = cache.append(&step, &step)?;
        assert_eq!(cache.seq_lens(), [4, 2]);
        assert_eq!(k.dims(), [2, 4, 2, 4]);
        let seq0 = Tensor::cat(&[&a0, &step.i(0..1)?], 1)?;
        let seq1 = Tensor::cat(&[&a1, &step.i(1..2)?], 1)?;
        assert_eq!(
            k.i((0..1, 0..4))?.flatten_all()?.to_vec1::<f32>()?,
            seq0.flatten_all()?.to_vec1::<f32>()?
        );
        assert_eq!(
            k.i((1..2, 0..2))?.flatten_all()?.to_vec1::<f32>()?,
            seq1.flatten_all()?.to_vec1::<f32>()?
        );
        let (k1, _) = cache.sequence_views(1)?;
        assert_eq!(k1.dims(), [1, 2, 2, 4]);
        Ok(())
    }

    #[test]
    fn reset_forgets_positions_and_views_feed_the_op() -> Result<()> {
        let mut cache = KvCache::new(&KvCacheConfig {
            head_dim: 64,
            ..config(1, 16, 64)
        })?;
        let kv = Tensor::randn(0f32, 1.0, (1, 10, 2, 64), &Device::Cpu)?;
        let (k, v) = cache.append(&kv, &kv)?;
        let q = Tensor::randn(0f32, 1.0, (1, 1, 4, 64), &Device::Cpu)?;
        let from_views = crate::op::flash_decode(&q, &k, &v, 0.125)?;
        let from_copy = crate::op::flash_decode(&q, &kv, &kv, 0.125)?;
        let diff = (from_views - from_copy)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-6, "{diff}");
        cache.truncate(4);
        assert_eq!(cache.len(), 4);
        let (k4, _) = cache.views()?;
        let diff = (k4 - kv.narrow(1, 0, 4)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        cache.reset();
        assert!(cache.is_empty());
        assert_eq!(cache.capacity(), 16);
        Ok(())
    }
}
