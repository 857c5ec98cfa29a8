//! Tests that need the process to themselves. The suites of a test binary run on parallel
//! threads, and a CUDA graph capture fails when another thread of the process synchronises the
//! device meanwhile (setting a device up or tearing it down frees memory, which synchronises
//! implicitly); a test that must be the first user of a fresh device needs a fresh process too.
//! Such a test reruns its binary on itself alone.

use std::process::Command;

/// Set in a rerun to the name of the test it is for.
const RERUN_OF: &str = "CANDLE_SPLITKV_TEST_RERUN_OF";

/// Whether the calling test, `test` of module `module` (pass `module_path!()`), runs its body in
/// this process: `true` in the rerun of the test binary made for it. Anywhere else, reruns the
/// binary on that one test, passes its output on, asserts that the test ran and passed there,
/// and returns `false`.
pub fn in_own_process(module: &str, test: &str) -> bool {
    // libtest names a test by its path below the crate root.
    let name = match module.split_once("::") {
        Some((_, path)) => format!("{path}::{test}"),
        None => test.to_string(),
    };
    if std::env::var_os(RERUN_OF).is_some_and(|of| of == name.as_str()) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test knows its own path");
    let output = Command::new(exe)
        .args([name.as_str(), "--exact", "--show-output"])
        .env(RERUN_OF, &name)
        .output()
        .expect("the test binary reruns");
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "{name} failed in a process of its own ({})",
        output.status
    );
    assert!(
        stdout.contains("test result: ok. 1 passed;"),
        "the rerun for {name} did not run it"
    );
    false
}
