//! The error for problems with what the user passed in, as opposed to failures while running.

use std::fmt;

/// A problem with the user's input: the document, the model path or an option. The binary exits
/// with code 2 for these, and with 1 for anything else.
#[derive(Debug)]
pub struct BadInput(pub String);

impl fmt::Display for BadInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

/// Returns early from a function returning `anyhow::Result` with a [`BadInput`] error.
macro_rules! bad_input {
    ($($arg:tt)*) => {
        return Err(anyhow::Error::new($crate::bad_input::BadInput(format!($($arg)*))))
    };
}
pub(crate) use bad_input;
