//! The arithmetic of the CPU passes' inner loops, in one form per instruction set.

/// The inner loops' arithmetic. Only the multiply-add differs between instruction sets;
/// everything else is written once on top of it, and a pass inlined into a `#[target_feature]`
/// function gets the wide forms.
pub(super) trait InnerLoops {
    /// `a * b + c`.
    fn mul_add(a: f32, b: f32, c: f32) -> f32;

    /// `a · b`, with [`LANES`] independent accumulators so that the adds do not wait on one
    /// dependency chain. Every supported head dim is a multiple of `LANES`.
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let split = a.len() - a.len() % LANES;
        for (x, y) in a[..split]
            .chunks_exact(LANES)
            .zip(b[..split].chunks_exact(LANES))
        {
            for i in 0..LANES {
                acc[i] = Self::mul_add(x[i], y[i], acc[i]);
            }
        }
        let tail: f32 = a[split..].iter().zip(&b[split..]).map(|(x, y)| x * y).sum();
        acc.iter().sum::<f32>() + tail
    }

    /// `acc += alpha * x`.
    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], acc: &mut [f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a = Self::mul_add(alpha, v, *a);
        }
    }

    /// `2^x` for `x ≤ 0` (a score minus the running max), within 1.9e-7 relative, in a form the
    /// compiler vectorises (libm's `exp2f` is a call per element). Inputs below -126 give 2^-126,
    /// which weighs nothing next to the running sum (at least 1); NaN stays NaN.
    #[inline(always)]
    fn exp2_nonpositive(x: f32) -> f32 {
        // Near-minimax polynomial for 2^f on [-1, 0] (constant and linear terms exact).
        const C: [f32; 7] = [
            1.0,
            std::f32::consts::LN_2,
            0.240_225_69,
            0.055_495_9,
            0.009_588_331,
            0.001_282_349_7,
            0.000_111_416_89,
        ];
        // Adding 1.5 · 2^23 rounds an f32 below 2^22 in magnitude to an integer, held in the low
        // bits of the sum: float arithmetic, unlike a saturating `as i32`, stays vectorised.
        const ROUNDER: f32 = 12_582_912.0;
        let x = if x < -126.0 { -126.0 } else { x };
        // x = whole + frac with whole = trunc(x) = ceil(x) in [-126, 0] and frac in (-1, 0].
        let nearest = (x + ROUNDER) - ROUNDER;
        let whole = if nearest < x { nearest + 1.0 } else { nearest };
        let frac = x - whole;
        let whole_bits =
            ((whole + ROUNDER).to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
        let mut p = C[6];
        for &c in C[..6].iter().rev() {
            p = Self::mul_add(p, frac, c);
        }
        p * f32::from_bits((whole_bits.wrapping_add(127) as u32) << 23)
    }
}

/// Independent accumulators per dot product: two 8-wide vectors.
const LANES: usize = 16;

/// Separate multiplies and adds, which the compiler vectorises for the target's baseline.
pub(super) struct Portable;

impl InnerLoops for Portable {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Fused multiply-adds; only fast where FMA is enabled (inside an AVX2 and FMA entry point).
#[cfg(target_arch = "x86_64")]
pub(super) struct Fused;

#[cfg(target_arch = "x86_64")]
impl InnerLoops for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_exp2<S: InnerLoops>() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -130.0 * i as f32 / 200_000.0;
            let got = S::exp2_nonpositive(x) as f64;
            let want = (x.max(-126.0) as f64).exp2();
            worst = worst.max((got / want - 1.0).abs());
        }
        assert!(worst < 3e-7, "exp2 relative error {worst}");
        assert_eq!(S::exp2_nonpositive(0.0), 1.0);
        assert!(S::exp2_nonpositive(f32::NEG_INFINITY) <= f32::MIN_POSITIVE);
        assert!(S::exp2_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn exp2_is_accurate() {
        check_exp2::<Portable>();
        #[cfg(target_arch = "x86_64")]
        check_exp2::<Fused>();
    }
}
