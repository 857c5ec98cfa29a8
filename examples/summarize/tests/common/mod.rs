//! Shared by the summarizer's test suites: where the binary and the sample documents are, and
//! the turns the runs of the model take.
//!
//! Both are found at run time, not fixed at build time, so that the test binaries also run from a
//! copy of the repository elsewhere: the binary next to the test binary, the documents under the
//! current directory, which is the package's directory under `cargo test` and may be the
//! repository root otherwise.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The `summarize` binary: `cargo test` builds it next to the test binaries, in
/// `<target>/<profile>/`.
pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    // <target>/<profile>/deps/<test>-<hash> -> <target>/<profile>/summarize
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps");
    let binary = profile_dir.join(format!("summarize{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.is_file(),
        "{} is missing; `cargo test` builds it with the tests",
        binary.display()
    );
    binary
}

/// The sample document or facts file `name` of `examples/data`, from the repository root or from
/// this package's directory.
pub fn data(name: &str) -> PathBuf {
    let candidates = [
        Path::new("examples/data").join(name),
        Path::new("../data").join(name),
    ];
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} is in neither {} nor {} (run the tests from the repository root or \
                 the summarizer's package directory)",
                candidates[0].display(),
                candidates[1].display()
            )
        })
}

/// The file name of the default model in its cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cache directory the summarizer reads the default model from: `$CANDLE_SPLITKV_CACHE`,
/// else `~/.cache/candle-splitkv`.
pub fn model_cache() -> Option<PathBuf> {
    match std::env::var_os("CANDLE_SPLITKV_CACHE") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache/candle-splitkv")),
    }
}

/// The default model's path when it is in the cache; `None` with a notice otherwise, so that the
/// test that needs it is skipped (`scripts/fetch-model.sh` fetches it).
pub fn cached_default_model() -> Option<PathBuf> {
    let path = model_cache()
        .map(|cache| cache.join(DEFAULT_MODEL_FILE))
        .filter(|path| path.is_file());
    if path.is_none() {
        eprintln!(
            "skipping: the default model {DEFAULT_MODEL_FILE} is not in the cache \
             ($CANDLE_SPLITKV_CACHE or ~/.cache/candle-splitkv; scripts/fetch-model.sh fetches it)"
        );
    }
    path
}

/// Held by a test for each run of the model: a run uses all cores, so two at once would only make
/// both slower, and a timed run would time the other as well.
pub fn one_model_run_at_a_time() -> MutexGuard<'static, ()> {
    static MODEL_RUNS: Mutex<()> = Mutex::new(());
    MODEL_RUNS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
