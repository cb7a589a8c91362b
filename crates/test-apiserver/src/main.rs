//! `ciliate-test-apiserver`: the in-memory Kubernetes API server for local development without a
//! cluster (plain HTTP). It writes a kubeconfig that kubectl and `ciliate agent --kubeconfig`
//! accept, and serves until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// The in-memory Kubernetes API server ciliate's tests use (plain HTTP, JSON only).
#[derive(Debug, Parser)]
#[command(name = "ciliate-test-apiserver", version)]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Write a kubeconfig for kubectl and `ciliate agent --kubeconfig` here.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) =
        ciliate_test_apiserver::run_until_signal(args.listen, args.kubeconfig_out.as_deref())
    {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
