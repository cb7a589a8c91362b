//! Validation and conversion shared by every policy kind: label selectors, CIDRs, ports,
//! protocols, entities and ICMP types.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Ctx, PolicyError};
use crate::policy::api;
use crate::policy::labels::{
    label_value_error, selector_key_error, shorten, split_selector_key, CLUSTER_LABEL,
    DEFAULT_CLUSTER_NAME, NAMESPACE_LABELS_PREFIX, POD_NAMESPACE_LABEL, SOURCE_K8S,
    SOURCE_RESERVED,
};
use crate::policy::rule::{PortSpec, Protocol};
use crate::policy::selector::{CidrSelector, LabelSelector, Operator, Requirement};

/// Converts a Kubernetes label selector, validating operators and values.
pub fn label_selector(
    ctx: &Ctx,
    raw: &api::LabelSelector,
    path: &str,
) -> Result<LabelSelector, PolicyError> {
    let mut reqs = Vec::new();
    for (k, v) in raw.match_labels.iter().flatten() {
        let (source, key) = split_selector_key(k);
        if key.is_empty() {
            return Err(ctx.err(
                format!("{path}.matchLabels"),
                format!("empty label key {k:?}"),
            ));
        }
        if let Some(m) = selector_key_error(k) {
            return Err(ctx.err(
                format!("{path}.matchLabels"),
                format!("label key {}: {m}", shorten(k)),
            ));
        }
        if let Some(m) = label_value_error(v) {
            return Err(ctx.err(
                format!("{path}.matchLabels"),
                format!("value {} of label key {}: {m}", shorten(v), shorten(k)),
            ));
        }
        reqs.push(Requirement::new(source, key, Operator::In, vec![v.clone()]));
    }
    for (i, e) in raw.match_expressions.iter().flatten().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        let raw_key = e.key.as_deref().unwrap_or("");
        let (source, key) = split_selector_key(raw_key);
        if key.is_empty() {
            return Err(ctx.err(format!("{p}.key"), "missing label key"));
        }
        if let Some(m) = selector_key_error(raw_key) {
            return Err(ctx.err(
                format!("{p}.key"),
                format!("label key {}: {m}", shorten(raw_key)),
            ));
        }
        let op = match e.operator.as_deref() {
            Some("In") => Operator::In,
            Some("NotIn") => Operator::NotIn,
            Some("Exists") => Operator::Exists,
            Some("DoesNotExist") => Operator::DoesNotExist,
            Some(other) => {
                return Err(ctx.err(
                    format!("{p}.operator"),
                    format!("invalid operator {other:?} (must be one of In, NotIn, Exists, DoesNotExist; case matters)"),
                ))
            }
            None => return Err(ctx.err(format!("{p}.operator"), "missing operator")),
        };
        let values = e.values.clone().unwrap_or_default();
        for (j, v) in values.iter().enumerate() {
            if let Some(m) = label_value_error(v) {
                return Err(ctx.err(
                    format!("{p}.values[{j}]"),
                    format!("value {}: {m}", shorten(v)),
                ));
            }
        }
        match op {
            Operator::In | Operator::NotIn if values.is_empty() => {
                return Err(ctx.err(
                    format!("{p}.values"),
                    format!("operator {op} needs at least one value"),
                ))
            }
            Operator::Exists | Operator::DoesNotExist if !values.is_empty() => {
                return Err(ctx.err(
                    format!("{p}.values"),
                    format!("operator {op} takes no values"),
                ))
            }
            _ => {}
        }
        reqs.push(Requirement::new(source, key, op, values));
    }
    Ok(LabelSelector::new(reqs))
}

/// True when the selector names `reserved:init` (policies for initializing endpoints).
pub fn selects_init(sel: &LabelSelector) -> bool {
    sel.requirements()
        .iter()
        .any(|r| r.key == "init" && r.source.as_deref() == Some(SOURCE_RESERVED))
}

/// Scopes a CNP/CCNP peer selector (`fromEndpoints`, `toEndpoints`, `*Requires`) the way
/// Cilium's `getEndpointSelector` does: a namespaced policy's selectors only see its own
/// namespace unless they name the namespace (or namespace labels); a clusterwide policy's
/// selectors only see pods (anything with a namespace label).
pub fn scope_peer_selector(
    mut sel: LabelSelector,
    namespace: Option<&str>,
    reserved_passthrough: bool,
    subject_selects_init: bool,
) -> LabelSelector {
    if reserved_passthrough && sel.has_reserved_key() {
        return sel;
    }
    if subject_selects_init || sel.has_key(POD_NAMESPACE_LABEL) {
        return sel;
    }
    match namespace {
        None => sel.add(Requirement::new(
            Some(SOURCE_K8S.into()),
            POD_NAMESPACE_LABEL.into(),
            Operator::Exists,
            vec![],
        )),
        Some(ns) => {
            if !sel.has_key_prefix(NAMESPACE_LABELS_PREFIX) {
                sel.add(Requirement::equals(
                    Some(SOURCE_K8S),
                    POD_NAMESPACE_LABEL,
                    ns,
                ));
            }
        }
    }
    sel
}

/// Pins a subject selector to the policy's namespace (replacing any namespace the user wrote,
/// as Cilium does: a namespaced policy can never select endpoints of another namespace).
pub fn scope_subject_selector(sel: LabelSelector, namespace: &str) -> LabelSelector {
    let mut reqs: Vec<Requirement> = sel
        .requirements()
        .iter()
        .filter(|r| !(r.key == POD_NAMESPACE_LABEL && r.source.as_deref() == Some(SOURCE_K8S)))
        .cloned()
        .collect();
    reqs.push(Requirement::equals(
        Some(SOURCE_K8S),
        POD_NAMESPACE_LABEL,
        namespace,
    ));
    LabelSelector::new(reqs)
}

/// Parses `10.0.0.0/8`, `2001:db8::/32`, or a bare address (a host prefix).
pub fn parse_cidr(s: &str) -> Result<IpNet, String> {
    let t = s.trim();
    if t.contains('/') {
        t.parse::<IpNet>()
            .map(|n| n.trunc())
            .map_err(|_| format!("malformed CIDR {s:?}"))
    } else {
        t.parse::<IpAddr>()
            .map(IpNet::from)
            .map_err(|_| format!("malformed CIDR {s:?}"))
    }
}

/// Validates a CIDR with its `except` list (each except must lie inside the CIDR).
pub fn cidr_selector(
    ctx: &Ctx,
    cidr: Option<&str>,
    except: Option<&Vec<String>>,
    path: &str,
    strict_subset: bool,
) -> Result<CidrSelector, PolicyError> {
    let Some(c) = cidr.filter(|c| !c.trim().is_empty()) else {
        return Err(ctx.err(format!("{path}.cidr"), "missing cidr"));
    };
    let prefix = parse_cidr(c).map_err(|m| ctx.err(format!("{path}.cidr"), m))?;
    let mut ex = Vec::new();
    for (i, e) in except.into_iter().flatten().enumerate() {
        let ep = format!("{path}.except[{i}]");
        let n = parse_cidr(e).map_err(|m| ctx.err(&ep, m))?;
        let inside =
            prefix.contains(&n) && (!strict_subset || n.prefix_len() > prefix.prefix_len());
        if !inside {
            return Err(ctx.err(ep, format!("except {n} is not inside cidr {prefix}")));
        }
        ex.push(n);
    }
    Ok(CidrSelector::new(prefix, ex))
}

/// IANA service name rules (RFC 6335), as Kubernetes and Cilium apply them to named ports:
/// 1-15 characters of letters, digits and '-', at least one letter, no leading, trailing or
/// doubled '-'.
pub fn is_iana_service_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && s.chars().any(|c| c.is_ascii_alphabetic())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Kubernetes' port names (`IsValidPortName`): an IANA service name in lower case.
pub fn is_kubernetes_port_name(s: &str) -> bool {
    is_iana_service_name(s) && !s.bytes().any(|c| c.is_ascii_uppercase())
}

/// A numeric port string as Cilium reads it: `strconv.ParseUint(s, 0, 16)`, so a leading `0`
/// means octal (`"010"` is 8, `"080"` is no number), `0x`/`0o`/`0b` prefixes work, and `_` may
/// separate digits. Nothing else, not even a space, is allowed.
fn go_parse_port(s: &str) -> Option<u16> {
    let lower = s.to_ascii_lowercase();
    let (body, radix, prefixed) = if let Some(r) = lower.strip_prefix("0x") {
        (r, 16, true)
    } else if let Some(r) = lower.strip_prefix("0o") {
        (r, 8, true)
    } else if let Some(r) = lower.strip_prefix("0b") {
        (r, 2, true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (&lower[1..], 8, true)
    } else {
        (lower.as_str(), 10, false)
    };
    let bytes = body.as_bytes();
    // Go: an underscore follows a digit (or the base prefix) and precedes a digit.
    let mut after_digit = prefixed;
    let mut any = false;
    let mut n: u32 = 0;
    for (i, &c) in bytes.iter().enumerate() {
        if c == b'_' {
            let next_digit = bytes
                .get(i + 1)
                .is_some_and(|d| char::from(*d).is_digit(radix));
            if !after_digit || !next_digit {
                return None;
            }
            after_digit = false;
            continue;
        }
        n = n * radix + char::from(c).to_digit(radix)?;
        if n > u32::from(u16::MAX) {
            return None;
        }
        after_digit = true;
        any = true;
    }
    any.then_some(n as u16)
}

/// The start of a port spec: `None` for "every port", else a number or a port name.
enum PortStart {
    Any,
    Number(u16),
    Named(String),
}

/// A port written as a string. Kubernetes (`kubernetes`, for KNPs) takes a string only as a
/// port name, as the API server's `IsValidPortName` does; Cilium takes an IANA service name
/// (any case, lowered) or a number as `strconv.ParseUint(s, 0, 16)` reads it.
fn port_string(ctx: &Ctx, s: &str, path: &str, kubernetes: bool) -> Result<PortStart, PolicyError> {
    if kubernetes {
        if is_kubernetes_port_name(s) {
            return Ok(PortStart::Named(s.to_string()));
        }
        let hint = if !s.is_empty() && s.trim().bytes().all(|c| c.is_ascii_digit()) {
            " (a string port is a port name; write a number without quotes)"
        } else {
            ""
        };
        return Err(ctx.err(
            path,
            format!(
                "invalid port name {}: 1-15 lower-case letters, digits and '-', with at least one letter{hint}",
                shorten(s)
            ),
        ));
    }
    if s.is_empty() {
        return Err(ctx.err(path, "port must be specified"));
    }
    if is_iana_service_name(s) {
        return Ok(PortStart::Named(s.to_ascii_lowercase()));
    }
    match go_parse_port(s) {
        Some(0) => Ok(PortStart::Any),
        Some(n) => Ok(PortStart::Number(n)),
        None => Err(ctx.err(
            path,
            format!(
                "unable to parse port {}: neither a number in 0..65535 nor a valid port name{}",
                shorten(s),
                if s.starts_with('0') {
                    " (Cilium reads a leading 0 as octal)"
                } else {
                    ""
                }
            ),
        )),
    }
}

/// Parses a port (number, numeric string, or named port) and its optional `endPort`.
/// `kubernetes`: a KNP port, checked as the API server does (a missing port means every port;
/// a number is 1..65535; a string is a port name), else a CNP port, checked as Cilium does.
pub fn port_spec(
    ctx: &Ctx,
    port: Option<&api::IntOrString>,
    end_port: Option<i64>,
    path: &str,
    kubernetes: bool,
) -> Result<PortSpec, PolicyError> {
    let port_path = format!("{path}.port");
    let end_path = format!("{path}.endPort");
    let lowest = if kubernetes { 1 } else { 0 };
    let numeric = |n: i64, p: &str, what: &str| -> Result<u16, PolicyError> {
        u16::try_from(n)
            .ok()
            .filter(|v| *v >= lowest)
            .ok_or_else(|| ctx.err(p, format!("{what} {n} is outside {lowest}..65535")))
    };
    let start = match port {
        None if kubernetes => PortStart::Any,
        None => return Err(ctx.err(&port_path, "port must be specified")),
        Some(api::IntOrString::Int(n)) => match numeric(*n, &port_path, "port")? {
            0 => PortStart::Any,
            v => PortStart::Number(v),
        },
        Some(api::IntOrString::Str(s)) => port_string(ctx, s, &port_path, kubernetes)?,
    };
    // A CNP's `endPort: 0` means no range; Kubernetes validates any endPort given.
    let end = match end_port {
        Some(0) if !kubernetes => None,
        e => e,
    };
    match (start, end) {
        (PortStart::Named(name), None) => Ok(PortSpec::Named(name)),
        (PortStart::Named(name), Some(_)) => Err(ctx.err(
            end_path,
            format!(
                "endPort cannot be used with the named port {}",
                shorten(&name)
            ),
        )),
        (PortStart::Any, None) => Ok(PortSpec::Range(0, 65535)),
        (PortStart::Any, Some(_)) if kubernetes || port.is_none() => {
            Err(ctx.err(end_path, "endPort needs a numeric port"))
        }
        // Cilium: port 0 is every port, whatever endPort says.
        (PortStart::Any, Some(_)) => Ok(PortSpec::Range(0, 65535)),
        (PortStart::Number(p), None) => Ok(PortSpec::Range(p, p)),
        (PortStart::Number(p), Some(e)) => {
            let end = numeric(e, &end_path, "endPort")?;
            if end < p {
                return Err(ctx.err(end_path, format!("endPort {end} is smaller than port {p}")));
            }
            Ok(PortSpec::Range(p, end))
        }
    }
}

/// A CNP port protocol: TCP, UDP, SCTP or ANY (any case), omitted meaning ANY.
pub fn cilium_protocol(
    ctx: &Ctx,
    proto: Option<&str>,
    path: &str,
) -> Result<Protocol, PolicyError> {
    match proto.map(|p| p.trim().to_ascii_uppercase()).as_deref() {
        None | Some("") | Some("ANY") => Ok(Protocol::Any),
        Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(_) => Err(ctx.err(
            path,
            format!(
                "unknown protocol {:?} (must be TCP, UDP, SCTP or ANY; ICMP goes in icmps)",
                proto.unwrap_or_default()
            ),
        )),
    }
}

/// A KNP port protocol: TCP, UDP or SCTP (exact), omitted meaning TCP.
pub fn knp_protocol(ctx: &Ctx, proto: Option<&str>, path: &str) -> Result<Protocol, PolicyError> {
    match proto {
        None => Ok(Protocol::Tcp),
        Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(p) => Err(ctx.err(
            path,
            format!("unknown protocol {p:?} (must be TCP, UDP or SCTP)"),
        )),
    }
}

/// What an entity selects.
pub enum EntitySelection {
    /// Every identity (`all`).
    All,
    /// Identities matching any of these selectors (empty: `none`).
    Selectors(Vec<LabelSelector>),
}

fn reserved(name: &str) -> LabelSelector {
    LabelSelector::new(vec![Requirement::equals(Some(SOURCE_RESERVED), name, "")])
}

/// The selectors behind an entity name, or `None` for an unknown entity.
pub fn entity(name: &str) -> Option<EntitySelection> {
    let sels = match name {
        "all" => return Some(EntitySelection::All),
        "none" => vec![],
        "world" => vec![
            reserved("world"),
            reserved("world-ipv4"),
            reserved("world-ipv6"),
        ],
        "world-ipv4" => vec![reserved("world-ipv4")],
        "world-ipv6" => vec![reserved("world-ipv6")],
        "cluster" => vec![
            reserved("host"),
            reserved("remote-node"),
            reserved("health"),
            reserved("init"),
            reserved("kube-apiserver"),
            reserved("ingress"),
            LabelSelector::new(vec![Requirement::equals(
                Some(SOURCE_K8S),
                CLUSTER_LABEL,
                DEFAULT_CLUSTER_NAME,
            )]),
        ],
        "host" | "remote-node" | "kube-apiserver" | "health" | "init" | "unmanaged" | "ingress" => {
            vec![reserved(name)]
        }
        _ => return None,
    };
    Some(EntitySelection::Selectors(sels))
}

/// ICMP type names Cilium accepts in `icmps.fields.type`.
pub fn icmp_type_from_name(name: &str, v6: bool) -> Option<u8> {
    const V4: &[(&str, u8)] = &[
        ("EchoReply", 0),
        ("DestinationUnreachable", 3),
        ("Redirect", 5),
        ("Echo", 8),
        ("EchoRequest", 8),
        ("RouterAdvertisement", 9),
        ("RouterSelection", 10),
        ("TimeExceeded", 11),
        ("ParameterProblem", 12),
        ("Timestamp", 13),
        ("TimestampReply", 14),
        ("Photuris", 40),
        ("ExtendedEchoRequest", 42),
        ("ExtendedEchoReply", 43),
    ];
    const V6: &[(&str, u8)] = &[
        ("DestinationUnreachable", 1),
        ("PacketTooBig", 2),
        ("TimeExceeded", 3),
        ("ParameterProblem", 4),
        ("EchoRequest", 128),
        ("EchoReply", 129),
        ("MulticastListenerQuery", 130),
        ("MulticastListenerReport", 131),
        ("MulticastListenerDone", 132),
        ("RouterSolicitation", 133),
        ("RouterAdvertisement", 134),
        ("NeighborSolicitation", 135),
        ("NeighborAdvertisement", 136),
        ("RedirectMessage", 137),
        ("RouterRenumbering", 138),
        ("ICMPNodeInformationQuery", 139),
        ("ICMPNodeInformationResponse", 140),
        ("InverseNeighborDiscoverySolicitation", 141),
        ("InverseNeighborDiscoveryAdvertisement", 142),
        ("HomeAgentAddressDiscoveryRequest", 144),
        ("HomeAgentAddressDiscoveryReply", 145),
        ("MobilePrefixSolicitation", 146),
        ("MobilePrefixAdvertisement", 147),
        ("DuplicateAddressRequestCodeSuffix", 157),
        ("DuplicateAddressConfirmationCodeSuffix", 158),
        ("ExtendedEchoRequest", 160),
        ("ExtendedEchoReply", 161),
    ];
    let table = if v6 { V6 } else { V4 };
    table.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The pods of the namespaces `ns` selects that `pods` selects (every pod when absent; never
/// a reserved identity or a host-networked pod: they have no namespace label). Namespace
/// labels reach pods as `io.cilium.k8s.namespace.labels.<key>`.
pub fn pods_in_namespaces(
    ctx: &Ctx,
    ns: Option<&api::LabelSelector>,
    pods: Option<&api::LabelSelector>,
    ns_path: &str,
    pods_path: &str,
) -> Result<LabelSelector, PolicyError> {
    let mut reqs: Vec<Requirement> = Vec::new();
    if let Some(p) = pods {
        reqs.extend(
            label_selector(ctx, p, pods_path)?
                .requirements()
                .iter()
                .cloned(),
        );
    }
    if let Some(n) = ns {
        // Namespace labels reach pods as io.cilium.k8s.namespace.labels.<key>.
        for r in label_selector(ctx, n, ns_path)?.requirements() {
            reqs.push(Requirement::new(
                Some(SOURCE_K8S.into()),
                format!("{NAMESPACE_LABELS_PREFIX}{}", r.key),
                r.op,
                r.values.clone(),
            ));
        }
    }
    reqs.push(Requirement::new(
        Some(SOURCE_K8S.into()),
        POD_NAMESPACE_LABEL.into(),
        Operator::Exists,
        vec![],
    ));
    Ok(LabelSelector::new(reqs))
}

#[cfg(test)]
mod tests {
    use super::go_parse_port;

    #[test]
    fn numeric_port_strings_parse_as_go_base_0() {
        for (s, want) in [
            ("80", Some(80)),
            ("0", Some(0)),
            ("00", Some(0)),
            ("010", Some(8)),
            ("0x50", Some(80)),
            ("0o17", Some(15)),
            ("0b101", Some(5)),
            ("1_000", Some(1000)),
            ("0_10", Some(8)),
            ("65535", Some(65535)),
            ("080", None),
            (" 80", None),
            ("80 ", None),
            ("+80", None),
            ("65536", None),
            ("_80", None),
            ("80_", None),
            ("8__0", None),
            ("0x", None),
            ("", None),
            ("99999999999999999999", None),
        ] {
            assert_eq!(go_parse_port(s), want, "{s:?}");
        }
    }
}
