//! A reproducible stream of draws for tests that sweep shapes nobody picked by hand.

/// xorshift64: small, fast, and the same sequence on every machine for a given seed.
pub struct SeededDraws {
    state: u64,
}

impl SeededDraws {
    /// A stream from `seed` (any value; zero is moved off the generator's fixed point).
    pub fn new(seed: u64) -> Self {
        Self { state: seed | 1 }
    }

    /// A stream from `SPLITKV_TEST_SEED` when it is set to a number, else from `default`; and the
    /// seed used, to report.
    pub fn from_env_or(default: u64) -> (Self, u64) {
        let seed = std::env::var("SPLITKV_TEST_SEED")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(default);
        (Self::new(seed), seed)
    }

    /// The next draw in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state % n as u64) as usize
    }
}
