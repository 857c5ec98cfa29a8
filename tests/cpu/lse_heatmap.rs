//! Runs the `lse_heatmap` example on the default model: it writes a PNG of the expected size with
//! every LSE finite, and refuses bad options with a clear error. Skipped with a notice where the
//! default model is not in the cache (CI fetches it).
//!
//! `cargo test` builds the examples next to the test binaries, in `<target>/<profile>/examples/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;

fn binary() -> PathBuf {
    common::example_binary("lse_heatmap")
}

fn default_model() -> Option<PathBuf> {
    let cache = match std::env::var_os("CANDLE_SPLITKV_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/candle-splitkv"),
    };
    let path = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    path.is_file().then_some(path)
}

#[test]
fn writes_a_map_of_finite_lses() {
    let Some(model) = default_model() else {
        eprintln!("skipping: the default model is not in the cache");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("lse.png");
    let document = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/split-kv-decoding.md");
    let output = Command::new(binary())
        .arg(&document)
        .args(["--model", model.to_str().unwrap(), "--cpu", "--steps", "8"])
        .args(["--max-prompt-tokens", "300", "--out", out.to_str().unwrap()])
        .output()
        .expect("the lse_heatmap binary starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("0 not finite"), "{stderr}");
    // 8 steps of 6 pixels; 30 layers of 9 heads of 2 pixels, plus a separator line per layer.
    let (width, height) = image::image_dimensions(&out).unwrap();
    assert_eq!((width, height), (8 * 6, 30 * (9 * 2 + 1)));
}

#[test]
fn zero_steps_are_refused() {
    let output = Command::new(binary())
        .args(["README.md", "--steps", "0"])
        .output()
        .expect("the lse_heatmap binary starts");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--steps must be at least 1"), "{stderr}");
}
