use clap::Parser;

use ciliate::cli::{run_simulate, Cli, Command, PolicyCommand};

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
    };
    std::process::exit(code);
}
