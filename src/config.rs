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

/// `--enable-policy` (Cilium's enforcement modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyEnforcement {
    /// An endpoint is isolated in a direction once a policy selects it there.
    #[default]
    Default,
    /// Every endpoint is isolated in both directions, policy or not (default deny).
    Always,
    /// Nothing is enforced; verdicts are still reported (as audit, what would be dropped).
    Never,
}

/// The agent-wide enforcement settings every endpoint applies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Enforcement {
    pub mode: PolicyEnforcement,
    /// `--policy-audit-mode`: every endpoint audits instead of dropping.
    pub audit: bool,
    /// `--enable-host-firewall`: the node is an endpoint too (`endpoint::host`).
    pub host_firewall: bool,
}

impl Enforcement {
    /// The datapath flags of an endpoint: `isolated` per direction as its policies say,
    /// `audit` its own setting (`endpoint config ... PolicyAuditMode`).
    pub fn apply(
        &self,
        ingress_isolated: bool,
        egress_isolated: bool,
        audit: bool,
    ) -> (bool, bool, bool) {
        match self.mode {
            PolicyEnforcement::Default => (ingress_isolated, egress_isolated, audit || self.audit),
            PolicyEnforcement::Always => (true, true, audit || self.audit),
            PolicyEnforcement::Never => (ingress_isolated, egress_isolated, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforcement_modes_as_cilium_has_them() {
        let e = |mode, audit| Enforcement {
            mode,
            audit,
            host_firewall: false,
        };
        let d = e(PolicyEnforcement::Default, false);
        assert_eq!(d.apply(true, false, false), (true, false, false));
        assert_eq!(
            d.apply(true, false, true),
            (true, false, true),
            "per endpoint"
        );
        assert_eq!(
            e(PolicyEnforcement::Default, true).apply(false, false, false),
            (false, false, true)
        );
        assert_eq!(
            e(PolicyEnforcement::Always, false).apply(false, false, false),
            (true, true, false)
        );
        assert_eq!(
            e(PolicyEnforcement::Never, false).apply(true, true, false),
            (true, true, true)
        );
    }
}

/// How the agent gets its DNS proxy (`--dns-proxy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DnsProxyMode {
    Auto,
    External,
    Disabled,
}
