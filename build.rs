//! With the `cuda` feature: compiles every `kernels/*.cu` to PTX with nvcc into OUT_DIR, where
//! `src/cuda.rs` embeds it with `include_str!`. Without the feature it does nothing, so the crate
//! builds on machines with no CUDA toolkit.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(message) = build_kernels() {
        // A build script reports failure by panicking; the message is what the user sees.
        panic!("\n\ncandle-splitkv: cannot build the CUDA kernels: {message}\n\n");
    }
}

fn build_kernels() -> Result<(), String> {
    for var in [
        "NVCC",
        "CUDA_ROOT",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_COMPUTE_CAP",
        "PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let kernel_dir = Path::new("kernels");
    println!("cargo:rerun-if-changed=kernels");
    let mut sources = Vec::new();
    for entry in std::fs::read_dir(kernel_dir).map_err(|e| format!("reading kernels/: {e}"))? {
        let path = entry.map_err(|e| format!("reading kernels/: {e}"))?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push(path),
            Some("cuh") => println!("cargo:rerun-if-changed={}", path.display()),
            _ => {}
        }
    }
    sources.sort();
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    if sources.is_empty() {
        return Ok(());
    }
    let nvcc = find_nvcc()?;
    let compute_cap = compute_cap()?;
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
        let stem = source
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("bad kernel file name {}", source.display()))?;
        let ptx = out_dir.join(format!("{stem}.ptx"));
        let output = Command::new(&nvcc)
            .arg("--ptx")
            .arg(format!("--gpu-architecture=compute_{compute_cap}"))
            .args(["-O3", "-std=c++17", "-Werror", "all-warnings"])
            .arg("-I")
            .arg(kernel_dir)
            .arg("-o")
            .arg(&ptx)
            .arg(source)
            .output()
            .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
        if !output.status.success() {
            return Err(format!(
                "nvcc failed on {}:\n{}{}",
                source.display(),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    println!("cargo:rustc-env=CANDLE_SPLITKV_COMPUTE_CAP={compute_cap}");
    Ok(())
}

/// `NVCC`, then `bin/nvcc` under `CUDA_ROOT`, `CUDA_HOME` or `CUDA_PATH`, then `nvcc` on PATH.
fn find_nvcc() -> Result<PathBuf, String> {
    if let Some(nvcc) = env::var_os("NVCC") {
        return Ok(PathBuf::from(nvcc));
    }
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            let candidate = PathBuf::from(root).join("bin").join("nvcc");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let candidate = dir.join("nvcc");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(
        "nvcc not found; set NVCC or CUDA_ROOT, or run scripts/cuda-toolkit.sh and export \
         what it prints"
            .into(),
    )
}

/// `CUDA_COMPUTE_CAP` (e.g. 80 or 90), else the first GPU that nvidia-smi reports.
fn compute_cap() -> Result<String, String> {
    if let Ok(cap) = env::var("CUDA_COMPUTE_CAP") {
        let cap = cap.trim().replace('.', "");
        if cap.is_empty() || !cap.chars().all(|c| c.is_ascii_digit()) {
            return Err(format!(
                "CUDA_COMPUTE_CAP must be a number such as 80 or 90, got {cap:?}"
            ));
        }
        return Ok(cap);
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    if let Ok(out) = smi {
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            if let Some(first) = text.lines().next() {
                let cap = first.trim().replace('.', "");
                if !cap.is_empty() && cap.chars().all(|c| c.is_ascii_digit()) {
                    return Ok(cap);
                }
            }
        }
    }
    Err(
        "no GPU found by nvidia-smi to pick the target; set CUDA_COMPUTE_CAP (80 for A100, \
         90 for H100/H200)"
            .into(),
    )
}
