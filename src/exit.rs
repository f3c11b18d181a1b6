//! Process exit codes, shared by every command (in a module of their own so that `cli` and
//! `admin_cli` do not depend on each other).

/// Success.
pub const OK: i32 = 0;
/// Runtime failure.
pub const FAILURE: i32 = 1;
/// Configuration error (one clear line on stderr).
pub const CONFIG: i32 = 2;
