//! Settings types that several parts of the program name (the CLI parses them, the agent and
//! the CNI plugin act on them). A leaf: it imports nothing of the crate.

/// The agent's API socket when none is given (`--api-socket`, `--socket`, `agentSocket`).
pub const DEFAULT_SOCKET: &str = "/var/run/ciliate/ciliate.sock";

/// Where the cluster state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Standalone,
    Kubernetes,
}

/// Which datapath enforces policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatapathKind {
    Bpf,
    Memory,
}
