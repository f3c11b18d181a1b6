//! The `clawmux` binary; everything lives in the library (see `lib.rs` for the layout).

fn main() {
    std::process::exit(clawmux::cli::main());
}
