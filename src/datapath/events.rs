//! Policy verdict events from the datapath (the ring buffer), as `ciliate monitor` shows them.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::policy::rule::protocol_name;

/// One verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictEvent {
    /// Kernel monotonic time of the decision, in nanoseconds.
    pub timestamp_ns: u64,
    pub endpoint: u32,
    pub peer_identity: u32,
    pub direction: String,
    pub protocol: String,
    /// Destination port, or the ICMP type.
    pub port: u16,
    /// `allow` or `drop`.
    pub verdict: String,
    /// Why: `policy-deny`, `default-deny`, `not-realized`, `malformed`, `policy`, ...
    pub reason: String,
    pub source: String,
    pub destination: String,
}

impl VerdictEvent {
    /// One readable line, as `ciliate monitor` prints it.
    pub fn line(&self) -> String {
        format!(
            "{} {:<6} endpoint {} {} {} -> {} {}/{} peer identity {} ({})",
            self.timestamp_ns,
            self.verdict.to_uppercase(),
            self.endpoint,
            self.direction,
            self.source,
            self.destination,
            self.protocol,
            self.port,
            self.peer_identity,
            self.reason
        )
    }
}

/// Builds an event from the datapath's raw fields.
#[allow(clippy::too_many_arguments)]
pub fn verdict_event(
    timestamp_ns: u64,
    endpoint: u32,
    peer_identity: u32,
    egress: bool,
    protocol: u8,
    port: u16,
    reason: &str,
    family: u8,
    saddr: [u8; 16],
    daddr: [u8; 16],
) -> VerdictEvent {
    let addr = |a: [u8; 16]| -> String {
        if family == 4 {
            IpAddr::from([a[0], a[1], a[2], a[3]]).to_string()
        } else {
            IpAddr::from(a).to_string()
        }
    };
    let (verdict, reason) = match reason.split_once('-') {
        Some((v @ ("allow" | "drop" | "pass"), r)) => (v.to_string(), r.to_string()),
        _ => ("drop".to_string(), reason.to_string()),
    };
    VerdictEvent {
        timestamp_ns,
        endpoint,
        peer_identity,
        direction: if egress { "egress" } else { "ingress" }.into(),
        protocol: protocol_name(protocol),
        port,
        verdict,
        reason,
        source: addr(saddr),
        destination: addr(daddr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_render_as_one_line() {
        let mut s = [0u8; 16];
        s[..4].copy_from_slice(&[10, 0, 0, 1]);
        let mut d = [0u8; 16];
        d[..4].copy_from_slice(&[10, 0, 0, 2]);
        let e = verdict_event(7, 2, 300, false, 6, 8080, "drop-default-deny", 4, s, d);
        assert_eq!(e.verdict, "drop");
        assert_eq!(e.reason, "default-deny");
        assert_eq!(e.line(), "7 DROP   endpoint 2 ingress 10.0.0.1 -> 10.0.0.2 TCP/8080 peer identity 300 (default-deny)");
    }
}
