use clap::Parser;

use ciliate::cli::{run_simulate, Cli, Command, PolicyCommand};
use ciliate::simulate::generate::{generate_world, WorldSize};

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Policy {
            command: PolicyCommand::Simulate { world },
        } => {
            let stdout = std::io::stdout();
            let stderr = std::io::stderr();
            run_simulate(&world, &mut stdout.lock(), &mut stderr.lock())
        }
        Command::Policy {
            command:
                PolicyCommand::GenerateWorld {
                    namespaces,
                    pods,
                    policies,
                    probes,
                    seed,
                },
        } => {
            let size = WorldSize {
                namespaces,
                pods,
                policies,
                probes,
            };
            print!("{}", generate_world(size, seed));
            0
        }
    };
    std::process::exit(code);
}
