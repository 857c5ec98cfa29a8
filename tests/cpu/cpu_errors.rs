//! Every bad input gives an error that names the problem, never a panic.

use candle_core::{DType, Device, Result, Tensor};
use candle_splitkv::{flash_decode, flash_decode_varlen, SplitKvAttention};

fn qkv(
    q: (usize, usize, usize, usize),
    kv: (usize, usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    Ok((
        Tensor::zeros(q, DType::F32, &dev)?,
        Tensor::zeros(kv, DType::F32, &dev)?,
        Tensor::zeros(kv, DType::F32, &dev)?,
    ))
}

fn expect_error(result: Result<Tensor>, needle: &str) {
    match result {
        Ok(t) => panic!(
            "expected an error containing {needle:?}, got a tensor of shape {:?}",
            t.dims()
        ),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(needle),
                "error {msg:?} does not mention {needle:?}"
            );
        }
    }
}

#[test]
fn wrong_rank() -> Result<()> {
    let (_, k, v) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let q3 = Tensor::zeros((1, 8, 64), DType::F32, &Device::Cpu)?;
    expect_error(flash_decode(&q3, &k, &v, 1.0), "rank 4");
    let (q, _, v) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let k3 = Tensor::zeros((16, 8, 64), DType::F32, &Device::Cpu)?;
    expect_error(flash_decode(&q, &k3, &v, 1.0), "rank 4");
    Ok(())
}

#[test]
fn mismatched_batch_or_head_dim() -> Result<()> {
    let (q, k, v) = qkv((2, 1, 8, 64), (1, 16, 8, 64))?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "batch mismatch");
    let (q, k, v) = qkv((1, 1, 8, 128), (1, 16, 8, 64))?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "head_dim mismatch");
    let (q, k, _) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let v = Tensor::zeros((1, 17, 8, 64), DType::F32, &Device::Cpu)?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "same shape");
    Ok(())
}

#[test]
fn heads_not_a_multiple() -> Result<()> {
    let (q, k, v) = qkv((1, 1, 8, 64), (1, 16, 3, 64))?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "multiple of kv_heads");
    Ok(())
}

#[test]
fn unsupported_head_dim() -> Result<()> {
    let (q, k, v) = qkv((1, 1, 8, 48), (1, 16, 8, 48))?;
    expect_error(
        flash_decode(&q, &k, &v, 1.0),
        "head_dim 48 is not supported",
    );
    Ok(())
}

#[test]
fn mixed_or_unsupported_dtypes() -> Result<()> {
    let (q, k, v) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let k16 = k.to_dtype(DType::F16)?;
    expect_error(flash_decode(&q, &k16, &v, 1.0), "share one dtype");
    let (q, k, v) = (
        q.to_dtype(DType::F64)?,
        k.to_dtype(DType::F64)?,
        v.to_dtype(DType::F64)?,
    );
    expect_error(flash_decode(&q, &k, &v, 1.0), "not supported");
    Ok(())
}

#[test]
fn non_contiguous_last_dim() -> Result<()> {
    let (q, _, v) = qkv((1, 1, 8, 64), (1, 64, 8, 64))?;
    // Swapping seq and head_dim leaves a last dim with stride != 1.
    let k = Tensor::zeros((1, 64, 8, 64), DType::F32, &Device::Cpu)?.transpose(1, 3)?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "must be contiguous");
    Ok(())
}

#[test]
fn no_query_tokens() -> Result<()> {
    let (q, k, v) = qkv((1, 0, 8, 64), (1, 16, 8, 64))?;
    expect_error(flash_decode(&q, &k, &v, 1.0), "q_len = 0");
    Ok(())
}

#[test]
fn bad_seqlens() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv((2, 1, 8, 64), (2, 16, 8, 64))?;
    let as_i64 = Tensor::new(&[3i64, 4], &dev)?;
    expect_error(flash_decode_varlen(&q, &k, &v, &as_i64, 1.0), "must be u32");
    let wrong_shape = Tensor::new(&[3u32, 4, 5], &dev)?;
    expect_error(
        flash_decode_varlen(&q, &k, &v, &wrong_shape, 1.0),
        "shape (2,)",
    );
    let too_long = Tensor::new(&[3u32, 17], &dev)?;
    expect_error(
        flash_decode_varlen(&q, &k, &v, &too_long, 1.0),
        "seqlens_k[1] = 17 exceeds",
    );
    Ok(())
}

#[test]
fn zero_splits() -> Result<()> {
    let (q, k, v) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let op = SplitKvAttention::new(1.0).with_num_splits(Some(0));
    expect_error(op.forward(&q, &k, &v), "num_splits must be at least 1");
    Ok(())
}

#[test]
fn backward_is_refused() -> Result<()> {
    let dev = Device::Cpu;
    let q = candle_core::Var::zeros((1, 1, 8, 64), DType::F32, &dev)?;
    let (_, k, v) = qkv((1, 1, 8, 64), (1, 16, 8, 64))?;
    let out = flash_decode(q.as_tensor(), &k, &v, 1.0)?;
    match out.sum_all()?.backward() {
        Ok(_) => panic!("backward should be refused"),
        Err(e) => assert!(e.to_string().contains("inference only"), "{e}"),
    }
    Ok(())
}
