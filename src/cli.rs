//! The `ciliate` command line (clap). Each subcommand's logic lives in its own module; this file
//! only parses arguments and maps results to exit codes.

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::simulate;

/// Exit status: every policy accepted.
pub const EXIT_OK: i32 = 0;
/// Exit status: the input itself is unusable.
pub const EXIT_UNUSABLE: i32 = 2;
/// Exit status: one or more policies were rejected (verdicts still printed).
pub const EXIT_REJECTED: i32 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "ciliate",
    version,
    about = "Cilium-compatible network policy agent, simulator and CNI plugin"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Policy tools.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// What-if analysis: load a world (namespaces, pods, policies, probes) and print one JSON
    /// verdict per probe. Exit 0: all policies accepted; 3: some rejected; 2: unusable world.
    Simulate {
        /// The world file (YAML).
        #[arg(long)]
        world: PathBuf,
    },
    /// Print a synthetic world of the given size (for benchmarks and load tests).
    GenerateWorld {
        #[arg(long, default_value_t = 500)]
        namespaces: usize,
        #[arg(long, default_value_t = 5000)]
        pods: usize,
        #[arg(long, default_value_t = 2000)]
        policies: usize,
        #[arg(long, default_value_t = 10000)]
        probes: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// Runs `ciliate policy simulate`, writing verdicts to `out` and diagnostics to `err`.
/// Returns the exit status.
pub fn run_simulate(path: &std::path::Path, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let text = match std::fs::read(path) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(t) => t,
            Err(_) => {
                let _ = writeln!(err, "error: {}: not UTF-8 text", path.display());
                return EXIT_UNUSABLE;
            }
        },
        Err(e) => {
            let _ = writeln!(err, "error: {}: cannot read: {e}", path.display());
            return EXIT_UNUSABLE;
        }
    };
    let sim = match simulate::simulate(&text) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(err, "error: {}: {e}", path.display());
            return EXIT_UNUSABLE;
        }
    };
    for w in &sim.warnings {
        let _ = writeln!(err, "warning: {w}");
    }
    for r in &sim.rejections {
        let _ = writeln!(err, "error: rejected {r}");
    }
    for r in &sim.results {
        match serde_json::to_string(r) {
            Ok(line) => {
                let _ = writeln!(out, "{line}");
            }
            Err(e) => {
                let _ = writeln!(err, "error: cannot encode a result: {e}");
                return EXIT_UNUSABLE;
            }
        }
    }
    if sim.rejections.is_empty() {
        EXIT_OK
    } else {
        EXIT_REJECTED
    }
}
