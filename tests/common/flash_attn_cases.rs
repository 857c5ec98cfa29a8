//! candle-flash-attn's behaviour as the checks of `candle_splitkv::flash_attn` state it: an f64
//! reference written from FlashAttention-2's own mask rules (the window sizes as candle-flash-attn
//! hands them to the kernel), and the cases both the CPU and the GPU suites run through it.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::flash_attn;

use super::{assert_close, host_f64};

/// One sequence's keys as FlashAttention-2 masks them for `(window_size_left,
/// window_size_right)` over `sk` keys (candle-flash-attn's reading: a size past `sk` is -1, then
/// an open side facing a set one becomes `sk`), for query `i` of `sq`: the visible key range.
pub fn fa2_visible(
    i: usize,
    sq: usize,
    sk: usize,
    left: Option<usize>,
    right: Option<usize>,
) -> std::ops::Range<usize> {
    let to_i32 = |w: Option<usize>| w.filter(|&w| w <= sk).map_or(-1, |w| w as i64);
    let (mut l, mut r) = (to_i32(left), to_i32(right));
    if l < 0 && r >= 0 {
        l = sk as i64;
    }
    if l >= 0 && r < 0 {
        r = sk as i64;
    }
    let row = i as i64 + sk as i64 - sq as i64;
    if l < 0 && r < 0 {
        return 0..sk;
    }
    let lo = (row - l).max(0);
    let hi = (row + 1 + r).min(sk as i64);
    if hi <= lo {
        return 0..0;
    }
    lo as usize..hi as usize
}

/// Attention of one sequence in f64: q `(sq, h_q, d)`, k and v `(sk, h_kv, d)` row-major; the
/// output `(sq, h_q, d)`, zeros for a query that sees no key.
#[allow(clippy::too_many_arguments)]
pub fn fa2_sequence(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (sq, sk, h_q, h_kv, d): (usize, usize, usize, usize, usize),
    scale: f64,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f64>,
) -> Vec<f64> {
    let group = h_q / h_kv;
    let mut out = vec![0f64; sq * h_q * d];
    for i in 0..sq {
        let keys = fa2_visible(i, sq, sk, window.0, window.1);
        for h in 0..h_q {
            let g = h / group;
            let qrow = &q[(i * h_q + h) * d..][..d];
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let krow = &k[(j * h_kv + g) * d..][..d];
                    let s = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale;
                    softcap.map_or(s, |c| c * (s / c).tanh())
                })
                .collect();
            if scores.is_empty() {
                continue;
            }
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let o = &mut out[(i * h_q + h) * d..][..d];
            for (j, w) in keys.clone().zip(&weights) {
                let vrow = &v[(j * h_kv + g) * d..][..d];
                for (acc, x) in o.iter_mut().zip(vrow) {
                    *acc += w / sum * x;
                }
            }
        }
    }
    out
}

/// One fixed-length case: `(batch, sq, sk, h_q, h_kv, d)`, the window and the soft cap.
#[derive(Debug, Clone, Copy)]
pub struct ApiCase {
    pub batch: usize,
    pub sq: usize,
    pub sk: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: f32,
}

/// The fixed-length cases: causal and not, more and fewer queries than keys, local windows on
/// either side, a size past the keys, a window of the query alone, soft-capping; prefill-sized
/// query counts where `long`.
pub fn api_cases(long: bool) -> Vec<ApiCase> {
    let base = ApiCase {
        batch: 2,
        sq: 37,
        sk: 37,
        h_q: 8,
        h_kv: 2,
        d: 64,
        window: (None, Some(0)),
        softcap: 0.0,
    };
    let mut cases = vec![
        base,
        ApiCase {
            window: (None, None),
            ..base
        },
        // Fewer queries than keys: a chunk after a past, and one decode token.
        ApiCase {
            sq: 5,
            sk: 300,
            ..base
        },
        ApiCase {
            sq: 5,
            sk: 300,
            window: (None, None),
            ..base
        },
        ApiCase {
            sq: 1,
            sk: 300,
            d: 128,
            ..base
        },
        // More queries than keys: causal rows before the first key see nothing.
        ApiCase {
            sq: 40,
            sk: 24,
            ..base
        },
        ApiCase {
            sq: 40,
            sk: 24,
            window: (None, None),
            ..base
        },
        // Local windows.
        ApiCase {
            sq: 12,
            sk: 90,
            window: (Some(7), Some(0)),
            ..base
        },
        ApiCase {
            sq: 12,
            sk: 90,
            window: (Some(9), Some(3)),
            ..base
        },
        ApiCase {
            sq: 12,
            sk: 90,
            window: (None, Some(4)),
            ..base
        },
        ApiCase {
            sq: 12,
            sk: 90,
            window: (Some(6), None),
            ..base
        },
        ApiCase {
            window: (Some(0), Some(0)),
            ..base
        },
        // A size past the keys is no bound: this is the causal mask.
        ApiCase {
            window: (Some(500), Some(0)),
            ..base
        },
        ApiCase {
            sq: 20,
            sk: 64,
            h_q: 9,
            h_kv: 3,
            d: 80,
            window: (Some(10), Some(2)),
            softcap: 5.0,
            ..base
        },
        ApiCase {
            sq: 20,
            sk: 64,
            d: 256,
            window: (None, None),
            softcap: 5.0,
            ..base
        },
    ];
    if long {
        cases.extend([
            ApiCase {
                batch: 1,
                sq: 700,
                sk: 700,
                d: 128,
                ..base
            },
            ApiCase {
                batch: 1,
                sq: 700,
                sk: 700,
                d: 128,
                window: (None, None),
                ..base
            },
            ApiCase {
                batch: 1,
                sq: 300,
                sk: 1000,
                d: 128,
                window: (Some(200), Some(40)),
                ..base
            },
            ApiCase {
                batch: 1,
                sq: 300,
                sk: 1000,
                d: 96,
                window: (None, Some(33)),
                softcap: 30.0,
                ..base
            },
        ]);
    }
    cases
}

fn random(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// Checks `flash_attn_alibi_windowed_softcap(None, ..)` (the most general fixed-length form) and,
/// where the case says the same thing in fewer words, `flash_attn` and `flash_attn_windowed`,
/// against [`fa2_sequence`] for every batch entry.
pub fn check_api_case(case: &ApiCase, dtype: DType, device: &Device) -> Result<()> {
    let &ApiCase {
        batch,
        sq,
        sk,
        h_q,
        h_kv,
        d,
        window,
        softcap,
    } = case;
    let q = random(&[batch, sq, h_q, d], dtype, device)?;
    let k = random(&[batch, sk, h_kv, d], dtype, device)?;
    let v = random(&[batch, sk, h_kv, d], dtype, device)?;
    let scale = 1.0 / (d as f32).sqrt();
    let (qh, kh, vh) = (host_f64(&q)?, host_f64(&k)?, host_f64(&v)?);
    let mut want = Vec::with_capacity(qh.len());
    for b in 0..batch {
        want.extend(fa2_sequence(
            &qh[b * sq * h_q * d..][..sq * h_q * d],
            &kh[b * sk * h_kv * d..][..sk * h_kv * d],
            &vh[b * sk * h_kv * d..][..sk * h_kv * d],
            (sq, sk, h_q, h_kv, d),
            scale as f64,
            window,
            (softcap > 0.0).then_some(softcap as f64),
        ));
    }
    let what = format!("{case:?} {dtype:?}");
    let got = flash_attn::flash_attn_alibi_windowed_softcap(
        &q, &k, &v, None, scale, window.0, window.1, softcap,
    )?;
    assert_eq!(got.dims(), q.dims(), "{what}: output shape");
    assert_eq!(got.dtype(), dtype, "{what}: output dtype");
    assert_close(&what, &got, &want, dtype)?;
    if softcap == 0.0 {
        let windowed = flash_attn::flash_attn_windowed(&q, &k, &v, scale, window.0, window.1)?;
        assert_close(&format!("{what} windowed"), &windowed, &want, dtype)?;
        let causal = match window {
            (None, Some(0)) => Some(true),
            (None, None) => Some(false),
            _ => None,
        };
        if let Some(causal) = causal {
            let plain = flash_attn::flash_attn(&q, &k, &v, scale, causal)?;
            assert_close(&format!("{what} flash_attn"), &plain, &want, dtype)?;
        }
    }
    Ok(())
}

/// One varlen case: the query and key length of each sequence, the window, the soft cap, and a
/// page size to lay the keys out in pages of (`None`: packed).
#[derive(Debug, Clone)]
pub struct VarlenCase {
    pub lens: Vec<(usize, usize)>,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: f32,
    pub page_size: Option<usize>,
}

pub fn varlen_cases(long: bool) -> Vec<VarlenCase> {
    let base = VarlenCase {
        lens: vec![(7, 7), (1, 50), (30, 30), (4, 90)],
        h_q: 8,
        h_kv: 2,
        d: 64,
        window: (None, Some(0)),
        softcap: 0.0,
        page_size: None,
    };
    let mut cases = vec![
        base.clone(),
        VarlenCase {
            window: (None, None),
            ..base.clone()
        },
        VarlenCase {
            window: (Some(5), Some(2)),
            softcap: 4.0,
            ..base.clone()
        },
        // More queries than keys in one sequence; an empty sequence.
        VarlenCase {
            lens: vec![(12, 5), (0, 9), (3, 3)],
            ..base.clone()
        },
        // Every sequence as long as the longest: the packed tensors are the padded ones.
        VarlenCase {
            lens: vec![(16, 16), (16, 16), (16, 16)],
            h_q: 9,
            h_kv: 3,
            d: 128,
            ..base.clone()
        },
        // Equal key lengths, different query lengths.
        VarlenCase {
            lens: vec![(3, 40), (9, 40)],
            ..base.clone()
        },
        VarlenCase {
            page_size: Some(16),
            window: (Some(20), Some(0)),
            ..base.clone()
        },
        VarlenCase {
            page_size: Some(1),
            window: (None, None),
            ..base.clone()
        },
    ];
    if long {
        cases.push(VarlenCase {
            lens: vec![(300, 300), (45, 800), (1, 1000), (160, 160)],
            d: 128,
            ..base.clone()
        });
        cases.push(VarlenCase {
            lens: vec![(300, 300), (45, 800), (1, 1000), (160, 160)],
            d: 128,
            page_size: Some(64),
            window: (Some(100), Some(8)),
            ..base
        });
    }
    cases
}

/// Checks the varlen forms (packed, or paged through `flash_attn_varlen_paged_windowed`) against
/// [`fa2_sequence`] on each sequence's own rows.
pub fn check_varlen_case(case: &VarlenCase, dtype: DType, device: &Device) -> Result<()> {
    let VarlenCase {
        lens,
        h_q,
        h_kv,
        d,
        window,
        softcap,
        page_size,
    } = case;
    let (h_q, h_kv, d, window, softcap) = (*h_q, *h_kv, *d, *window, *softcap);
    let total_q: usize = lens.iter().map(|l| l.0).sum();
    let total_k: usize = lens.iter().map(|l| l.1).sum();
    let q = random(&[total_q, h_q, d], dtype, device)?;
    let k = random(&[total_k, h_kv, d], dtype, device)?;
    let v = random(&[total_k, h_kv, d], dtype, device)?;
    let cumulative = |pick: fn(&(usize, usize)) -> usize| -> Result<Tensor> {
        let mut acc = vec![0u32];
        for l in lens {
            acc.push(acc[acc.len() - 1] + pick(l) as u32);
        }
        Tensor::new(acc, device)
    };
    let (seqlens_q, seqlens_k) = (cumulative(|l| l.0)?, cumulative(|l| l.1)?);
    let max_q = lens.iter().map(|l| l.0).max().unwrap_or(0).max(1);
    let max_k = lens.iter().map(|l| l.1).max().unwrap_or(0);
    let scale = 1.0 / (d as f32).sqrt();
    let (qh, kh, vh) = (host_f64(&q)?, host_f64(&k)?, host_f64(&v)?);
    let mut want = Vec::with_capacity(qh.len());
    let (mut q0, mut k0) = (0, 0);
    for &(sq, sk) in lens {
        want.extend(fa2_sequence(
            &qh[q0 * h_q * d..][..sq * h_q * d],
            &kh[k0 * h_kv * d..][..sk * h_kv * d],
            &vh[k0 * h_kv * d..][..sk * h_kv * d],
            (sq, sk, h_q, h_kv, d),
            scale as f64,
            window,
            (softcap > 0.0).then_some(softcap as f64),
        ));
        q0 += sq;
        k0 += sk;
    }
    let what = format!("{case:?} {dtype:?}");
    let got = match page_size {
        None => flash_attn::flash_attn_varlen_alibi_windowed_softcap(
            &q, &k, &v, None, &seqlens_q, &seqlens_k, max_q, max_k, scale, window.0, window.1,
            softcap,
        )?,
        Some(page) => {
            let (k_pages, v_pages, table) = pages_of(&k, &v, lens, *page, device)?;
            flash_attn::flash_attn_varlen_paged_windowed(
                &q,
                &k_pages,
                &v_pages,
                &seqlens_q,
                &seqlens_k,
                &table,
                None,
                max_q,
                max_k,
                scale,
                window.0,
                window.1,
                *page,
                (softcap > 0.0).then_some(softcap),
            )?
        }
    };
    assert_eq!(got.dims(), q.dims(), "{what}: output shape");
    assert_close(&what, &got, &want, dtype)?;
    if softcap == 0.0 && page_size.is_none() && window == (None, Some(0)) {
        let plain = flash_attn::flash_attn_varlen(
            &q, &k, &v, &seqlens_q, &seqlens_k, max_q, max_k, scale, true,
        )?;
        assert_close(&format!("{what} flash_attn_varlen"), &plain, &want, dtype)?;
    }
    Ok(())
}

/// Packed k and v `(total_k, h_kv, d)` copied into pools of pages `(pages, page_size, h_kv, d)`,
/// each sequence's pages in reverse order in the pool (so that the table matters), and the
/// block table u32 `(batch, max_pages)`.
fn pages_of(
    k: &Tensor,
    v: &Tensor,
    lens: &[(usize, usize)],
    page_size: usize,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (_, h_kv, d) = k.dims3()?;
    let per_seq: Vec<usize> = lens.iter().map(|l| l.1.div_ceil(page_size)).collect();
    let max_pages = per_seq.iter().copied().max().unwrap_or(0).max(1);
    let num_pages: usize = per_seq.iter().sum::<usize>().max(1);
    let (kh, vh) = (
        k.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
        v.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
    );
    let (kh, vh) = (
        kh.flatten_all()?.to_vec1::<f32>()?,
        vh.flatten_all()?.to_vec1::<f32>()?,
    );
    let row = h_kv * d;
    // Pages past a sequence's length are NaN: they must never be read.
    let mut k_pool = vec![f32::NAN; num_pages * page_size * row];
    let mut v_pool = k_pool.clone();
    let mut table = vec![0u32; lens.len() * max_pages];
    let (mut next_page, mut k0) = (num_pages, 0);
    for (b, (&(_, sk), &pages)) in lens.iter().zip(&per_seq).enumerate() {
        for p in 0..pages {
            next_page -= 1;
            table[b * max_pages + p] = next_page as u32;
            for r in 0..page_size.min(sk - p * page_size) {
                let src = (k0 + p * page_size + r) * row;
                let dst = (next_page * page_size + r) * row;
                k_pool[dst..dst + row].copy_from_slice(&kh[src..src + row]);
                v_pool[dst..dst + row].copy_from_slice(&vh[src..src + row]);
            }
        }
        k0 += sk;
    }
    let dtype = k.dtype();
    let shape = (num_pages, page_size, h_kv, d);
    Ok((
        Tensor::from_vec(k_pool, shape, device)?.to_dtype(dtype)?,
        Tensor::from_vec(v_pool, shape, device)?.to_dtype(dtype)?,
        Tensor::from_vec(table, (lens.len(), max_pages), device)?,
    ))
}
