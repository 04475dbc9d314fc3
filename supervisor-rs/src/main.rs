//! `loom-supervisor`: see `cli.rs`.

fn main() {
    std::process::exit(loom_supervisor::cli::main(std::env::args_os(), None));
}
