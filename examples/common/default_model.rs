//! The default model: SmolLM2-135M-Instruct, fetched into the cache on first use.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::bad_input::bad_input;

/// The fetch script, built into the binary so that it runs from any directory.
const FETCH_SCRIPT: &str = include_str!("../../scripts/fetch-model.sh");
/// How the script prefixes its error messages on stderr.
const SCRIPT_ERROR_PREFIX: &str = "fetch-model.sh: ";
/// The script's exit status when a file's digest is not the pinned one (the file is removed).
const CORRUPTED_STATUS: i32 = 3;
const HOW_TO_PASS_A_MODEL: &str =
    "pass a local model with --model PATH (a GGUF file, or a Hugging Face model directory)";

/// Returns the path of the default model, downloading it first if the cache does not have it.
///
/// The script's notice ("fetching ... into ...") is forwarded to stderr unless `quiet`.
pub fn default_model_path(quiet: bool) -> Result<PathBuf> {
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(FETCH_SCRIPT)
        .arg("fetch-model.sh")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| {
            format!("cannot run bash to fetch the default model; {HOW_TO_PASS_A_MODEL}")
        })?;

    // The script writes only a line or two to each stream, so reading stderr to the end before
    // stdout cannot fill the stdout pipe and deadlock.
    let mut reason = None;
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            let line = line.context("reading the output of the fetch script")?;
            match line.strip_prefix(SCRIPT_ERROR_PREFIX) {
                Some(error) => reason = Some(error.to_string()),
                None if !quiet => eprintln!("{line}"),
                None => {}
            }
        }
    }
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_string(&mut stdout)
            .context("reading the output of the fetch script")?;
    }
    let status = child.wait().context("waiting for the fetch script")?;
    if status.code() == Some(CORRUPTED_STATUS) {
        let reason = reason.unwrap_or_else(|| "a file's digest is wrong".to_string());
        bad_input!("the default model failed its check: {reason}");
    }
    if !status.success() {
        let reason = reason.unwrap_or_else(|| format!("the fetch script failed ({status})"));
        bail!("cannot fetch the default model: {reason}; {HOW_TO_PASS_A_MODEL}");
    }
    match stdout.lines().last() {
        Some(path) if !path.is_empty() => Ok(PathBuf::from(path)),
        _ => bail!("the fetch script printed no model path; {HOW_TO_PASS_A_MODEL}"),
    }
}
